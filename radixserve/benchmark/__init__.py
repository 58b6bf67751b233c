"""The shared-prompt benchmark suite: ``radixserve bench WORKLOAD [options]``.

One module per concept: ``workloads`` (what is sent), ``runner`` (when it is
sent, and per-request timing), ``backends`` (radixserve's ZeroMQ client or any
OpenAI-compatible HTTP server), ``optimal`` (the best hit rate any cache could
reach on the exact token sequences sent), ``metrics`` (one run's numbers),
``report`` (table, JSON, PNG), ``server`` (fresh servers for ``--compare``),
``cli`` (the command line). See docs/benchmark.md.
"""

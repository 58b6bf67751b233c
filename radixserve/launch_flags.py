"""``radixserve launch``'s flags, and the one place its command line becomes a
``ServerConfig``: one flag per ``EngineConfig`` field, whose dest is the field's
name (``config_from_args``), plus the server's own (sockets, events, CURVE keys,
nodes). The API keys never enter the config (``http_keys``).

``--disk-cache-dir`` alone gets a host tier sized from the memory free at launch
(``default_host_cache_gb``, printed), since pages reach the disk through host
memory; ``--host-cache-gb`` given, even 0, is taken as it is.

``radixserve`` (``cli.py``) mounts these flags as its ``launch`` subcommand;
``radixserve bench`` reads them to launch its variants and to build an in-process
``Engine`` exactly as a launch would (``launch_parser``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import fields

from radixserve.config import EngineConfig
from radixserve.sampling_params import MAX_N
from radixserve.server_config import ServerConfig
from radixserve.utils.descriptors import add_connection_arguments
from radixserve.worker.config import DTYPE_CHOICES, KV_CACHE_DTYPES, PREFILL_BACKENDS

#: The largest host tier ``--disk-cache-dir`` gets by itself, in GiB.
HOST_TIER_CAP_GB = 16.0

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "4GiB", "512M" or a plain integer (K/M/G/T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    scale = 1024 ** " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * scale)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _max_n(text: str) -> int:
    value = _positive(text)
    if value > MAX_N:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_N}, got {value}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _gib(text: str) -> float:
    value = float(text)
    if not value >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0 GiB, got {text}")
    return value


def _positive_gib(text: str) -> float:
    value = _gib(text)
    if value == 0.0:
        raise argparse.ArgumentTypeError("must be > 0 GiB")
    return value


def add_launch_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of ``radixserve launch`` on ``p``."""
    d = EngineConfig()
    p.add_argument(
        "--model",
        default=d.model,
        help="'smollm2' (the embedded SmolLM2-135M-Instruct), an HF folder, or a .gguf file",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the public socket binds")
    p.add_argument("--port", type=int, default=30000, help="public TCP port; 0 picks a free one")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI-compatible HTTP API (and /metrics) on this port of "
        "--http-host; 0 picks a free one (printed); without it: no HTTP front",
    )
    p.add_argument(
        "--http-host",
        default=None,
        help="address the HTTP front binds (default: --host); e.g. 0.0.0.0 serves HTTP "
        "beyond loopback while the ZeroMQ socket stays on 127.0.0.1",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model id the HTTP API answers to (default: the model's name); as vLLM's, "
        "several names are all accepted and the first is the one answers carry",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json", "mistral", "qwen3_xml"),
        default=None,
        help="the model's tool-call format (vLLM's names): the HTTP API's tool_choice "
        '"auto" reads calls out of free output with it (without it: a 400)',
    )
    p.add_argument("--page-size", type=_positive, default=d.page_size, help="tokens per KV page")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=_positive, default=None, help="KV pool size in pages")
    pool.add_argument(
        "--kv-memory",
        type=parse_size,
        default=None,
        help="KV pool size in bytes (e.g. 2GiB); without this or --num-pages: 1 GiB",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d.kv_cache_dtype,
        help="what the KV pool stores: auto (the model's dtype), bfloat16, float32, or "
        "int8/fp8_e4m3/fp8_e5m2 codes with a scale per token and kv head (about twice the "
        "tokens per GiB; the banner prints tokens_per_gib)",
    )
    p.add_argument(
        "--cache",
        choices=["radix", "none"],
        default=d.cache,
        help="radix: keep KV in the prefix tree; none: free it when a request ends",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=d.dtype,
        help="auto: bfloat16 on CPUs with AVX512_BF16/AMX, else float32; on CUDA the model's",
    )
    p.add_argument("--device", default=d.device, help="torch device of the worker")
    p.add_argument(
        "--max-running-requests",
        type=_positive,
        default=d.max_running_requests,
        help="requests decoding at once (worker slots)",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=_positive,
        default=d.chunked_prefill_size,
        help="most prompt tokens computed per step",
    )
    p.add_argument(
        "--decode-step-tokens",
        type=_non_negative,
        default=d.decode_step_tokens,
        help="while requests decode, the most tokens a step carries (their decode rows, "
        "then prompt tokens: at least one page, at most --chunked-prefill-size), so a "
        "long prefill does not stall them; 0: off, every step may prefill "
        "--chunked-prefill-size",
    )
    p.add_argument(
        "--schedule-policy",
        choices=["lpm", "fcfs", "priority"],
        default=d.schedule_policy,
        help="lpm: longest cached prefix first (with aging); fcfs: arrival order; priority: "
        "a request's priority first (lower first, as vLLM's), lpm within a level, and a "
        "request that cannot be admitted preempts running ones of a worse priority",
    )
    p.add_argument(
        "--radix-eviction-policy",
        choices=["lru", "lfu", "priority"],
        default=d.radix_eviction_policy,
        help="which cached prefixes go first under memory pressure: lru, lfu (fewest hits), "
        "or priority (requests' cache_retention hints, then lru); lfu and priority run the "
        "Python radix tree",
    )
    p.add_argument(
        "--max-retained-share",
        type=float,
        default=d.max_retained_share,
        help="with --radix-eviction-policy priority: the most of the KV pool one tenant "
        "(cache_salt) may hold under cache_retention hints (a hint past it is not applied)",
    )
    p.add_argument(
        "--max-preemptions",
        type=_non_negative,
        default=d.max_preemptions,
        help="with --schedule-policy priority: a request preempted this many times is not "
        "preempted again",
    )
    p.add_argument(
        "--lpm-max-waiting",
        type=_non_negative,
        default=d.lpm_max_waiting,
        help="with more requests waiting than this, lpm admits in arrival order",
    )
    p.add_argument(
        "--max-wait-steps",
        type=_non_negative,
        default=d.max_wait_steps,
        help="aging: a request passed over for this many steps is admitted first",
    )
    p.add_argument(
        "--decode-reserve-ratio",
        type=_ratio,
        default=d.decode_reserve_ratio,
        help="share of running requests' remaining decode pages kept free at admission; "
        "lower admits more and relies on eviction and retraction",
    )
    p.add_argument(
        "--decode-reserve-min-ratio",
        type=_ratio,
        default=d.decode_reserve_min_ratio,
        help="the reserve ratio falls to this (at most --decode-reserve-ratio) while "
        "nothing is retracted; a retraction puts it back to --decode-reserve-ratio",
    )
    p.add_argument(
        "--decode-reserve-decay-steps",
        type=_non_negative,
        default=d.decode_reserve_decay_steps,
        help="steps over which the reserve ratio falls to its min (0: it never falls)",
    )
    p.add_argument(
        "--max-admit-skips",
        type=_non_negative,
        default=d.max_admit_skips,
        help="waiting requests that do not fit passed over per step before admission "
        "stops (the requests behind them are still admitted)",
    )
    p.add_argument(
        "--shared-prefix-min-tokens",
        type=_non_negative,
        default=d.shared_prefix_min_tokens,
        help="hold a waiting request back while it shares at least this many uncached "
        "prefix tokens with a prompt being prefilled (it then hits them in the tree)",
    )
    p.add_argument(
        "--speculative-algorithm",
        choices=["off", "ngram", "radix"],
        default=d.speculative_algorithm,
        help="speculative decoding's drafts: ngram (prompt lookup over the request's own "
        "tokens) or radix (what followed the same tokens in the radix tree, same cache "
        "salt only, then ngram); verified losslessly (docs/speculative.md)",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=_non_negative,
        default=d.speculative_num_draft_tokens,
        help="draft tokens per request and step at most",
    )
    p.add_argument(
        "--speculative-min-match",
        type=_positive,
        default=d.speculative_min_match,
        help="ngram drafts: the shortest suffix of a request's tokens that must have "
        "occurred before in them",
    )
    p.add_argument(
        "--speculative-max-batch",
        type=_non_negative,
        default=d.speculative_max_batch,
        help="no drafts in a step where more requests than this decode",
    )
    p.add_argument(
        "--host-cache-gb",
        type=_gib,
        default=None,
        help="the KV cache's host tier: GiB of host memory (pinned on CUDA) that keeps "
        "pages evicted from the pool and gives them back on a hit; 0: off; not given: "
        "off, or with --disk-cache-dir a quarter of the free host memory (at most "
        f"{HOST_TIER_CAP_GB:g} GiB, printed) (docs/cache-tiers.md)",
    )
    p.add_argument(
        "--disk-cache-dir",
        default=d.disk_cache_dir,
        help="the KV cache's disk tier: a directory of page files, written through as "
        "pages are computed, that survives restarts (through a host tier: "
        "--host-cache-gb, or one sized from free memory)",
    )
    p.add_argument(
        "--disk-cache-gb",
        type=_positive_gib,
        default=d.disk_cache_gb,
        help="the disk tier's size bound in GiB (least recently used files go first)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=d.lora_modules,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) "
        "served beside the base model; a request picks one by name (HTTP: the model "
        "field) (docs/lora.md)",
    )
    p.add_argument(
        "--max-loras",
        type=_positive,
        default=d.max_loras,
        help="LoRA adapters whose requests may run in one batch (the base model not counted)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=_positive,
        default=d.max_lora_rank,
        help="the highest LoRA rank accepted; an adapter above it is refused",
    )
    p.add_argument(
        "--radix-impl",
        choices=["auto", "python", "native"],
        default=d.radix_impl,
        help="radix tree implementation; auto: native when built",
    )
    p.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        help="auto (flashinfer on CUDA when its start-up probe passes, else torch) | torch "
        "| flashinfer (fails at start, with the reason, when it cannot run)",
    )
    p.add_argument(
        "--state-snapshots",
        type=_positive,
        default=d.state_snapshots,
        help="hybrid models: recurrent-state snapshots the prefix cache may keep, each "
        "one request's state (default: --max-running-requests)",
    )
    p.add_argument(
        "--sliding-pool-pages",
        type=int,
        default=d.sliding_pool_pages,
        help="models with sliding-window layers: pages of the window pool holding those "
        "layers' K/V (default: sized from the KV budget; 0: one pool for every layer)",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        default=d.disable_cuda_graph,
        help="run decode steps eagerly instead of replaying CUDA graphs (graphs: CUDA "
        "with the flashinfer backend only)",
    )
    p.add_argument(
        "--flashinfer-prefill-backend",
        choices=PREFILL_BACKENDS,
        default=d.flashinfer_prefill_backend,
        help="flashinfer's prefill kernels: auto (fa3 on Hopper, else fa2), fa2 or fa3; "
        "fa2 JIT-builds much faster where no prebuilt kernels are installed",
    )
    p.add_argument(
        "--decode-kernel",
        choices=["auto", "native", "torch"],
        default=d.decode_kernel,
        help="torch backend's decode attention: native (reads KV pages in place; CPU, "
        "float32/float64/bfloat16) or torch (gather + SDPA); auto: native where it runs",
    )
    p.add_argument(
        "--cache-dir",
        default=d.cache_dir,
        help="converted-model cache dir (default: $RADIXSERVE_CACHE_DIR or ~/.cache/radixserve)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seeds requests that bring no seed")
    lim = p.add_argument_group("limits on client input (docs/security.md)")
    lim.add_argument(
        "--max-message-bytes",
        type=parse_size,
        default=d.max_message_bytes,
        help="largest message the public socket accepts (ZMQ_MAXMSGSIZE); a client "
        "sending a larger one is disconnected",
    )
    lim.add_argument(
        "--max-queued-replies",
        type=_positive,
        default=d.max_queued_replies,
        help="replies queued for one client that does not read them (send high-water "
        "mark) before it is treated as gone and its requests aborted",
    )
    lim.add_argument(
        "--max-requests-per-client",
        type=_positive,
        default=d.max_requests_per_client,
        help="requests in flight per client connection (the HTTP front is one client)",
    )
    add_connection_arguments(lim)
    lim.add_argument(
        "--max-prompt-chars",
        type=_positive,
        default=d.max_prompt_chars,
        help="characters of a prompt (or of a chat's content, tool calls and tools), checked "
        "before tokenizing",
    )
    lim.add_argument(
        "--max-prompt-tokens",
        type=_positive,
        default=d.max_prompt_tokens,
        help="prompt tokens; default: the model's context less one",
    )
    lim.add_argument(
        "--max-stop",
        type=_non_negative,
        default=d.max_stop,
        help="stop strings per request, and stop token ids per request",
    )
    lim.add_argument(
        "--max-stop-len", type=_positive, default=d.max_stop_len, help="characters per stop string"
    )
    lim.add_argument(
        "--max-n", type=_max_n, default=d.max_n, help=f"samples per request (at most {MAX_N})"
    )
    lim.add_argument(
        "--chat-special-tokens",
        action="store_true",
        default=d.chat_special_tokens,
        help="let special tokens typed inside chat message content act as control "
        "tokens (by default they are plain text)",
    )
    so = p.add_argument_group("structured output (docs/structured.md)")
    so.add_argument(
        "--grammar-cache-size",
        type=_non_negative,
        default=d.grammar_cache_size,
        help="compiled grammars kept for reuse once no request uses them",
    )
    so.add_argument(
        "--jump-forward",
        action=argparse.BooleanOptionalAction,
        default=d.jump_forward,
        help="append the tokens a grammar forces without sampling them one by one",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=d.deterministic,
        help="batch-invariant steps: the same tokens and logprobs for a request whatever "
        "its batch, chunking or cache hits (CPU; costs step time: docs/deterministic.md)",
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=d.warmup,
        help="run a largest-chunk prefill and a full decode step before serving",
    )
    p.add_argument(
        "--malloc-tuning",
        action=argparse.BooleanOptionalAction,
        default=d.malloc_tuning,
        help="fix glibc's malloc policy in the worker so step buffers stay mapped",
    )
    tp = p.add_argument_group("tensor parallelism (docs/parallel.md)")
    tp.add_argument(
        "--tp",
        type=_positive,
        default=d.tp,
        help="tensor-parallel ranks: the model split over N worker processes (gloo on the "
        "CPU, NCCL on CUDA, one device each); --kv-memory is then per rank",
    )
    tp.add_argument(
        "--threads",
        type=_non_negative,
        default=d.threads,
        help="torch CPU threads per worker rank; 0: torch's default with one rank (one "
        "fewer on the CPU during steps while the cache tiers' copy thread has work), "
        "cores // --tp with several",
    )
    tp.add_argument(
        "--dist-timeout",
        type=_seconds,
        default=d.dist_timeout,
        help="seconds a tensor-parallel collective may take before its rank fails (and "
        "the server with it); also how long the ranks wait for each other at start",
    )
    tp.add_argument(
        "--nnodes",
        type=_positive,
        default=ServerConfig.nnodes,
        help="machines the --tp ranks are spread over, --tp / --nnodes each; run one "
        'launch per node (docs/parallel.md, "Several nodes")',
    )
    tp.add_argument(
        "--node-rank",
        type=_non_negative,
        default=ServerConfig.node_rank,
        help="this node's index: 0 is the head (tokenizer, scheduler, rank 0), a node > 0 "
        "runs only its worker ranks",
    )
    tp.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        default=None,
        help="an address of the head that every node reaches: its rendezvous store binds "
        "HOST:PORT, its step relay HOST:PORT+1 (needed with --nnodes > 1)",
    )
    p.add_argument(
        "--watchdog-timeout",
        type=_seconds,
        default=ServerConfig.watchdog_timeout,
        help="seconds the worker may take over one step; past it the requests in flight "
        "fail and the server exits 1 (a hung or stopped worker); 0: no watchdog",
    )
    auth = p.add_argument_group("authentication (docs/security.md)")
    auth.add_argument(
        "--api-key",
        default=None,
        help="HTTP front: require `Authorization: Bearer KEY` on /v1 and /stats "
        "(default: $RADIXSERVE_API_KEY)",
    )
    auth.add_argument(
        "--admin-api-key",
        default=None,
        help="the key flush_cache and check require, over HTTP (/flush_cache) and ZeroMQ "
        "(default: $RADIXSERVE_ADMIN_API_KEY)",
    )
    auth.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        default=None,
        help="the server's secret CURVE certificate (`radixserve keys` writes "
        "DIR/server.key_secret): the public TCP socket then encrypts and authenticates "
        "every connection; required when --host is not a loopback address",
    )
    auth.add_argument(
        "--curve-allowed-clients",
        metavar="DIR",
        default=None,
        help="with --curve-secret-key: only clients whose public certificates (*.key) are "
        "in DIR may connect (read at start)",
    )
    auth.add_argument(
        "--curve-allow-any-client",
        action="store_true",
        help="with --curve-secret-key: any client that has the server's public key may "
        "connect (encrypted, but clients are not authenticated)",
    )
    auth.add_argument(
        "--curve-node-key",
        metavar="FILE",
        default=None,
        help="with --nnodes > 1: this node's secret CURVE certificate, for the step relay "
        "between nodes; required unless --dist-init-addr is a loopback address",
    )
    auth.add_argument(
        "--curve-allowed-nodes",
        metavar="DIR",
        default=None,
        help="the head, with --curve-node-key: only nodes whose public certificates "
        "(*.key) are in DIR may join",
    )
    auth.add_argument(
        "--curve-head-key",
        metavar="FILE",
        default=None,
        help="a node > 0, with --curve-node-key: the head's public certificate (its "
        "--curve-node-key's .key file)",
    )
    ev = p.add_argument_group("KV cache events and replicas (docs/scale-out.md)")
    ev.add_argument(
        "--kv-events",
        metavar="tcp://HOST:PORT",
        default=None,
        help="publish the radix tree's changes (ZeroMQ PUB, msgpack) after every step; "
        "loopback only unless --curve-secret-key; port 0 picks a free one (printed)",
    )
    ev.add_argument(
        "--kv-events-replay",
        metavar="tcp://HOST:PORT",
        default=None,
        help="the replay socket (missed batches, or a snapshot); default: --kv-events' port + 1",
    )
    ev.add_argument(
        "--kv-events-format",
        choices=("radixserve", "vllm"),
        default="radixserve",
        help="radixserve's own events (epochs, heartbeats, snapshots), or vLLM's KVEventBatch "
        "wire format (BlockStored/BlockRemoved/AllBlocksCleared, vLLM's sha256 block hashes, "
        "its replay protocol) for consumers written for vLLM",
    )
    ev.add_argument(
        "--kv-events-topic",
        default="",
        help="with --kv-events-format vllm: the topic frame of every batch (vLLM's default: empty)",
    )
    ev.add_argument(
        "--replica-id", default=None, help="this server's name in its events (default host:pid)"
    )
    ev.add_argument(
        "--dp",
        type=_positive,
        default=1,
        help="data parallelism: start this many replicas (each with its own worker, "
        "scheduler and tokenizer) behind a cache-aware router on --host/--port",
    )
    from radixserve.router.policy import POLICIES, PolicyConfig

    ev.add_argument(
        "--policy",
        choices=POLICIES,
        default=PolicyConfig.policy,
        help="with --dp: how the router picks a replica (docs/scale-out.md)",
    )
    ev.add_argument(
        "--balance-abs-threshold",
        type=_non_negative,
        default=None,
        help="with --dp and cache_aware: the load is imbalanced when the busiest replica "
        "has more than this many requests over the least busy one (default: "
        "--max-running-requests, a whole batch) ...",
    )
    ev.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=PolicyConfig.balance_rel_threshold,
        help="... and more than this times its load; then the least loaded replica wins",
    )
    ev.add_argument(
        "--cache-threshold",
        type=_ratio,
        default=PolicyConfig.cache_threshold,
        help="with --dp and cache_aware: route by the cache only when the longest match "
        "covers more than this share of the prompt; else to the least loaded replica",
    )
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop the server when the process that started `radixserve launch` exits "
        "(for supervisors and tests; the default keeps serving, as under nohup)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="warning",
        help="log level of every process (logs go to stderr)",
    )


def launch_parser() -> argparse.ArgumentParser:
    """A parser of ``radixserve launch``'s flags alone (what follows ``launch``)."""
    p = argparse.ArgumentParser(prog="radixserve launch")
    add_launch_arguments(p)
    return p


def available_memory() -> int:
    """Bytes of host memory free for a new allocation (the kernel's MemAvailable),
    or 0 when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_host_cache_gb(available: int) -> float:
    """The host tier of ``--disk-cache-dir`` without ``--host-cache-gb``: a quarter of
    ``available`` bytes (the rest stays for the processes and the page cache the disk
    tier reads through), in whole half GiB, at least 0.5 and at most
    ``HOST_TIER_CAP_GB``."""
    quarter = available / 4 / 1024**3
    return min(HOST_TIER_CAP_GB, max(0.5, int(quarter * 2) / 2))


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    if options["host_cache_gb"] is None:
        options["host_cache_gb"] = 0.0
        if options["disk_cache_dir"] is not None:
            free = available_memory()
            options["host_cache_gb"] = default_host_cache_gb(free)
            print(
                f"radixserve: --disk-cache-dir without --host-cache-gb: a "
                f"{options['host_cache_gb']:g} GiB host tier (a quarter of the "
                f"{free / 1024**3:.1f} GiB free, at most {HOST_TIER_CAP_GB:g}); "
                "--host-cache-gb N chooses it",
                file=sys.stderr,
                flush=True,
            )
    options["lora_modules"] = tuple(options["lora_modules"])
    engine = EngineConfig(**options)
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http_port=args.http_port,
        http_host=args.http_host,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        served_model_aliases=tuple(args.served_model_name[1:]) if args.served_model_name else (),
        tool_call_parser=args.tool_call_parser,
        watchdog_timeout=args.watchdog_timeout,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        kv_events_format=args.kv_events_format,
        kv_events_topic=args.kv_events_topic,
        replica_id=args.replica_id,
        exit_with_parent=args.exit_with_parent,
        curve_secret_key=args.curve_secret_key,
        curve_allowed_clients=args.curve_allowed_clients,
        curve_allow_any_client=args.curve_allow_any_client,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        handshake_timeout=args.handshake_timeout,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        curve_node_key=args.curve_node_key,
        curve_head_key=args.curve_head_key,
        curve_allowed_nodes=args.curve_allowed_nodes,
    )


def http_keys(args: argparse.Namespace):  # -> radixserve.http.auth.Keys
    """The API keys: the flags, else the environment. They never enter the ServerConfig,
    which travels on the children's command lines (the HTTP front gets both by
    environment, the tokenizer the admin key)."""
    from radixserve.http.auth import Keys

    env = Keys.from_env()
    return Keys(args.api_key or env.api_key, args.admin_api_key or env.admin_key)

"""Prometheus metrics of the HTTP front (``GET /metrics``).

Where each metric is measured, and why:

- From the scheduler's ``stats()``, read at every scrape, so they cover every client
  (ZeroMQ clients too), because only the scheduler knows them: the prefix cache counters
  (``prefix_cache_queries_total`` and ``prefix_cache_hits_total``, in prompt tokens),
  ``preemptions_total`` (retractions), ``prefix_cache_evicted_pages_total`` (by
  eviction policy), speculative decoding's ``spec_decode_draft_tokens_total``,
  ``spec_decode_accepted_tokens_total`` and ``spec_decode_verifications_total``, the
  ``request_queue_time_seconds`` histogram (arrival to first admission, by priority:
  the scheduler keeps its buckets), and the gauges for running / waiting requests and
  KV pages (free, used by requests, cached in the tree); under the ``priority``
  eviction policy, ``retained_pages`` (what retention hints hold, and the caps) and
  ``retention_clipped_total`` (hints clipped at a cap). The scheduler's counters are
  turned into Prometheus counters by adding the increase since the last scrape, so they
  never go down.
- In this front, for its own requests only, because that is where a request's client
  sees it: ``prompt_tokens_total`` and ``generation_tokens_total`` (the sums of the
  ``usage`` it returned, plus the tokens of requests cut short), ``requests_total`` by
  finish reason (one per choice; ``abort`` when the HTTP client went away; ``error``
  once per request the server refused or failed, however many prompts and choices it
  had, its other unfinished choices not counted: ``generation.Outcome``), and the
  latency histograms: time to first
  token, inter-token latency (per choice, between two chunks that carry tokens) and
  end-to-end latency, all from the moment the request reached this front.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

PREFIX = "radixserve:"
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# scheduler stats() key -> counter name (without the _total the exposition adds)
SCHEDULER_COUNTERS = {
    "query_tokens": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "hit_tokens": ("prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache."),
    "preemptions": ("preemptions", "Requests retracted (for KV pages, or for a better priority)."),
    "priority_preemptions": (
        "priority_preemptions",
        "Requests retracted for a waiting request of a better priority.",
    ),
    "timeouts": ("request_timeouts", "Requests ended by their timeout."),
    # Speculative decoding (docs/speculative.md): tokens per verification is
    # 1 + accepted / verifications.
    "spec_draft_tokens": ("spec_decode_draft_tokens", "Draft tokens verified."),
    "spec_accepted_tokens": ("spec_decode_accepted_tokens", "Draft tokens accepted."),
    "spec_verifications": (
        "spec_decode_verifications",
        "Verifications (one request's drafts in one step).",
    ),
}


class QueueTimeCollector(Collector):
    """``request_queue_time_seconds``, arrival to first admission, by priority: the
    scheduler keeps the histogram (it alone sees admission; stats' ``queue_time``), so
    each scrape exposes its latest cumulative counts as they are."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: dict = {"bounds": [], "levels": {}}

    def collect(self) -> Iterator[HistogramMetricFamily]:
        bounds = [*map(str, self.latest["bounds"]), "+Inf"]
        family = HistogramMetricFamily(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first admission (scheduler), by request priority.",
            labels=["model_name", "priority"],
        )
        for level, h in sorted(self.latest["levels"].items()):
            running, buckets = 0, []
            for bound, n in zip(bounds, h["buckets"]):
                running += int(n)
                buckets.append((bound, running))
            family.add_metric([self.model_name, level], buckets, float(h["sum"]))
        yield family


class Metrics:
    """One registry per front (not the process-global one), so tests can build several."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=r)

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of this front's requests.")
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated for this front's requests."
        )
        self.requests = counter(
            "requests", "Finished choices of this front's requests.", ("finish_reason",)
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Between two token-bearing chunks.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to the last choice's finish.", E2E_BUCKETS
        )
        self._scheduler = {
            key: counter(name, doc) for key, (name, doc) in SCHEDULER_COUNTERS.items()
        }
        self._seen: dict[str, int] = {}
        self._seen_replicas: dict[tuple[str, str], int] = {}
        self.running = gauge("num_requests_running", "Requests holding a worker slot.")
        self.waiting = gauge("num_requests_waiting", "Requests queued in the scheduler.")
        self.kv_pages = gauge(
            "kv_pages", "KV pages by state: free, used (by requests), cached.", ("state",)
        )
        # Behind a router (``radixserve launch --dp``): the same, per replica.
        self.replica_up = gauge("replica_up", "Whether the router routes to the replica.",
                                ("replica",))  # fmt: skip
        self.replica_routed = counter(
            "replica_routed_requests", "Requests the router sent to the replica.", ("replica",)
        )
        self.replica_counters = {
            key: counter(f"replica_{name}", doc, ("replica",))
            for key, (name, doc) in SCHEDULER_COUNTERS.items()
        }
        self.replica_running = gauge("replica_num_requests_running",
                                     "Requests holding a worker slot.", ("replica",))  # fmt: skip
        self.replica_waiting = gauge("replica_num_requests_waiting",
                                     "Requests queued in the scheduler.", ("replica",))  # fmt: skip
        self.replica_kv_pages = gauge(
            "replica_kv_pages", "KV pages by state: free, used, cached.", ("replica", "state")
        )
        # With cache tiers (docs/cache-tiers.md): hits by tier, pages held below the pool.
        self.tier_hits = counter(
            "prefix_cache_hits_by_tier",
            "Prompt tokens whose KV came from each cache tier (l1 pool, l2 host, l3 disk, "
            "store: the shared KV store).",
            ("tier",),
        )
        self.tier_pages = gauge(
            "cache_tier_pages", "KV pages held by the host and disk tiers.", ("tier",)
        )
        # With the shared KV store (--kv-store): pages asked of it, bytes, read latency.
        self.store_pages = counter(
            "kv_store_pages",
            "Pages asked of the shared KV store: hit (read) or miss (not given).",
            ("result",),
        )
        self.store_bytes = counter(
            "kv_store_bytes", "KV bytes read from / written to the shared KV store.", ("op",)
        )
        self.store_reads = counter("kv_store_reads", "Reads of the shared KV store (runs).")
        self.store_read_seconds = counter(
            "kv_store_read_seconds", "Time reads of the shared KV store took, planned to done."
        )
        # Pages evicted from the pool to make room, labelled with the eviction policy.
        self.evicted = counter(
            "prefix_cache_evicted_pages",
            "KV pages evicted from the pool to make room (flushes not counted).",
            ("policy",),
        )
        # Under --radix-eviction-policy priority: what cache_retention hints hold, and caps.
        self.retained_pages = gauge(
            "retained_pages",
            "KV pages held by retention hints: in all (total), by the largest tenant "
            "(max_tenant), and the caps (cap_tenant, cap_total).",
            ("scope",),
        )
        self.retention_clipped = counter(
            "retention_clipped", "Retention hints clipped at a cap (or not applied at all)."
        )
        self.queue_time = QueueTimeCollector(model_name)
        r.register(self.queue_time)
        self._lock = asyncio.Lock()
        # Expose every series from the start (at 0), so a first scrape already lists them.
        for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            family.labels(model_name)
        for reason in FINISH_REASONS:
            self.requests.labels(model_name, reason)

    # ------------------------------------------------------- this front's requests
    def finished(self, finish_reason: str | None, completion_tokens: int) -> None:
        """A choice ended (None: one not counted in ``requests_total``) with its tokens."""
        if finish_reason is not None:
            self.requests.labels(self.model_name, finish_reason).inc()
        if completion_tokens:
            self.generation_tokens.labels(self.model_name).inc(completion_tokens)

    def prompt(self, prompt_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    # ------------------------------------------------------------------ scrape
    async def render(self, get_stats: Callable[[], Awaitable[dict[str, int]]]) -> bytes:
        """Fetch the scheduler's stats, fold them in, return the text exposition."""
        # The lock keeps a slower scrape from applying older stats after a newer one.
        async with self._lock:
            stats = await get_stats()
            self._apply(stats)
            return generate_latest(self.registry)

    def _apply(self, stats: dict[str, int]) -> None:
        m = self.model_name
        for key, counter in self._scheduler.items():
            value = int(stats[key])
            last = self._seen.get(key, 0)
            # The scheduler's counters only grow while it lives; treat a drop as a restart.
            counter.labels(m).inc(value - last if value >= last else value)
            self._seen[key] = value
        for row in stats.get("replicas", ()):  # type: ignore[union-attr]
            self._apply_replica(row)
        if "evicted_pages" in stats:
            policy = str(stats.get("eviction_policy", "lru"))
            self._grow(self.evicted.labels(m, policy), ("evicted", ""), int(stats["evicted_pages"]))
        if "queue_time" in stats:
            self.queue_time.latest = stats["queue_time"]  # type: ignore[assignment]
        if "retained_pages" in stats:
            for scope, key in (("total", "retained_pages"),
                               ("max_tenant", "retained_pages_max_tenant"),
                               ("cap_tenant", "max_retained_pages_tenant"),
                               ("cap_total", "max_retained_pages_total")):  # fmt: skip
                self.retained_pages.labels(m, scope).set(stats[key])
            clipped = int(stats["retention_clipped"])
            self._grow(self.retention_clipped.labels(m), ("retention_clipped", ""), clipped)
        self.running.labels(m).set(stats["running"])
        self.waiting.labels(m).set(stats["waiting"])
        self.kv_pages.labels(m, "free").set(stats["pages_free"])
        self.kv_pages.labels(m, "used").set(stats["pages_used"])
        self.kv_pages.labels(m, "cached").set(stats["pages_cached"])
        if "hit_tokens_l1" in stats:
            for tier in ("l1", "l2", "l3", "store"):
                key = f"hit_tokens_{tier}"
                self._grow(self.tier_hits.labels(m, tier), (key, ""), int(stats[key]))
            self.tier_pages.labels(m, "host").set(stats["host_pages_cached"])
            self.tier_pages.labels(m, "disk").set(stats["disk_pages_cached"])
        if "store_hit_pages" in stats:
            for child, key in (
                (self.store_pages.labels(m, "hit"), "store_hit_pages"),
                (self.store_pages.labels(m, "miss"), "store_miss_pages"),
                (self.store_bytes.labels(m, "read"), "store_read_bytes"),
                (self.store_bytes.labels(m, "written"), "store_written_bytes"),
                (self.store_reads.labels(m), "store_reads"),
            ):
                self._grow(child, (key, ""), int(stats[key]))
            self._grow(
                self.store_read_seconds.labels(m),
                ("store_read_ms_total", ""),
                int(stats["store_read_ms_total"]),
                scale=1e-3,
            )

    def _apply_replica(self, row: dict) -> None:
        m, name = self.model_name, str(row["endpoint"])
        self.replica_up.labels(m, name).set(1 if row.get("up") else 0)
        self._grow(self.replica_routed.labels(m, name), ("routed", name), int(row["routed"]))
        st = row.get("stats")
        if not st:
            return
        for key, counter in self.replica_counters.items():
            self._grow(counter.labels(m, name), (key, name), int(st[key]))
        self.replica_running.labels(m, name).set(st["running"])
        self.replica_waiting.labels(m, name).set(st["waiting"])
        for state in ("free", "used", "cached"):
            self.replica_kv_pages.labels(m, name, state).set(st[f"pages_{state}"])

    def _grow(self, child, key: tuple[str, str], value: int, scale: float = 1.0) -> None:
        """Add a counter's increase since the last scrape (a drop: it restarted), in
        units of ``scale`` times the stats' (ms counted, seconds exposed: 1e-3)."""
        last = self._seen_replicas.get(key, 0)
        child.inc(scale * (value - last if value >= last else value))
        self._seen_replicas[key] = value

"""The scheduler's configuration: one frozen dataclass, built once, passed down."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.combinations import check_features, features_on
from radixserve.options import SharedOptions, check_options, option

CACHE_MODES = ("radix", "none")
#: ``radix_impl.py``'s choice of tree: ``auto`` is native when the extension is built.
RADIX_IMPLS = ("auto", "python", "native")
SCHEDULE_POLICIES = ("lpm", "fcfs", "priority")
#: Which unlocked leaves ``radix_cache.py`` evicts first: ``lfu`` fewest hits,
#: ``priority`` requests' ``cache_retention`` hints, then LRU.
EVICTION_POLICIES = ("lru", "lfu", "priority")
SPECULATIVE_ALGORITHMS = ("off", "ngram", "radix")  # speculative.py's
#: ``decode_step_tokens``' default (docs/scheduler.md: measured).
DECODE_STEP_TOKENS = 1024


@dataclass(frozen=True, kw_only=True)
class SchedulerOptions(SharedOptions):
    """The scheduler's options (each one's help says what it does; docs/scheduler.md
    has their defaults, measured, and how they interact).

    Beyond the flags' help, for the library: ``decode_step_tokens`` gives the prefill
    what the decodes leave, in whole pages, at least one page, at most
    ``chunked_prefill_size``; a step with no decode prefills ``chunked_prefill_size``
    (Sarathi-Serve's stall-free batching). ``lpm`` falls back to FCFS order past
    ``lpm_max_waiting`` waiting requests because peeking every prompt each step
    would cost more than it saves. The reserve ratio falls linearly from
    ``decode_reserve_ratio`` to ``decode_reserve_min_ratio`` over
    ``decode_reserve_decay_steps`` while nothing is retracted, so requests that ask
    for far more output than they produce do not hold the pool against everyone
    else; retraction is the safety net when they do produce it. A request under a
    LoRA adapter past ``max_loras`` waits (docs/lora.md). ``shared_prefix_min_tokens``:
    DESIGN's shared prefixes inside one batch. Speculative decoding:
    docs/speculative.md, ``speculative.py``.
    """

    cache: str = option(
        "radix",
        "radix: keep KV in the prefix tree; none: free it when a request ends",
        choices=CACHE_MODES,
    )
    radix_impl: str = option(
        "auto", "radix tree implementation; auto: native when built", choices=RADIX_IMPLS
    )
    decode_step_tokens: int = option(
        DECODE_STEP_TOKENS,
        "while requests decode, the most tokens a step carries (their decode rows, "
        "then prompt tokens: at least one page, at most --chunked-prefill-size), so a "
        "long prefill does not stall them; 0: off, every step may prefill "
        "--chunked-prefill-size",
        at_least=0,
    )
    schedule_policy: str = option(
        "lpm",
        "lpm: longest cached prefix first (with aging); fcfs: arrival order; priority: "
        "a request's priority first (lower first, as vLLM's), lpm within a level, and a "
        "request that cannot be admitted preempts running ones of a worse priority",
        choices=SCHEDULE_POLICIES,
    )
    lpm_max_waiting: int = option(
        128, "with more requests waiting than this, lpm admits in arrival order", at_least=0
    )
    max_wait_steps: int = option(
        64, "aging: a request passed over for this many steps is admitted first", at_least=0
    )
    decode_reserve_ratio: float = option(
        1.0,
        "share of running requests' remaining decode pages kept free at admission; "
        "lower admits more and relies on eviction and retraction",
        at_least=0.0,
        at_most=1.0,
    )
    decode_reserve_min_ratio: float = option(
        0.1,
        "the reserve ratio falls to this (at most --decode-reserve-ratio) while "
        "nothing is retracted; a retraction puts it back to --decode-reserve-ratio",
        at_least=0.0,
        at_most=1.0,
    )
    decode_reserve_decay_steps: int = option(
        500,
        "steps over which the reserve ratio falls to its min (0: it never falls)",
        at_least=0,
    )
    max_admit_skips: int = option(
        32,
        "waiting requests that do not fit passed over per step before admission "
        "stops (the requests behind them are still admitted)",
        at_least=0,
    )
    max_preemptions: int = option(
        4,
        "with --schedule-policy priority: a request preempted this many times is not "
        "preempted again",
        at_least=0,
    )
    radix_eviction_policy: str = option(
        "lru",
        "which cached prefixes go first under memory pressure: lru, lfu (fewest hits), "
        "or priority (requests' cache_retention hints, then lru); lfu and priority run the "
        "Python radix tree",
        choices=EVICTION_POLICIES,
    )
    max_retained_share: float = option(
        0.5,
        "with --radix-eviction-policy priority: the most of the KV pool one tenant "
        "(cache_salt) may hold under cache_retention hints (a hint past it is clipped to "
        "the prefix that fits)",
        at_least=0.0,
        at_most=1.0,
    )
    max_retained_total_share: float = option(
        0.8,
        "with --radix-eviction-policy priority: the most of the KV pool all tenants "
        "together may hold under cache_retention hints (a hint past it is clipped), "
        "so retained prefixes never leave other requests short of pages",
        at_least=0.0,
        at_most=1.0,
    )
    shared_prefix_min_tokens: int = option(
        32,
        "hold a waiting request back while it shares at least this many uncached "
        "prefix tokens with a prompt being prefilled (it then hits them in the tree)",
        at_least=0,
    )
    speculative_algorithm: str = option(
        "off",
        "speculative decoding's drafts: ngram (prompt lookup over the request's own "
        "tokens) or radix (what followed the same tokens in the radix tree, same cache "
        "salt only, then ngram); verified losslessly (docs/speculative.md)",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = option(
        4, "draft tokens per request and step at most", at_least=0
    )
    speculative_min_match: int = option(
        2,
        "ngram drafts: the shortest suffix of a request's tokens that must have "
        "occurred before in them",
        at_least=1,
    )
    speculative_max_batch: int = option(
        6, "no drafts in a step where more requests than this decode", at_least=0
    )
    disk_cache_gb: float = option(
        16.0,
        "the disk tier's size bound in GiB (least recently used files go first)",
        above=0.0,
    )
    max_loras: int = option(
        4,
        "LoRA adapters whose requests may run in one batch (the base model not counted)",
        at_least=1,
    )


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulerOptions):
    """How the scheduler batches requests over a pool of ``num_pages`` KV pages: its
    options, and what the loaded model fixes (``config.MODEL_FIELDS``, from
    ``ModelInfo``)."""

    num_pages: int
    page_size: int = 1
    max_context_len: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    # Cache tiers below the pool (docs/cache-tiers.md). ``host_pages``: the worker's
    # host buffer in pages (from --host-cache-gb; 0: no tiers). The disk tier
    # (``disk_cache_dir``, bounded to ``disk_cache_gb`` GiB of page files) names and
    # sizes its files with ``page_bytes`` and ``kv_identity``.
    host_pages: int = 0
    page_bytes: int = 0
    kv_identity: str = ""
    # The adapters the worker loaded at start.
    loras: tuple = ()
    # A hybrid model's recurrent-state snapshots in the worker's state pool
    # (0: not a hybrid model): the radix tree keeps them (state_cache.py).
    state_snapshots: int = 0
    # A model whose sliding layers keep their K/V in the window pool (0: none): its
    # pages, and W, the largest sliding window in tokens (window_cache.py).
    window_pages: int = 0
    window_span: int = 0

    def __post_init__(self) -> None:
        if self.window_pages and self.window_span < 1:
            raise ValueError("a window pool needs window_span >= 1")
        check_options(self)
        for name in ("num_pages", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least one page")
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        # What combines with what: combinations.py's table.
        check_features(
            features_on(
                no_cache=self.cache == "none",
                host_tier=self.host_pages > 0,
                disk_tier=self.disk_cache_dir is not None,
                kv_store=self.kv_store is not None,
                window_pool=self.window_pages > 0,
            )
        )

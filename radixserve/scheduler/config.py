"""The scheduler's configuration: one frozen dataclass, built once, passed down."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.scheduler.combinations import check_features, features_on

CACHE_MODES = ("radix", "none")
SCHEDULE_POLICIES = ("lpm", "fcfs", "priority")
EVICTION_POLICIES = ("lru", "lfu", "priority")  # radix_cache.py's
SPECULATIVE_ALGORITHMS = ("off", "ngram", "radix")  # speculative.py's
#: ``decode_step_tokens``' default (docs/scheduler.md: measured).
DECODE_STEP_TOKENS = 1024


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches requests over a pool of ``num_pages`` KV pages.

    Defaults (documented in docs/scheduler.md):
    - ``max_running_requests`` 64: requests holding a worker slot at once.
    - ``chunked_prefill_size`` 2048: prompt tokens computed per step at most
      (a longer prompt is prefilled in chunks, one chunked request at a time).
    - ``decode_step_tokens``: while requests decode, the tokens a step carries
      at most (decode rows and their drafts, then prefill): the prefill gets what
      the decodes leave, in whole pages, at least one page, at most
      ``chunked_prefill_size``; a step with no decode prefills
      ``chunked_prefill_size``. 0: off (every step may prefill
      ``chunked_prefill_size`` whatever decodes). It bounds how long a decoding
      request waits for a step that also prefills (Sarathi-Serve's stall-free
      batching; docs/scheduler.md).
    - ``schedule_policy`` "lpm": longest cached prefix first, with aging; it
      falls back to FCFS order when more than ``lpm_max_waiting`` requests wait
      (peeking every prompt each step would cost more than it saves).
    - ``max_wait_steps`` 64: a waiting request that was passed over this many
      steps is admitted before any newer one (no starvation under lpm).
    - ``decode_reserve_ratio`` 1.0: the fraction of each running request's
      remaining ``max_tokens`` kept free for its decode when admitting more;
      lower admits more and relies on eviction and retraction. It is where the
      reserve ratio starts, and where it goes back to after a retraction.
    - ``decode_reserve_min_ratio`` 0.1 and ``decode_reserve_decay_steps`` 500:
      while nothing is retracted the reserve ratio falls linearly to the min
      (never above ``decode_reserve_ratio``) over that many steps, so requests
      that ask for far more output than they produce (``max_tokens`` up to the
      context) do not hold the pool against everyone else; retraction is the
      safety net when they do produce it.
    - ``schedule_policy`` "priority": by ``SamplingParams.priority`` (lower
      first), lpm with aging within a level; a waiting request that cannot be
      admitted preempts running requests of a worse priority (docs/scheduler.md).
    - ``radix_eviction_policy`` "lru": which unlocked leaves go first under memory
      pressure: ``lru``, ``lfu`` (fewest hits first), or ``priority`` (requests'
      ``cache_retention`` hints first, then LRU); the last two run the Python tree.
    - ``max_retained_share`` 0.5: under the priority eviction policy, the most of
      the pool one tenant (salt) may hold under running retention hints.
    - ``max_preemptions`` 4: a request preempted this many times is not
      preempted again (nothing is preempted forever).
    - ``max_loras`` 4: LoRA adapters whose requests may run in one batch (the base
      model not counted); a request under another adapter waits (docs/lora.md).
      ``loras``: the adapters the worker loaded at start (ModelInfo).
    - ``max_admit_skips`` 32: a waiting request whose pages do not fit is
      passed over and admission goes on with the requests behind it, up to
      this many such requests per step (then admission stops for the step).
    - ``speculative_algorithm`` "off": speculative decoding's drafts, ``ngram``
      (prompt lookup) or ``radix`` (the radix tree's continuation, then ngram);
      ``speculative_num_draft_tokens`` 4 drafts per request and step at most;
      ``speculative_min_match`` 2: the shortest suffix ngram matches;
      ``speculative_max_batch`` 6: no drafts in a step where more requests decode
      (docs/speculative.md, ``speculative.py``).
    """

    num_pages: int
    page_size: int = 1
    max_context_len: int = 2048
    eos_token_ids: tuple[int, ...] = ()
    cache: str = "radix"
    radix_impl: str = "auto"
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    decode_step_tokens: int = DECODE_STEP_TOKENS
    schedule_policy: str = "lpm"
    lpm_max_waiting: int = 128
    max_wait_steps: int = 64
    decode_reserve_ratio: float = 1.0
    decode_reserve_min_ratio: float = 0.1
    decode_reserve_decay_steps: int = 500
    max_admit_skips: int = 32
    max_preemptions: int = 4
    radix_eviction_policy: str = "lru"
    max_retained_share: float = 0.5
    # A waiting request is held back while it shares a prefix of at least this
    # many tokens with a prompt being prefilled now and part of that prefix (in
    # whole pages) is not cached yet (DESIGN: shared prefixes inside one batch);
    # once that prefill is done it hits the whole prefix in the tree.
    shared_prefix_min_tokens: int = 32
    # Cache tiers below the pool (docs/cache-tiers.md). ``host_pages``: the worker's
    # host buffer in pages (ModelInfo, from --host-cache-gb; 0: no tiers).
    # ``disk_cache_dir``: the disk tier's directory (None: none), bounded to
    # ``disk_cache_gb`` GiB of page files. ``page_bytes`` and ``kv_identity``
    # (ModelInfo) size and name the disk tier's files.
    speculative_algorithm: str = "off"
    speculative_num_draft_tokens: int = 4
    speculative_min_match: int = 2
    speculative_max_batch: int = 6
    host_pages: int = 0
    disk_cache_dir: str | None = None
    disk_cache_gb: float = 16.0
    page_bytes: int = 0
    kv_identity: str = ""
    max_loras: int = 4
    loras: tuple = ()
    # A hybrid model's recurrent-state snapshots in the worker's state pool
    # (ModelInfo; 0: not a hybrid model): the radix tree keeps them (state_cache.py).
    state_snapshots: int = 0
    # A model whose sliding layers keep their K/V in the window pool (ModelInfo; 0:
    # none): its pages, and W, the largest sliding window in tokens (window_cache.py).
    window_pages: int = 0
    window_span: int = 0

    def __post_init__(self) -> None:
        if self.window_pages and self.window_span < 1:
            raise ValueError("a window pool needs window_span >= 1")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {self.cache!r}")
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"radix_eviction_policy must be one of {EVICTION_POLICIES}, got {self.radix_eviction_policy!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        for name in ("num_pages", "page_size", "max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least one page")
        if self.decode_step_tokens < 0:
            raise ValueError(f"decode_step_tokens must be >= 0, got {self.decode_step_tokens}")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                f"got {self.speculative_algorithm!r}"
            )
        for name in ("speculative_num_draft_tokens", "speculative_max_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.speculative_min_match < 1:
            raise ValueError(
                f"speculative_min_match must be >= 1, got {self.speculative_min_match}"
            )
        if self.host_pages < 0:
            raise ValueError(f"host_pages must be >= 0, got {self.host_pages}")
        # What combines with what: combinations.py's table.
        check_features(
            features_on(
                no_cache=self.cache == "none",
                host_tier=self.host_pages > 0,
                disk_tier=self.disk_cache_dir is not None,
                window_pool=self.window_pages > 0,
            )
        )
        if self.disk_cache_gb <= 0:
            raise ValueError(f"disk_cache_gb must be > 0, got {self.disk_cache_gb}")
        for name in ("decode_reserve_ratio", "decode_reserve_min_ratio", "max_retained_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        for name in (
            "lpm_max_waiting",
            "max_wait_steps",
            "shared_prefix_min_tokens",
            "decode_reserve_decay_steps",
            "max_admit_skips",
            "max_preemptions",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

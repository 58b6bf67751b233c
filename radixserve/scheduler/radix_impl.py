"""The cache's composition: which prefix cache runs, with what around it.

``build_kv_cache(allocator, config)`` is the one place the scheduler's KV cache is
put together from its config: the radix core (``make_prefix_cache``) with the
components the model needs (``SlidingWindows`` for a window pool, ``StateSnapshots``
for a hybrid model's recurrent states), the cache tiers wrapped around it
(``--host-cache-gb``, ``tiered_cache.py``), and the ``KVCacheManager`` over them;
``combinations.py``'s table says what may be combined. KV events wrap the core
later, when asked for (``KVCacheManager.record_events``).

``make_prefix_cache(allocator, cache, impl)``: ``cache="none"`` is ``NoCache``;
``"radix"`` is the tree that ``make_radix_cache(allocator, page_size, impl)`` picks
(the Python core whenever there are components):

* ``"auto"`` (default): native when the extension was built, else Python.
* ``"native"``: the C++ tree; a clear error when the extension is missing.
* ``"python"``: the reference tree in ``radix_cache.py``.

Both follow the same contract step by step (the differential test proves it),
so the choice changes speed, never behaviour.
"""

from __future__ import annotations

from radixserve.combinations import check_features, features_on
from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.config import RADIX_IMPLS, SchedulerConfig
from radixserve.scheduler.kv_cache import KVCacheManager
from radixserve.scheduler.prefix_cache import NoCache, PrefixCache
from radixserve.scheduler.radix_cache import CacheComponent, RadixCache
from radixserve.scheduler.state_cache import StateSnapshots
from radixserve.scheduler.tiered_cache import build_tiers
from radixserve.scheduler.window_cache import SlidingWindows
from radixserve.scheduler.window_pages import WindowPages

try:
    from radixserve.scheduler.radix_native import NativeRadixCache
except ImportError as e:  # not built: no compiler at install time, or a failed build
    NativeRadixCache = None  # type: ignore[assignment,misc]
    NATIVE_UNAVAILABLE_REASON: str | None = str(e)
else:
    NATIVE_UNAVAILABLE_REASON = None

NATIVE_AVAILABLE = NativeRadixCache is not None


def available_impls() -> list[str]:
    """The concrete implementations that can run here, preferred first."""
    return ["native", "python"] if NATIVE_AVAILABLE else ["python"]


def resolve_impl(impl: str = "auto") -> str:
    """``impl`` as the concrete implementation that ``make_radix_cache`` would use."""
    if impl not in RADIX_IMPLS:
        raise ValueError(f"unknown radix tree implementation {impl!r}; choose from {RADIX_IMPLS}")
    if impl == "auto":
        return available_impls()[0]
    if impl == "native" and not NATIVE_AVAILABLE:
        raise RuntimeError(
            "the native radix tree is not built "
            f"({NATIVE_UNAVAILABLE_REASON}). It is compiled by `pip install -e .` "
            "(`make install`) when a C++17 compiler is present; the install printed a "
            "warning saying why it was skipped. Reinstall with a compiler, or run "
            "`python setup.py build_ext --inplace` in a checkout, or use impl='python'."
        )
    return impl


def make_radix_cache(
    allocator: PageAllocator,
    page_size: int = 1,
    impl: str = "auto",
    policy: str = "lru",
    max_retained_pages: int | None = None,
    max_retained_total: int | None = None,
) -> PrefixCache:
    """A radix tree over ``allocator``: ``impl`` is "auto", "native" or "python";
    ``policy`` the eviction order (``max_retained_pages`` / ``max_retained_total``:
    the retention caps per tenant and in all). The native tree is LRU only: another
    policy takes the Python tree under "auto", and is an error with "native"."""
    if policy != "lru":
        check_features(
            features_on(native_tree=impl == "native", eviction_policy=True), policy=policy
        )
        return RadixCache(
            allocator,
            page_size,
            policy,
            max_retained_pages=max_retained_pages,
            max_retained_total=max_retained_total,
        )
    if resolve_impl(impl) == "native":
        return NativeRadixCache(allocator, page_size)  # type: ignore[misc]
    return RadixCache(allocator, page_size)


def cache_components(
    num_states: int = 0, window: WindowPages | None = None, span: int = 0
) -> list[CacheComponent]:
    """What a model needs on the tree's nodes beyond its full-attention pages:
    ``window`` (its sliding layers' window pool, W = ``span`` tokens) and
    ``num_states`` > 0 (a hybrid model's recurrent-state snapshots)."""
    parts: list[CacheComponent] = []
    if window is not None:
        parts.append(SlidingWindows(window, span))
    if num_states:
        parts.append(StateSnapshots(num_states))
    return parts


def make_prefix_cache(
    allocator: PageAllocator,
    cache: str = "radix",
    impl: str = "auto",
    policy: str = "lru",
    max_retained_pages: int | None = None,
    num_states: int = 0,
    window: WindowPages | None = None,
    span: int = 0,
    max_retained_total: int | None = None,
) -> PrefixCache:
    """The prefix cache over ``allocator``: ``cache`` is "radix" or "none". With
    components (``cache_components(num_states, window, span)``) the radix tree is
    the Python core carrying them (``tree.components``); the native tree keeps none."""
    if cache == "none":
        return NoCache(allocator)
    if cache != "radix":
        raise ValueError(f"unknown cache {cache!r}; choose from ('radix', 'none')")
    check_features(
        features_on(
            native_tree=impl == "native",
            window_pool=window is not None,
            recurrent_states=num_states > 0,
        )
    )
    parts = cache_components(num_states, window, span)
    if parts:
        return RadixCache(
            allocator,
            allocator.page_size,
            policy,
            max_retained_pages=max_retained_pages,
            max_retained_total=max_retained_total,
            components=parts,
        )
    return make_radix_cache(
        allocator, allocator.page_size, impl, policy, max_retained_pages, max_retained_total
    )


def build_kv_cache(allocator: PageAllocator, config: SchedulerConfig) -> KVCacheManager:
    """The scheduler's KV cache as ``config`` asks for it (module docstring)."""
    # Sliding layers' window pages (docs/models.md): a pool of their own.
    window = WindowPages(config.window_pages, config.page_size) if config.window_pages else None
    core = make_prefix_cache(
        allocator,
        config.cache,
        config.radix_impl,
        config.radix_eviction_policy,
        int(config.max_retained_share * config.num_pages),
        config.state_snapshots,
        window,
        config.window_span,
        int(config.max_retained_total_share * config.num_pages),
    )
    # The core's components: none for --cache none or the native tree.
    components = core.components if isinstance(core, RadixCache) else {}
    tiers = build_tiers(core, allocator, config) if config.host_pages or config.kv_store else None
    return KVCacheManager(
        allocator,
        core if tiers is None else tiers,
        window,
        config.window_span,
        components=components,
        tiers=tiers,
    )

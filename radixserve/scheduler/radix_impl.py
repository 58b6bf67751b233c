"""Which prefix cache to run: a radix tree (native when built) or none.

``make_prefix_cache(allocator, cache, impl)`` is the one place the choice is
made (the scheduler passes its ``--cache`` and ``--radix-impl`` options
through): ``cache="none"`` is ``NoCache``; ``"radix"`` is the tree that
``make_radix_cache(allocator, page_size, impl)`` picks:

* ``"auto"`` (default): native when the extension was built, else Python.
* ``"native"``: the C++ tree; a clear error when the extension is missing.
* ``"python"``: the reference tree in ``radix_cache.py``.

Both follow the same contract step by step (the differential test proves it),
so the choice changes speed, never behaviour.
"""

from __future__ import annotations

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.combinations import check_features, features_on
from radixserve.scheduler.prefix_cache import NoCache, PrefixCache
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.state_cache import StateRadixCache
from radixserve.scheduler.window_cache import WindowRadixCache
from radixserve.scheduler.window_pages import WindowPages

try:
    from radixserve.scheduler.radix_native import NativeRadixCache
except ImportError as e:  # not built: no compiler at install time, or a failed build
    NativeRadixCache = None  # type: ignore[assignment,misc]
    NATIVE_UNAVAILABLE_REASON: str | None = str(e)
else:
    NATIVE_UNAVAILABLE_REASON = None

NATIVE_AVAILABLE = NativeRadixCache is not None
IMPLS = ("auto", "native", "python")


def available_impls() -> list[str]:
    """The concrete implementations that can run here, preferred first."""
    return ["native", "python"] if NATIVE_AVAILABLE else ["python"]


def resolve_impl(impl: str = "auto") -> str:
    """``impl`` as the concrete implementation that ``make_radix_cache`` would use."""
    if impl not in IMPLS:
        raise ValueError(f"unknown radix tree implementation {impl!r}; choose from {IMPLS}")
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
) -> PrefixCache:
    """A radix tree over ``allocator``: ``impl`` is "auto", "native" or "python";
    ``policy`` the eviction order. The native tree is LRU only: another policy takes
    the Python tree under "auto", and is an error with "native"."""
    if policy != "lru":
        check_features(
            features_on(native_tree=impl == "native", eviction_policy=True), policy=policy
        )
        return RadixCache(allocator, page_size, policy, max_retained_pages=max_retained_pages)
    if resolve_impl(impl) == "native":
        return NativeRadixCache(allocator, page_size)  # type: ignore[misc]
    return RadixCache(allocator, page_size)


def make_prefix_cache(
    allocator: PageAllocator,
    cache: str = "radix",
    impl: str = "auto",
    policy: str = "lru",
    max_retained_pages: int | None = None,
    num_states: int = 0,
    window: WindowPages | None = None,
    span: int = 0,
) -> PrefixCache:
    """The prefix cache over ``allocator``: ``cache`` is "radix" or "none".
    ``num_states`` > 0 (a hybrid model's recurrent-state snapshots): the radix tree
    is the Python ``StateRadixCache``, which keeps them (the native tree does not).
    ``window`` (a model's sliding layers in a window pool, W = ``span`` tokens): the
    Python ``WindowRadixCache``, for the same reason."""
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
    if window is not None:
        # Sliding layers' window pages: only the Python tree keeps them.
        return WindowRadixCache(
            allocator, window, span, policy=policy, max_retained_pages=max_retained_pages
        )
    if num_states:
        return StateRadixCache(
            allocator, num_states, policy=policy, max_retained_pages=max_retained_pages
        )
    return make_radix_cache(allocator, allocator.page_size, impl, policy, max_retained_pages)

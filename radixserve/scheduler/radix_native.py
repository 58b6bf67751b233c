"""The native (C++17) radix tree, behind the same contract as ``RadixCache``.

The tree itself is ``csrc/`` (built by ``pip install`` as the optional
extension ``radixserve.scheduler._radix_native``); importing this module raises
ImportError when it was not built, or was built from older sources than the
contract (a stale in-place build): the Python tree runs then. Every hot call
(match_prefix, peek_prefix, insert, lock, unlock, evict, continuation) goes
straight to C++ with no Python frame in between; this class only adds what needs
Python objects: the page_size check against the allocator and the allocator side
of ``check()``. ``export_nodes`` (the tree's shape, read-only) is the Python
tree's, array for array.

Differences from the Python tree, all invisible to the scheduler:

* ``last_node`` and the node returned by ``insert`` are ``NodeHandle`` objects
  (opaque; equal when they name the same node), not ``RadixNode``. A handle is
  valid while the node is locked, exactly as in the Python tree.
* ``node_info(handle)`` gives ``(node_id, lock_ref, last_access, num_tokens)``
  (None once detached) for tests and debugging.

Pages freed by ``evict`` and ``reset`` go back to ``allocator`` through one
``allocator.free`` call each, in the same order as the Python tree frees them,
so the allocator's state is identical whichever tree runs.
"""

from __future__ import annotations

from radixserve.scheduler import _radix_native
from radixserve.scheduler.allocator import PageAllocator

if not hasattr(_radix_native.RadixTree, "export_nodes"):
    # An extension built from older sources (an in-place build not redone after a pull):
    # unusable, since the scheduler calls every method of the contract.
    raise ImportError(
        "the native radix tree was built from older sources (it has no export_nodes()): "
        "rebuild it with `python setup.py build_ext --inplace` or `pip install -e .`"
    )
from radixserve.scheduler.radix_check import require

NodeHandle = _radix_native.NodeHandle


class NativeRadixCache(_radix_native.RadixTree):
    """The radix tree in C++ (``PrefixCache``), step for step the Python one."""

    keeps_prefixes = True

    def __init__(self, allocator: PageAllocator, page_size: int = 1) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size {page_size} differs from the allocator's {allocator.page_size}"
            )
        super().__init__(allocator, page_size)
        self.allocator = allocator

    def retain(self, node: NodeHandle, level: int, seconds: float) -> int:
        """Retention hints are the Python tree's ``priority`` policy: this one is LRU
        only, so a hint is not applied (0 tokens held)."""
        return 0

    def check(self) -> None:
        """Verify every invariant; raise AssertionError naming the first broken one."""
        self._check_structure()  # links, sizes, counters, locks, stamps, heap, unique pages
        pages = self.all_pages()
        if pages.size:
            require(bool(self.allocator.is_allocated(pages).all()), "the tree holds a free page")

    def __repr__(self) -> str:
        return (
            f"NativeRadixCache(page_size={self.page_size}, nodes={self.num_nodes}, "
            f"cached_pages={self.cached_pages}, protected_pages={self.protected_pages})"
        )


__all__ = ["NativeRadixCache", "NodeHandle"]

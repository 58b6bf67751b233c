"""The sliding layers' page pool: page ids with a reference count each.

A model whose layers mix full and sliding attention keeps the sliding layers' K/V in
a pool of its own (``worker/kv_pool.py``, docs/models.md "Sliding windows and the
cache"). A page of that pool (a *window page*) is needed only while some query can
still see it, so its owners are counted instead of being one:

* the radix tree holds one reference on each window page a node keeps
  (``hold`` / ``drop``: at most one per page, flagged in ``held``);
* a running request holds one reference on each window page of its window
  (``alloc`` gives a fresh page with the request's reference; ``ref`` adds one
  to a page the tree holds, when a match hands it over; ``unref`` gives one
  back).

A page goes back to the free list when its last reference goes. So the tree can
drop a node's window pages (tombstone it) whatever requests hold them: they keep
their own references for as long as their windows need the pages.
``evictable`` counts the pages only the tree holds: what dropping every node's
window pages would free now.
"""

from __future__ import annotations

import numpy as np

from radixserve.scheduler.allocator import PageAllocator


class WindowPages:
    """Window page ids, each with a reference count (module docstring)."""

    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        self.allocator = PageAllocator(num_pages, page_size)
        self.refs = np.zeros(num_pages, dtype=np.int32)
        self.held = np.zeros(num_pages, dtype=bool)  # the tree holds a reference
        self._evictable = 0  # pages held by the tree and by nothing else

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def evictable(self) -> int:
        return self._evictable

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` fresh pages, one reference each (the caller's); None when short."""
        ids = self.allocator.alloc(n)
        if ids is not None:
            self.refs[ids] = 1
        return ids

    def ref(self, ids: np.ndarray) -> None:
        """One more reference on each of ``ids`` (allocated pages, no -1)."""
        if not len(ids):
            return
        assert (self.refs[ids] > 0).all(), "a reference on a free window page"
        self._evictable -= int(np.count_nonzero(self.held[ids] & (self.refs[ids] == 1)))
        self.refs[ids] += 1

    def unref(self, ids: np.ndarray) -> None:
        """One reference less on each of ``ids`` (-1 entries are skipped); pages left
        with none are freed."""
        ids = ids[ids >= 0]
        if not len(ids):
            return
        assert (self.refs[ids] > 0).all(), "unref of a free window page"
        self.refs[ids] -= 1
        self._evictable += int(np.count_nonzero(self.held[ids] & (self.refs[ids] == 1)))
        gone = ids[self.refs[ids] == 0]
        if len(gone):
            self.allocator.free(gone)

    def hold(self, ids: np.ndarray) -> None:
        """The tree takes a reference on each of ``ids`` (none of which it holds)."""
        if not len(ids):
            return
        assert not self.held[ids].any(), "the tree holds a window page twice"
        self.ref(ids)
        self.held[ids] = True
        self._evictable += int(np.count_nonzero(self.refs[ids] == 1))

    def drop(self, ids: np.ndarray) -> int:
        """The tree gives up its reference on each of ``ids`` (-1 skipped); returns
        how many pages that freed."""
        ids = ids[ids >= 0]
        if not len(ids):
            return 0
        assert self.held[ids].all(), "the tree drops a window page it does not hold"
        alone = self.refs[ids] == 1
        self._evictable -= int(np.count_nonzero(alone))
        self.held[ids] = False
        self.refs[ids] -= 1
        gone = ids[alone]
        if len(gone):
            self.allocator.free(gone)
        return len(gone)

    def check(self) -> None:
        allocated = self.allocator.is_allocated(np.arange(self.num_pages))
        assert (allocated == (self.refs > 0)).all(), "a window page's count disagrees"
        assert not (self.held & ~allocated).any(), "the tree holds a free window page"
        assert self._evictable == int(np.count_nonzero(self.held & (self.refs == 1)))

    def __repr__(self) -> str:
        return f"WindowPages(num_pages={self.num_pages}, free={self.num_free})"

"""The KV page allocator: a fixed pool of page ids handed out all-or-nothing.

Pages are the unit of KV memory. A page holds ``page_size`` consecutive
tokens of one sequence; the worker's KV pool is indexed by page id. The
allocator only tracks ids: it never touches tensors.

The free list is a preallocated int32 stack, so ``alloc(n)`` and ``free(ids)``
cost O(n) numpy work per call (O(1) per page), with no list removal and no
concatenation of the whole free list. An ``allocated`` bitmap makes double
frees and foreign ids detectable before anything changes.
"""

from __future__ import annotations

import numpy as np

try:  # the native hot path of free() (csrc/page_free.cpp), same checks and state
    from radixserve.scheduler._radix_native import free_pages as _native_free_pages
except ImportError:  # not built: the numpy path below does everything
    _native_free_pages = None

PageIds = np.ndarray  # 1-D int32


class PageAllocatorError(ValueError):
    """A free of pages that are not currently allocated, or an invalid request."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int = 1) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self._num_pages = int(num_pages)
        self._page_size = int(page_size)
        # Stack of free ids; the top is at _stack[_top - 1]. Reversed so that a
        # fresh allocator hands out 0, 1, 2, ... (easier to read in tests/logs).
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = self._num_pages
        self._allocated = np.zeros(num_pages, dtype=bool)
        # Scratch for the O(k) duplicate check in free(): after scratch[ids] =
        # arange(k), an id given twice keeps only its last position.
        self._scratch = np.zeros(num_pages, dtype=np.int64)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self._num_pages - self._top

    def alloc(self, n: int) -> PageIds | None:
        """Allocate ``n`` pages: an int32 array of ids, or None if fewer are free."""
        if n < 0:
            raise PageAllocatorError(f"cannot allocate a negative number of pages ({n})")
        if n > self._top:
            return None
        ids = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._allocated[ids] = True
        return ids

    def free(self, ids: PageIds | list[int]) -> None:
        """Return pages to the pool. Raises (changing nothing) on any invalid id."""
        if _native_free_pages is not None:
            # int32 arrays (what the trees and the scheduler pass) are checked
            # and pushed natively; -1 (invalid) and -2 (other input) fall
            # through to the checks below, which raise with the details.
            top = _native_free_pages(self._stack, self._allocated, self._top, ids)
            if top >= 0:
                self._top = top
                return
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if ids.size == 0:
            return
        if ids.min() < 0 or ids.max() >= self._num_pages:
            bad = ids[(ids < 0) | (ids >= self._num_pages)]
            raise PageAllocatorError(
                f"page ids out of range [0, {self._num_pages}): {bad[:8].tolist()}"
            )
        if not self._allocated[ids].all():
            bad = ids[~self._allocated[ids]]
            raise PageAllocatorError(
                f"double free or free of never-allocated pages: {bad[:8].tolist()}"
            )
        if ids.size > 1:
            positions = np.arange(ids.size)
            self._scratch[ids] = positions
            if not np.array_equal(self._scratch[ids], positions):
                raise PageAllocatorError("the same page id appears twice in one free() call")
        self._allocated[ids] = False
        self._stack[self._top : self._top + ids.size] = ids
        self._top += ids.size

    def last_freed(self, n: int) -> PageIds:
        """The ids of the last ``n`` pages freed (the top of the free stack), read
        before any ``alloc``: an eviction's victims, for instance."""
        if not 0 <= n <= self._top:
            raise PageAllocatorError(f"{n} pages freed last, but {self._top} are free")
        return self._stack[self._top - n : self._top].copy()

    def is_allocated(self, ids: PageIds | list[int]) -> np.ndarray:
        """Boolean array: which of ``ids`` are currently allocated."""
        return self._allocated[np.asarray(ids, dtype=np.int64)]

    def __repr__(self) -> str:
        return (
            f"PageAllocator(num_pages={self._num_pages}, page_size={self._page_size}, "
            f"free={self._top})"
        )

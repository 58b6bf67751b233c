"""Per-slot page tables: which KV pages a request slot's tokens live in.

Token p of a slot lives in ``pages(slot)[p // page_size]`` at offset
``p % page_size``. Tables grow by appending (the scheduler sends the page ids
appended since the slot's last step), are cut back only after a speculative
verification (``StepReq.keep_pages``), and are cleared when the slot is released.
"""

from __future__ import annotations

import numpy as np


class PageTable:
    """A dense [max_slots, max_pages_per_slot] int32 table plus a length per slot."""

    def __init__(self, max_slots: int, max_pages_per_slot: int, num_pages: int) -> None:
        self.num_pages = num_pages
        self.table = np.zeros((max_slots, max_pages_per_slot), dtype=np.int32)
        self.lengths = np.zeros(max_slots, dtype=np.int64)

    @property
    def max_slots(self) -> int:
        return self.table.shape[0]

    @property
    def max_pages_per_slot(self) -> int:
        return self.table.shape[1]

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")

    def append(self, slot: int, pages: np.ndarray) -> None:
        """Append page ids to a slot's table; ValueError on bad ids or overflow."""
        self.check_slot(slot)
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        if len(pages) == 0:
            return
        if pages.min() < 0 or pages.max() >= self.num_pages:
            raise ValueError(f"page id out of range [0, {self.num_pages}) for slot {slot}")
        n = int(self.lengths[slot])
        if n + len(pages) > self.table.shape[1]:
            raise ValueError(f"slot {slot} page table overflow ({n + len(pages)} pages)")
        self.table[slot, n : n + len(pages)] = pages
        self.lengths[slot] = n + len(pages)

    def truncate(self, slot: int, num_pages: int) -> None:
        """Cut a slot's table to its first ``num_pages`` pages (a verification's
        rejected drafts gave back the pages past them); ValueError if it has fewer."""
        self.check_slot(slot)
        if not 0 <= num_pages <= self.lengths[slot]:
            raise ValueError(
                f"slot {slot}: cannot cut a table of {self.lengths[slot]} pages to {num_pages}"
            )
        self.lengths[slot] = num_pages

    def clear(self, slot: int) -> None:
        self.check_slot(slot)
        self.lengths[slot] = 0

    def num_slot_pages(self, slot: int) -> int:
        return int(self.lengths[slot])

    def pages(self, slot: int) -> np.ndarray:
        return self.table[slot, : self.lengths[slot]]


class WindowTable:
    """Each slot's window page table (sliding layers in a window pool, docs/models.md):
    a dense [max_slots, max_pages_per_slot] int32 table whose entries default to the
    pool's dummy page (``dummy``, the pool's last page: never handed out, never read
    with weight). The scheduler sets entries (``StepReq.window_start`` /
    ``window_pages``, -1 meaning the dummy page); entries wholly before a step's
    ``start_pos - span`` go back to the dummy page (``forget_before``)."""

    def __init__(self, max_slots: int, max_pages_per_slot: int, num_pages: int, span: int) -> None:
        self.dummy = num_pages  # window page ids are 0 .. num_pages - 1
        self.span = span
        self.table = np.full((max_slots, max_pages_per_slot), self.dummy, dtype=np.int32)

    def set(self, slot: int, start: int, pages: np.ndarray) -> None:
        """Entries ``start ..`` of the slot's table := ``pages`` (-1: the dummy page)."""
        pages = np.asarray(pages, dtype=np.int32).reshape(-1)
        if not len(pages):
            return
        if start < 0 or start + len(pages) > self.table.shape[1]:
            raise ValueError(
                f"slot {slot}: window entries {start}..{start + len(pages)} out of range"
            )
        if pages.max() >= self.dummy or pages.min() < -1:
            raise ValueError(f"window page id out of range [0, {self.dummy}) for slot {slot}")
        self.table[slot, start : start + len(pages)] = np.where(pages < 0, self.dummy, pages)

    def forget_before(self, slot: int, start_pos: int, page_size: int) -> int:
        """Map the slot's pages wholly before ``start_pos - span`` to the dummy page;
        returns the first page the step still reads."""
        first = max(start_pos - self.span, 0) // page_size
        if first:
            self.table[slot, :first] = self.dummy
        return first

    def clear(self, slot: int) -> None:
        self.table[slot] = self.dummy

    def pages(self, slot: int, n: int) -> np.ndarray:
        return self.table[slot, :n]

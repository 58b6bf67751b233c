"""The host tier's index (L2): which page key each host slot holds, LRU first.

The worker owns the host buffer (``worker/host_cache.py``: ``num_slots`` pages of KV
in host memory); this index decides what goes where. A slot is in exactly one of
four places (``check()`` counts them):

* free;
* an **idle** entry: holds a page's KV, evictable, in LRU order;
* a **pinned** entry: taking part in this step's copies, so never evicted before
  the step is done: *written* (a demotion fills it this step) and/or *read* (a
  promotion copies it to the pool this step);
* **releasing**: its entry was promoted this step; the slot becomes free when the
  step is done (a demotion in the same step must not overwrite it before it is read).

``step_done()`` ends the step: read entries leave the tier (promotion moves a page
up: the pool holds it now), written ones become idle.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostEntry:
    slot: int
    written: bool = False  # a demotion fills the slot in this step
    read: bool = False  # a promotion reads the slot in this step

    @property
    def pinned(self) -> bool:
        return self.written or self.read


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()  # oldest first
        self._releasing: list[int] = []

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        """Entries (idle and pinned)."""
        return len(self._entries)

    def cached_keys(self) -> list[bytes]:
        return list(self._entries)

    def slot(self, key: bytes) -> int:
        return self._entries[key].slot

    def readable(self, key: bytes) -> bool:
        """Whether a match may promote ``key`` now (present, not promoted already)."""
        e = self._entries.get(key)
        return e is not None and not e.read

    def touch(self, key: bytes) -> None:
        self._entries.move_to_end(key)

    def take_slot(self) -> int | None:
        """A free slot for a demotion, or None."""
        return self._free.pop() if self._free else None

    def pop_lru(self) -> tuple[bytes, int] | None:
        """Remove the least recently used idle entry; its key and slot (now the
        caller's), or None when every entry is pinned."""
        for key, e in self._entries.items():
            if not e.pinned:
                del self._entries[key]
                return key, e.slot
        return None

    def add_written(self, key: bytes, slot: int) -> None:
        assert key not in self._entries
        self._entries[key] = HostEntry(slot, written=True)

    def pin_read(self, key: bytes) -> int:
        e = self._entries[key]
        assert not e.read, "a host entry promoted twice in one step"
        e.read = True
        return e.slot

    def cancel_read(self, key: bytes) -> None:
        """The promotion of ``key`` did not happen after all: it stays here."""
        self._entries[key].read = False

    def step_done(self) -> None:
        for key in [k for k, e in self._entries.items() if e.read]:
            self._releasing.append(self._entries.pop(key).slot)
        for e in self._entries.values():
            e.written = False
        self._free.extend(self._releasing)
        self._releasing = []

    def clear(self) -> int:
        """Drop every entry that is not pinned; how many were dropped."""
        dropped = [k for k, e in self._entries.items() if not e.pinned]
        for key in dropped:
            self._free.append(self._entries.pop(key).slot)
        return len(dropped)

    def check(self) -> None:
        slots = [e.slot for e in self._entries.values()] + self._free + self._releasing
        assert len(slots) == self.num_slots, (
            f"host slots not conserved: {len(slots)} of {self.num_slots}"
        )
        assert sorted(slots) == list(range(self.num_slots)), "a host slot is held twice"

"""The host tier's index (L2): which page key each host slot holds, LRU first.

An entry demoted from a retained prefix (a ``cache_retention`` hint still running:
docs/cache-tiers.md, "Retained sessions") keeps its deadline here: ``pop_lru`` takes
the oldest idle entry that is not retained, and a retained one only to make room
for another retained page, so a paused session's prefix outlives what nobody asked
to keep (an unretained page finding only retained entries is dropped instead).

The worker owns the host buffer (``worker/host_cache.py``: ``num_slots`` pages of KV
in host memory); this index decides what goes where. A slot is in exactly one of
three places (``check()`` counts them):

* free;
* an **idle** entry: holds a page's KV, evictable, in LRU order;
* a **pinned** entry, never evicted: *written* (a demotion fills it in the step
  being planned; the worker does that before the step computes, so the pin ends
  with the step: ``step_done()``) and/or *read* (a promotion copies it to the pool
  under a ticket; the copy may run while later steps go on, so the pin ends when
  the ticket is reported: ``release(key)`` then frees the slot, since promotion
  moves a page up and the pool holds it now).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostEntry:
    slot: int
    written: bool = False  # a demotion fills the slot in this step
    read: bool = False  # a promotion reads the slot (until its ticket is done)
    retained_until: float = 0.0  # its prefix's retention deadline (time.monotonic())

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
        self._written_now: list[bytes] = []  # entries a demotion fills in this step

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
        """Whether a match may promote ``key`` now (present, not being promoted)."""
        e = self._entries.get(key)
        return e is not None and not e.read

    def touch(self, key: bytes, retained_until: float = 0.0) -> None:
        self._entries.move_to_end(key)
        e = self._entries[key]
        e.retained_until = max(e.retained_until, retained_until)

    def take_slot(self) -> int | None:
        """A free slot for a demotion, or None."""
        return self._free.pop() if self._free else None

    def pop_lru(self, now: float = 0.0, retained: bool = True) -> tuple[bytes, int] | None:
        """Remove the least recently used idle entry not retained at ``now``, else
        (when ``retained``: the page that needs the slot is retained itself) the
        least recently used idle one; its key and slot (now the caller's), or None
        when there is none."""
        victim = None
        for key, e in self._entries.items():
            if e.pinned:
                continue
            if e.retained_until <= now:
                victim = key
                break
            if victim is None and retained:
                victim = key  # the oldest retained one, unless an unretained one comes
        if victim is None:
            return None
        return victim, self._entries.pop(victim).slot

    def add_written(self, key: bytes, slot: int, retained_until: float = 0.0) -> None:
        assert key not in self._entries
        self._entries[key] = HostEntry(slot, written=True, retained_until=retained_until)
        self._written_now.append(key)

    def pin_read(self, key: bytes) -> int:
        e = self._entries[key]
        assert not e.read, "a host entry promoted twice at once"
        e.read = True
        return e.slot

    def cancel_read(self, key: bytes) -> None:
        """The promotion of ``key`` did not happen after all: it stays here."""
        self._entries[key].read = False

    def release(self, key: bytes) -> None:
        """The promotion of ``key`` is done: the entry goes, its slot is free."""
        e = self._entries.pop(key)
        assert e.read and not e.written, "a host entry released that was not being promoted"
        self._free.append(e.slot)

    def step_done(self) -> None:
        """The step's demotions are done: the slots they filled may be read now."""
        for key in self._written_now:
            e = self._entries.get(key)
            if e is not None:
                e.written = False
        self._written_now = []

    def clear(self) -> int:
        """Drop every entry that is not pinned; how many were dropped (a pinned one
        leaves when its promotion is done)."""
        dropped = [k for k, e in self._entries.items() if not e.pinned]
        for key in dropped:
            self._free.append(self._entries.pop(key).slot)
        return len(dropped)

    def reading_keys(self) -> list[bytes]:
        """The entries being promoted (for checks)."""
        return [k for k, e in self._entries.items() if e.read]

    def check(self) -> None:
        slots = [e.slot for e in self._entries.values()] + self._free
        assert len(slots) == self.num_slots, (
            f"host slots not conserved: {len(slots)} of {self.num_slots}"
        )
        assert sorted(slots) == list(range(self.num_slots)), "a host slot is held twice"

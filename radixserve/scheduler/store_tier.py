"""The scheduler's side of the shared KV store (docs/cache-tiers.md, "The shared
store"): what to read from it and write to it, never the store itself.

The store (Mooncake, shared by every replica and machine serving the same model)
is read and written by the worker (``worker/host_cache.py``); the scheduler cannot
know what it holds (other servers write and it evicts), so it does not keep an
index of it, unlike the host and disk tiers. Instead:

* **Read on a miss.** An admitted request whose match (pool, host, disk) stops
  before its last whole page to match asks the store for the pages after it: a
  **run** of page keys read into the pool pages the request already holds for
  those positions (its own pages, not the tree's). The request is LOADING until
  the run's ticket is reported; the worker reports which pages the store did not
  give (``StepResult.store_missed``), and the run's hit is its pages up to the
  first of those: the request computes from there (a page after a missing one is
  not used, so a hit is always a prefix). The pages read then count as computed:
  the request inserts them into the tree like the pages it computes (so they are
  announced by KV events like computed pages).
* **Write through on insert** (``write="insert"``; ``"evict"`` writes instead the
  pages evicted from the pool, read in step like a demotion: the alternative the
  bench measures). Every page the tree gains by an insert is written
  to the store (read in step, written in the background), unless the store is
  known to hold it: ``known`` (bounded) holds the keys a read of this server got
  from the store, and loses those a later read missed (the store evicted them, or
  its master restarted empty). A page this server computed is always written: it
  computed it because the store did not give it (the adapter skips a key the
  store has by then, written by another server meanwhile).
* **Pages of an abandoned run.** A request aborted or retracted while its run is
  in flight cannot free the pages being filled: a page freed now could be handed
  to another request while the worker still writes into it. ``abandon`` keeps
  them until the ticket is reported, then frees them.

Counters: store hits and misses (pages asked and not given), bytes read and
written, and the read latency (from the ticket's planning to its report).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from radixserve.scheduler.allocator import PageAllocator

KNOWN_KEYS = 1 << 16  # page keys remembered as held by the store (writes skipped)


@dataclass(eq=False)
class StoreRun:
    """One request's read: ``pages`` (its own pool pages) filled with ``keys``."""

    pages: np.ndarray
    keys: list[bytes]
    ticket: int
    planned_at: float
    arrived: int = -1  # pages read before the first miss (-1: in flight)
    abandoned: bool = False


class StoreTier:
    """Runs in flight, the keys known to be in the store, and the counters."""

    def __init__(self, allocator: PageAllocator, page_bytes: int, write: str = "insert") -> None:
        self.allocator = allocator
        self.page_bytes = page_bytes
        self.write = write  # which pages are written: "insert" (all computed) or "evict"
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._runs: dict[int, StoreRun] = {}
        self._next_run = 1
        self._by_ticket: dict[int, list[int]] = {}
        self.hits = self.misses = self.pages_written = self.reads = 0
        self.read_seconds = 0.0

    # ------------------------------------------------------------- writes
    def should_write(self, key: bytes) -> bool:
        """Whether a page the tree gained must be written (the store may lack it)."""
        if key in self._known:
            self._known.move_to_end(key)
            return False
        self.pages_written += 1
        return True

    def _remember(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._known[key] = None
            self._known.move_to_end(key)
        while len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    # -------------------------------------------------------------- reads
    def start(self, pages: np.ndarray, keys: list[bytes], ticket: int) -> int:
        """A run planned under ``ticket``; its id (> 0)."""
        run_id = self._next_run
        self._next_run += 1
        self._runs[run_id] = StoreRun(pages.copy(), keys, ticket, time.monotonic())
        self._by_ticket.setdefault(ticket, []).append(run_id)
        return run_id

    def pending(self, run_id: int) -> bool:
        return self._runs[run_id].arrived < 0

    def take(self, run_id: int) -> int:
        """The pages a finished run read (a prefix of its pages); forgets the run."""
        run = self._runs.pop(run_id)
        assert run.arrived >= 0, "a store run taken while in flight"
        return run.arrived

    def abandon(self, run_id: int) -> np.ndarray:
        """The request of ``run_id`` lets go of its pages: those the run still fills
        stay held until its ticket is reported (then freed here). Returns the
        pages the caller may free now (those of a finished run: none held)."""
        run = self._runs[run_id]
        if run.arrived >= 0:
            del self._runs[run_id]
            return np.zeros(0, dtype=np.int32)
        run.abandoned = True
        return run.pages

    def ticket_done(self, ticket: int, missed: set[int]) -> None:
        """The worker finished ``ticket``: each of its runs read its pages up to the
        first one in ``missed`` (pool pages the store did not give)."""
        now = time.monotonic()
        for run_id in self._by_ticket.pop(ticket, []):
            run = self._runs[run_id]
            n = len(run.pages)
            arrived = next((i for i, p in enumerate(run.pages.tolist()) if p in missed), n)
            run.arrived = arrived
            self.hits += arrived
            self.misses += n - arrived
            self.reads += 1
            self.read_seconds += now - run.planned_at
            self._remember(run.keys[:arrived])
            for key in run.keys[arrived:]:
                self._known.pop(key, None)
            if run.abandoned:
                self.allocator.free(run.pages)
                del self._runs[run_id]

    @property
    def pages_held(self) -> np.ndarray:
        """Pool pages of abandoned runs in flight (held by this tier)."""
        held = [r.pages for r in self._runs.values() if r.abandoned]
        return np.concatenate(held) if held else np.zeros(0, dtype=np.int32)

    @property
    def in_flight(self) -> int:
        return sum(r.arrived < 0 for r in self._runs.values())

    def check(self) -> None:
        for ticket, ids in self._by_ticket.items():
            for run_id in ids:
                run = self._runs[run_id]
                assert run.ticket == ticket and run.arrived < 0, "a store run lost its ticket"
        held = self.pages_held
        assert self.allocator.is_allocated(held).all(), "a page of an abandoned run is free"

    def stats(self) -> dict[str, float]:
        return {
            "store_hit_pages": self.hits,
            "store_miss_pages": self.misses,
            "store_read_bytes": self.hits * self.page_bytes,
            "store_written_bytes": self.pages_written * self.page_bytes,
            "store_reads": self.reads,
            "store_read_ms_total": int(1000 * self.read_seconds),
            "store_read_ms_mean": 1000 * self.read_seconds / self.reads if self.reads else 0.0,
        }

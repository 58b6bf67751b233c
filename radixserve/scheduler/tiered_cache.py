"""A hierarchical prefix cache: the radix tree over the pool (L1), a host tier (L2)
and a disk tier (L3) below it (docs/cache-tiers.md).

``TieredCache`` is a ``PrefixCache`` that wraps either tree through its public
contract (as the KV event recorder does), so the Python and the native tree both
keep working unchanged: L1 is the tree as it is; pages that leave it go down to an
index keyed by **page keys** (``kv_events.page_keys`` rooted at ``root_key``,
the model identity's digest: the SHA-256 chain over it, the salt and the page's
token prefix). A key names a page's content, not
a tree position, so the lower tiers need no tree of their own: a match walks L1,
then goes on page by page in L2/L3 with the chained keys, and stops at the first
page neither holds.

* **Demote.** ``evict`` (the pool is short) frees L1 leaves; each freed page moves
  to a host slot (``HostTier``) when a slot is free, else the host tier's LRU
  entry makes room: it is written to disk when a disk tier is configured
  (``DiskTier``), else dropped. A page whose key L2 already holds is not copied.
  A page of a retained prefix (``retain``: a ``cache_retention`` hint on its path,
  under the tree's ``priority`` policy) carries its deadline down, and the host tier
  makes room with unretained entries first.
* **Promote.** ``match_prefix`` is the tree's (L1) match; ``peek_prefix`` also
  counts the L2 and L3 pages after it (an estimate, for scheduling). Once the
  scheduler has admitted a request, ``promote`` extends its locked L1 match: fresh
  pool pages are allocated (evicting, hence demoting, if short), inserted into the
  tree under the matched path, and filled from L2 (the slot is then freed: a page
  lives in L2 or L1, not both) or from L3 (the file stays).
* **Write-through to disk.** With a disk tier, every page the tree gains by an
  insert (a computed page) is also written to disk by the next step's copies,
  unless the disk tier has it already; so a server that stops finds on restart
  everything it computed (within the disk tier's bound), except the writes still
  in flight if it did not stop cleanly.
* **Copies and tickets.** Both directions are planned here and taken by the next
  step (``take_copies``: a ``protocol.PageCopies`` under a ticket, numbered from 1).
  The worker does the demotions (and reads the pages and slots to be written to
  disk) before that step computes (``step_done``); promotions, loads and file
  writes may finish steps later, and the worker reports the ticket when all of its
  copies are done (``copies_done``).
* **In flight.** Until its ticket is reported, a promoted page is *in flight*
  (``loading``): its node is locked by this cache (never evicted), and no request
  may compute on it; the host slots and disk files it comes from, and the files
  being written, stay pinned. The scheduler keeps a request whose match reaches an
  in-flight page (whoever promoted it) in its LOADING state.

* **The shared store.** With a KV store (``StoreTier``, ``store_tier.py``) every
  page the tree gains by an insert is also written to the store, and ``fetch``
  reads the pages after an admitted request's match from it, into the request's
  own pages (the request is LOADING meanwhile; what the store did not give is
  computed). There may be no host tier then (``host`` of no slots: evicted pages
  are dropped, the store may still have them).

``last_match_tiers`` holds the last ``promote``'s split (tokens from L1, L2, L3,
and 0 for the store, whose pages arrive later).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from radixserve.protocol import KEY_BYTES, PageCopies
from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.disk_tier import DiskTier
from radixserve.scheduler.host_tier import HostTier
from radixserve.scheduler.kv_events import next_page_key, page_keys, salt_tag
from radixserve.scheduler.prefix_cache import CacheNode, MatchResult, PageFollower, PrefixCache
from radixserve.scheduler.radix_cache import as_tokens
from radixserve.scheduler.store_tier import StoreTier
from radixserve.utils import kv_file
from radixserve.utils.kv_store import StoreConfig

L2, L3 = 2, 3


class _Plan:
    """One step's copies, in the worker's order, under ``ticket``."""

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket
        self.save: list[tuple[int, bytes]] = []
        self.to_disk: list[tuple[int, bytes]] = []
        self.demote: list[tuple[int, int]] = []
        # pool page -> (tier, key, host slot or -1)
        self.promote: dict[int, tuple[int, bytes, int]] = {}
        self.nodes: list[CacheNode] = []  # locked while their promoted pages are in flight
        self.store_save: list[tuple[int, bytes]] = []
        self.store_load: list[tuple[int, bytes]] = []

    def __bool__(self) -> bool:
        return bool(
            self.save
            or self.to_disk
            or self.demote
            or self.promote
            or self.store_save
            or self.store_load
        )

    def message(self) -> PageCopies:
        i32 = lambda xs: np.asarray(xs, dtype=np.int32)  # noqa: E731
        up2 = [(slot, p) for p, (t, _, slot) in self.promote.items() if t == L2]
        up3 = [(key, p) for p, (t, key, _) in self.promote.items() if t == L3]
        return PageCopies(
            save_pages=i32([p for p, _ in self.save]),
            save_keys=b"".join(k for _, k in self.save),
            to_disk_slots=i32([s for s, _ in self.to_disk]),
            to_disk_keys=b"".join(k for _, k in self.to_disk),
            demote_pages=i32([p for p, _ in self.demote]),
            demote_slots=i32([s for _, s in self.demote]),
            promote_slots=i32([s for s, _ in up2]),
            promote_pages=i32([p for _, p in up2]),
            load_keys=b"".join(k for k, _ in up3),
            load_pages=i32([p for _, p in up3]),
            ticket=self.ticket,
            store_save_pages=i32([p for p, _ in self.store_save]),
            store_save_keys=b"".join(k for _, k in self.store_save),
            store_load_pages=i32([p for p, _ in self.store_load]),
            store_load_keys=b"".join(k for _, k in self.store_load),
        )


class _Flight:
    """What one ticket's copies hold until the worker reports them done."""

    def __init__(self, plan: _Plan) -> None:
        self.pages = np.fromiter(plan.promote, dtype=np.int32, count=len(plan.promote))
        self.host_reads = [key for t, key, _ in plan.promote.values() if t == L2]
        self.disk_reads = [key for t, key, _ in plan.promote.values() if t == L3]
        self.disk_writes = [key for _, key in plan.save] + [key for _, key in plan.to_disk]
        self.nodes = plan.nodes


class TieredCache(PageFollower):
    """L1 (``inner``, a radix tree) with a host tier, optionally a disk tier, and
    optionally the shared KV store."""

    def __init__(
        self,
        inner: PrefixCache,
        allocator: PageAllocator,
        host: HostTier,
        disk: DiskTier | None,
        root_key: bytes,
        store: StoreTier | None = None,
    ) -> None:
        super().__init__(inner, allocator, "cache tiers")
        if host.num_slots < 1 and store is None:
            raise ValueError("cache tiers need a host tier of at least one page")
        assert len(root_key) == KEY_BYTES
        self.host = host
        self.disk = disk
        self.store = store
        self.root_key = root_key
        n = allocator.num_pages
        self._key = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        self._loading = np.zeros(n, dtype=bool)  # pool pages whose KV is on its way
        self.pages_loading = 0
        self._plan = _Plan(1)
        self._flights: dict[int, _Flight] = {}  # ticket -> copies not reported done
        self._peek_memo: dict[tuple, bytes] = {}
        self.last_match_tiers = (0, 0, 0, 0)
        # Counters (pages) for stats.
        self.demoted = self.promoted = self.loaded = self.to_disk = 0
        self.dropped = self.saved = 0
        self.promotion_evictions = 0  # pool pages evicted to make room for promoted ones
        # The retention deadline of each pool page's prefix (0: none), for demotion.
        self._retained_until = np.zeros(n, dtype=np.float64)
        self.retain = self._retain  # PageFollower bound the inner tree's

    def _retain(self, node: CacheNode, level: int, seconds: float) -> int:
        """The tree's ``retain``. Under the tree's ``priority`` policy the whole path's
        pages keep the deadline for the host tier even where the pool's caps clipped
        the hint: the caps bound what retention pins in the pool; below it, a retained
        page only displaces another retained one."""
        held = self.inner.retain(node, level, seconds)
        if getattr(self.inner, "policy", None) != "priority":
            return held
        until = time.monotonic() + seconds
        while node.parent is not None:  # up to the root (only the Python tree retains)
            pages = node.pages
            self._retained_until[pages] = np.maximum(self._retained_until[pages], until)
            node = node.parent
        return held

    # ------------------------------------------------------------- contract
    def match_prefix(
        self, tokens: np.ndarray | Sequence[int], salt: str | None = None
    ) -> MatchResult:
        """The tree's match (L1): pages in flight included (see ``loading``)."""
        return self.inner.match_prefix(tokens, salt)

    def _has_lower(self) -> bool:
        return len(self.host) > 0 or (self.disk is not None and len(self.disk) > 0)

    def _lower_tier(self, key: bytes) -> int:
        """Where below L1 ``key`` can be had now: L2, L3 or 0."""
        if self.host.readable(key):
            return L2
        disk = self.disk
        if disk is not None and disk.ready(key):
            return L3
        return 0

    def _lower_run(
        self,
        tokens: np.ndarray,
        first: int,
        end: int,
        parent: bytes,
        salt: str | None,
    ) -> list[tuple[int, bytes]]:
        """The pages ``first..end-1`` that L2/L3 hold, in order, up to the first miss."""
        ps = self.page_size
        tag = salt_tag(salt)
        run = []
        for i in range(first, end):
            page = tokens[i * ps : (i + 1) * ps].astype("<i4", copy=False).tobytes()
            key = next_page_key(tag, parent, page)
            tier = self._lower_tier(key)
            if not tier:
                break
            run.append((tier, key))
            parent = key
        return run

    def promote(
        self, tokens: np.ndarray | Sequence[int], m: MatchResult, salt: str | None = None
    ) -> MatchResult:
        """Extend ``m``, an L1 match of ``tokens`` whose ``last_node`` the caller
        has locked, with the L2/L3 pages after it: fresh pool pages (evicting if
        short; fewer when the pool cannot give them all), inserted into the tree
        and locked until the copies filling them are reported done. Returns the
        longer match (``m`` itself when nothing was promoted); the caller moves
        its lock to the new ``last_node``."""
        self.last_match_tiers = (m.hit_len, 0, 0, 0)
        if not self._has_lower():
            return m
        tokens = as_tokens(tokens)
        ps = self.page_size
        first, end = m.hit_len // ps, len(tokens) // ps
        parent = self._key[m.pages[-1]].tobytes() if first else self.root_key
        # Files are checked below, only those that will load (a check reads the file).
        run = self._lower_run(tokens, first, end, parent, salt)
        if not run:
            return m
        for tier, key in run:  # pinned: the evictions below must not take them
            self.host.pin_read(key) if tier == L2 else self.disk.pin_read(key)  # type: ignore[union-attr]
        n = len(run)
        ids = self.allocator.alloc(n)
        if ids is None:
            self.promotion_evictions += self.evict(n - self.allocator.num_free)
            ids = self.allocator.alloc(min(n, self.allocator.num_free))
        k = 0 if ids is None else len(ids)
        for tier, key in run[k:]:
            self._cancel(tier, key)
        for j in range(k):  # a broken file is deleted (a miss) and ends the run there
            tier, key = run[j]
            if tier == L3 and not self.disk.verify(key):  # type: ignore[union-attr]
                for t, later in run[j + 1 : k]:
                    self._cancel(t, later)
                self.allocator.free(ids[j:])  # type: ignore[index]
                ids, k = ids[:j], j  # type: ignore[index]
                break
        if k == 0:
            return m
        pages = np.concatenate([m.pages, ids]).astype(np.int32)
        cached_len, node = self.inner.insert(tokens[: (first + k) * ps], pages, salt)
        assert cached_len == m.hit_len, "the matched path changed under a lock"
        self.inner.lock(node)  # until the copies are done: evicting it would lose them
        self._plan.nodes.append(node)
        self._own(ids, [key for _, key in run[:k]])
        self._loading[ids] = True
        self.pages_loading += k
        l2 = 0
        for (tier, key), page in zip(run[:k], ids.tolist()):
            if tier == L2:
                self._plan.promote[page] = (L2, key, self.host.slot(key))
                self.promoted += 1
                l2 += 1
            else:
                self._plan.promote[page] = (L3, key, -1)
                self.loaded += 1
        self.last_match_tiers = (m.hit_len, l2 * ps, (k - l2) * ps, 0)
        return MatchResult((first + k) * ps, pages, node)

    def loading(self, pages: np.ndarray) -> bool:
        """Whether any of ``pages`` (L1 pages) still waits for its KV."""
        return bool(self._loading[pages].any())

    def peek_prefix(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> int:
        hit = self.inner.peek_prefix(tokens, salt)
        if not self._has_lower():
            return hit
        tokens = as_tokens(tokens)
        ps = self.page_size
        first, end = hit // ps, len(tokens) // ps
        if first >= end:
            return hit
        parent = self._prefix_key(tokens[:hit], salt)
        return hit + ps * len(self._lower_run(tokens, first, end, parent, salt))

    def lower_tiers(
        self, tokens: np.ndarray | Sequence[int], hit: int, salt: str | None = None
    ) -> list[int]:
        """The tier (L2 or L3) of each page after the first ``hit`` tokens (whole
        pages, an L1 hit) that the lower tiers hold, up to the first page they lack;
        changes nothing (the cache's explain, ``explain.py``)."""
        tokens = as_tokens(tokens)
        ps = self.page_size
        first, end = hit // ps, len(tokens) // ps
        if first >= end or not self._has_lower():
            return []
        parent = page_keys(tokens[:hit], ps, salt, self.root_key)[-1] if hit else self.root_key
        return [tier for tier, _ in self._lower_run(tokens, first, end, parent, salt)]

    def _prefix_key(self, tokens: np.ndarray, salt: str | None) -> bytes:
        """The key of the last page of ``tokens`` (whole pages), memoised: the
        scheduling policy peeks every waiting prompt every step."""
        if not len(tokens):
            return self.root_key
        # Python's hash of the bytes: a collision could only misorder scheduling (a
        # peek is an estimate; match_prefix recomputes every key it uses).
        memo = (salt, len(tokens), hash(tokens.tobytes()))
        key = self._peek_memo.get(memo)
        if key is None:
            if len(self._peek_memo) >= 4096:
                self._peek_memo.clear()
            key = self._peek_memo[memo] = page_keys(tokens, self.page_size, salt, self.root_key)[-1]
        return key

    def insert(
        self, tokens: np.ndarray | Sequence[int], pages: np.ndarray, salt: str | None = None
    ) -> tuple[int, CacheNode]:
        cached_len, node = self.inner.insert(tokens, pages, salt)
        ps = self.page_size
        first, end = cached_len // ps, len(tokens) // ps
        if first < end:
            tokens = as_tokens(tokens)
            pages = np.asarray(pages, dtype=np.int32)
            if first == 0:
                parent = self.root_key
            elif self._owned[pages[first - 1]]:
                # The caller's page before is the tree's (it matched or inserted it),
                # so its key is known; else it holds a duplicate there.
                parent = self._key[pages[first - 1]].tobytes()
            else:
                parent = page_keys(tokens[: first * ps], ps, salt, self.root_key)[-1]
            keys = page_keys(tokens[first * ps : end * ps], ps, salt, parent)
            self._own(pages[first:end], keys)
            if self.disk is not None:
                self._write_through(pages[first:end].tolist(), keys)
            if self.store is not None and self.store.write == "insert":
                for page, key in zip(pages[first:end].tolist(), keys):
                    if self.store.should_write(key):
                        self._plan.store_save.append((page, key))
        return cached_len, node

    def fetch(
        self,
        tokens: np.ndarray,
        pages: np.ndarray,
        first: int,
        salt: str | None = None,
        parent_page: int = -1,
    ) -> int:
        """Plan reading pages ``first..`` of ``tokens`` (whole pages) from the shared
        store into ``pages`` (the caller's own pool pages for those positions).
        ``parent_page``: the caller's page ``first - 1`` when it is the tree's (its
        key is known), else -1. Returns the run's id for ``StoreTier.pending`` /
        ``take`` / ``abandon`` (0: no store, or no page to read)."""
        store = self.store
        ps = self.page_size
        end = len(tokens) // ps
        if store is None or first >= end:
            return 0
        assert len(pages) == end - first
        if first == 0:
            parent = self.root_key
        elif parent_page >= 0 and self._owned[parent_page]:
            parent = self._key[parent_page].tobytes()
        else:
            parent = page_keys(tokens[: first * ps], ps, salt, self.root_key)[-1]
        keys = page_keys(tokens[first * ps : end * ps], ps, salt, parent)
        self._plan.store_load += zip(pages.tolist(), keys)
        return store.start(pages, keys, self._plan.ticket)

    def _write_through(self, pages: list[int], keys: list[bytes]) -> None:
        disk = self.disk
        assert disk is not None
        for page, key in zip(pages, keys):
            if key in disk:
                disk.touch(key)
            elif disk.add_pending(key):
                self._plan.save.append((page, key))
                self.saved += 1

    def _own(self, pages: np.ndarray, keys: list[bytes]) -> None:
        self._owned[pages] = True
        self._retained_until[pages] = 0.0  # a page the tree takes anew
        self._key[pages] = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, KEY_BYTES)

    # -------------------------------------------------------------- demotion
    def evict(self, num_pages: int) -> int:
        freed = self.inner.evict(num_pages)
        if freed:
            to_store = self.store is not None and self.store.write == "evict"
            for page in self._gone().tolist():
                key = self._key[page].tobytes()
                if to_store and self.store.should_write(key):  # type: ignore[union-attr]
                    self._plan.store_save.append((page, key))  # read in step, as a demotion
                self._demote(page, key)
        return freed

    def _demote(self, page: int, key: bytes) -> None:
        assert not self._loading[page], "a page in flight was evicted"
        until, self._retained_until[page] = float(self._retained_until[page]), 0.0
        if key in self.host:
            self.host.touch(key, until)
            return
        slot = self._host_slot(until)
        if slot is None:
            self.dropped += 1
            return
        self.host.add_written(key, slot, until)
        self._plan.demote.append((page, slot))
        self.demoted += 1

    def _host_slot(self, retained_until: float = 0.0) -> int | None:
        """A host slot for a demotion of a page retained until ``retained_until``: a
        free one, else the LRU entry's (written to disk first when there is a disk
        tier and it lacks the page; a retained entry only for a retained page)."""
        slot = self.host.take_slot()
        if slot is not None:
            return slot
        now = time.monotonic()
        victim = self.host.pop_lru(now, retained=retained_until > now)
        if victim is None:
            return None
        key, slot = victim
        disk = self.disk
        if disk is None:
            self.dropped += 1
        elif key in disk:
            disk.touch(key)
        elif disk.add_pending(key):
            self._plan.to_disk.append((slot, key))
            self.to_disk += 1
        else:
            self.dropped += 1
        return slot

    def _cancel(self, tier: int, key: bytes) -> None:
        if tier == L2:
            self.host.cancel_read(key)
        else:
            self.disk.cancel_read(key)  # type: ignore[union-attr]

    # ------------------------------------------------------------ the step
    @property
    def has_copies(self) -> bool:
        """Whether copies wait for a step (write-through after the last insert)."""
        return bool(self._plan)

    @property
    def pages_held(self) -> int:
        """Pool pages the tiers hold outside the tree: those of requests let go while
        a store read still fills them (freed when its ticket is reported)."""
        return 0 if self.store is None else len(self.store.pages_held)

    @property
    def in_flight(self) -> int:
        """Tickets taken and not reported done yet."""
        return len(self._flights)

    def take_copies(self) -> PageCopies | None:
        """The copies the next step must perform (None: none), under a new ticket."""
        plan = self._plan
        if not plan:
            assert not plan.nodes
            return None
        self._flights[plan.ticket] = _Flight(plan)
        self._plan = _Plan(plan.ticket + 1)
        return plan.message()

    def step_done(self) -> None:
        """The worker ran the step that carried the last copies taken: its
        demotions are done (the host slots they filled may be read)."""
        self.host.step_done()

    def copies_done(self, tickets: Sequence[int], store_missed: Sequence[int] = ()) -> None:
        """The worker finished these tickets' copies: promoted pages hold their KV
        (their nodes are unlocked), promoted host slots are freed, files read are
        unpinned and files written become readable; the store's runs read their
        pages up to the first in ``store_missed``."""
        missed = {int(p) for p in store_missed}
        for ticket in tickets:
            if self.store is not None:
                self.store.ticket_done(int(ticket), missed)
            flight = self._flights.pop(int(ticket), None)
            if flight is None:
                raise ValueError(f"the worker reported copies {ticket}, which are not in flight")
            self._loading[flight.pages] = False
            self.pages_loading -= len(flight.pages)
            for node in flight.nodes:
                self.inner.unlock(node)
            for key in flight.host_reads:
                self.host.release(key)
            if self.disk is not None:
                for key in flight.disk_reads:
                    self.disk.read_done(key)
                for key in flight.disk_writes:
                    self.disk.written(key)

    # ----------------------------------------------------------- flush, reset
    def flush(self, keep_disk: bool = False) -> int:
        """Drop every unlocked L1 page (no demotion), the host tier, and the disk
        tier unless ``keep_disk``; the L1 pages freed. Between steps only. Pages
        being promoted stay in L1 (locked, like a running request's); host slots
        and files being copied leave when their ticket is done."""
        # Between steps only writes-through can be planned; a flush forgets those to
        # disk and keeps those to the store (it is not flushed: other servers share it).
        plan = self._plan
        assert not (plan.to_disk or plan.demote or plan.promote or plan.store_load)
        if self.disk is not None:
            self.disk.forget_pending([key for _, key in plan.save])
        self._plan = _Plan(plan.ticket)
        self._plan.store_save = plan.store_save
        freed = self.inner.evict(self.inner.evictable_pages)
        self._gone()
        self.host.clear()
        if self.disk is not None and not keep_disk:
            self.disk.clear()
        return freed

    def reset(self) -> None:
        """Empty every tier (the tree's ``reset``: idle only, no copies in flight)."""
        assert not self._flights, "reset with copies in flight"
        self.inner.reset()
        self._owned[:] = False
        if self.disk is not None:
            self.disk.forget_pending([key for _, key in self._plan.save])
        self._plan = _Plan(self._plan.ticket)
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()

    def check(self) -> None:
        self.inner.check()
        self.host.check()
        if self.disk is not None:
            self.disk.check()
        if self.store is not None:
            self.store.check()
        owned = np.flatnonzero(self._owned)
        assert len(owned) == self.inner.cached_pages, "the tier index lost track of L1 pages"
        assert self.allocator.is_allocated(owned).all(), "an L1 page of the tree is free"
        loading = np.flatnonzero(self._loading)
        assert self._owned[loading].all(), "a page in flight left the tree"
        assert (
            len(loading)
            == self.pages_loading
            == len(self._plan.promote) + sum(len(f.pages) for f in self._flights.values())
        )
        # Pinned for copies exactly while a ticket (taken or planned) holds them.
        plan = self._plan
        reads = [key for t, key, _ in plan.promote.values() if t == L2]
        loads = [key for t, key, _ in plan.promote.values() if t == L3]
        writes = [key for _, key in plan.save] + [key for _, key in plan.to_disk]
        for flight in self._flights.values():
            reads += flight.host_reads
            loads += flight.disk_reads
            writes += flight.disk_writes
        assert sorted(reads) == sorted(self.host.reading_keys()), "a host slot pin leaked"
        if self.disk is not None:
            assert sorted(loads) == sorted(self.disk.keys_where("read")), "a file pin leaked"
            assert sorted(writes) == sorted(self.disk.keys_where("pending")), "a write leaked"

    def stats(self) -> dict[str, int]:
        return {
            "host_pages": self.host.num_slots,
            "host_pages_cached": len(self.host),
            "disk_pages_cached": 0 if self.disk is None else len(self.disk),
            "disk_pages_max": 0 if self.disk is None else self.disk.max_files,
            "disk_corrupt_files": 0 if self.disk is None else self.disk.corrupt,
            "pages_demoted": self.demoted,
            "pages_promoted": self.promoted,
            "pages_loaded": self.loaded,
            "pages_written": self.to_disk + self.saved,
            "pages_dropped": self.dropped,
            "copies_in_flight": len(self._flights),
            **(self.store.stats() if self.store is not None else {}),
        }

    def __repr__(self) -> str:
        return f"TieredCache({self.inner!r}, host={len(self.host)}/{self.host.num_slots})"


def build_tiers(
    inner: PrefixCache, allocator: PageAllocator, config: SchedulerConfig
) -> TieredCache:
    """``inner`` with the tiers ``config`` asks for (``host_pages`` > 0, or a KV store)."""
    identity = kv_file.identity_digest(config.kv_identity)
    disk = None
    if config.disk_cache_dir is not None:
        if config.page_bytes < 1 or not config.kv_identity:
            raise ValueError("the disk tier needs the worker's page_bytes and kv_identity")
        file_bytes = kv_file.HEADER_BYTES + config.page_bytes
        max_files = int(config.disk_cache_gb * (1 << 30)) // file_bytes
        disk = DiskTier(config.disk_cache_dir, identity, config.page_bytes, max_files)
    store = None
    if config.kv_store is not None:
        if config.page_bytes < 1 or not config.kv_identity:
            raise ValueError("the KV store needs the worker's page_bytes and kv_identity")
        store = StoreTier(
            allocator, config.page_bytes, StoreConfig.parse(config.kv_store_config).write
        )
    return TieredCache(inner, allocator, HostTier(config.host_pages), disk, identity, store)

"""The tiered cache against a simulated KV store and a brute-force model.

A hypothesis state machine drives ``TieredCache`` the way the scheduler does, one
step per rule: requests match, lock, promote from the host and disk tiers,
allocate (evicting, hence demoting), are computed once their promoted pages have
arrived, insert and finish; evictions, requests abandoned while their pages are in
flight, flushes (keeping the disk tier or not), corrupted and truncated page files
and restarts (a new cache over the same directory, losing the copies in flight)
come in between. Each step's copies are performed by a simulated worker on a
simulated pool, host buffer and real page files (``utils/kv_file.py``) as the real
one does: the in-step part (demotions, reading what is to be written to disk) at
the step, the rest (file writes, promotions, loads) when a rule finishes that
ticket, late and in any order, so the test sees the data:

* **content**: after every step, every page the tree holds, every host slot and
  every disk file holds exactly the KV of its token prefix (here: its key, an
  oracle computed from the tokens alone) — a page in flight once its ticket is
  done —, and every page a request computes on holds its prefix's KV;
* **locks at both ends**: a page in flight stays in the tree, its node locked
  (evictions never take it), and the host slot or file it comes from stays until
  its ticket is done;
* **conservation per tier**: pool pages free + in the tree + held by requests ==
  the pool; host slots free + in entries == the host buffer (``check()``); disk
  files within the bound;
* **nothing lost** (a host tier larger than anything the test caches, no flush):
  every page-aligned prefix ever inserted is still a hit (``peek_prefix`` equals
  the brute-force model's longest cached prefix).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.disk_tier import DiskTier
from radixserve.scheduler.host_tier import HostTier
from radixserve.scheduler.kv_events import page_keys
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.tiered_cache import TieredCache
from radixserve.utils import kv_file

SALTS = st.sampled_from([None, None, "a"])
IDENTITY = kv_file.identity_digest("test-model")
PAYLOAD = 64  # a simulated page's KV: its 32-byte key, twice


def content(key: bytes) -> bytes:
    return key + key


@dataclass(eq=False)
class Req:
    tokens: np.ndarray
    salt: str | None
    node: object
    locked_len: int
    table: np.ndarray
    hit_len: int
    computed: bool = False
    early: bool = False  # inserts its pages as soon as it computed them
    dups: list[np.ndarray] = field(default_factory=list)


class SimStore:
    """The worker's side: pool pages, host slots, page files; performs copies."""

    def __init__(self, num_pages: int, host_slots: int, directory: str | None) -> None:
        self.pool: list[bytes | None] = [None] * num_pages
        self.host: list[bytes | None] = [None] * host_slots
        self.directory = directory
        self.late: dict[int, tuple] = {}  # ticket -> the copies done when it finishes

    def apply(self, copies) -> None:
        """The in-step part now (what is to be written to disk is read, demotions);
        the rest when ``finish`` is called for the ticket."""
        if copies is None:
            return
        n = 32
        writes = []
        for i, page in enumerate(copies.save_pages.tolist()):
            key = copies.save_keys[n * i : n * i + n]
            assert self.pool[page] == content(key), "a page written through holds other KV"
            writes.append((key, self.pool[page]))
        for i, slot in enumerate(copies.to_disk_slots.tolist()):
            key = copies.to_disk_keys[n * i : n * i + n]
            assert self.host[slot] == content(key), "a host slot written to disk holds other KV"
            writes.append((key, self.host[slot]))
        for page, slot in zip(copies.demote_pages.tolist(), copies.demote_slots.tolist()):
            self.host[slot] = self.pool[page]
        promote = list(zip(copies.promote_slots.tolist(), copies.promote_pages.tolist()))
        load = [
            (copies.load_keys[n * i : n * i + n], page)
            for i, page in enumerate(copies.load_pages.tolist())
        ]
        assert copies.ticket not in self.late
        self.late[copies.ticket] = (writes, promote, load)

    def finish(self, ticket: int) -> None:
        writes, promote, load = self.late.pop(ticket)
        for key, payload in writes:
            kv_file.write_page_file(self.directory, key, IDENTITY, payload)
        for slot, page in promote:
            self.pool[page] = self.host[slot]
        for key, page in load:
            path = os.path.join(self.directory, kv_file.file_name(key))
            payload = kv_file.read_payload(path, key, IDENTITY, PAYLOAD)
            assert payload is not None, "a page file the scheduler verified is broken"
            self.pool[page] = payload


class TieredMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 8
    host_slots = 4
    disk_files: int | None = 8  # None: no disk tier
    max_len = 10
    ample = False  # the host tier holds everything: nothing may be lost

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="rs-tiers-") if self.disk_files else None
        self.model: set[tuple] = set()  # every inserted (salt, page-aligned prefix)
        self.prefix_of: dict[bytes, tuple] = {}  # key -> (salt, prefix), for revisits
        self.reqs: list[Req] = []
        self.start()

    def start(self) -> None:
        ps = self.page_size
        self.alloc = PageAllocator(self.num_pages, ps)
        disk = None
        if self.dir is not None:
            disk = DiskTier(self.dir, IDENTITY, PAYLOAD, self.disk_files)
        self.cache = TieredCache(
            RadixCache(self.alloc, ps), self.alloc, HostTier(self.host_slots), disk, IDENTITY
        )
        self.store = SimStore(self.num_pages, self.host_slots, self.dir)

    def teardown(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------ helpers
    def keys(self, tokens: np.ndarray, salt) -> list[bytes]:
        return page_keys(tokens, self.page_size, salt, IDENTITY)

    def end_step(self) -> None:
        self.store.apply(self.cache.take_copies())
        self.cache.step_done()

    def compute_ready(self) -> None:
        """Requests whose promoted pages have all arrived compute their own pages."""
        ps = self.page_size
        for req in self.reqs:
            if req.computed or self.cache.loading(req.table[: req.hit_len // ps]):
                continue
            req.computed = True
            keys = self.keys(req.tokens, req.salt)
            for i, page in enumerate(req.table[: req.hit_len // ps].tolist()):
                assert self.store.pool[page] == content(keys[i]), f"page {i} of a hit is wrong"
            for i in range(req.hit_len // ps, len(req.table)):  # the prefill writes its pages
                whole = i < len(keys)
                self.store.pool[int(req.table[i])] = content(keys[i]) if whole else b"partial"
            if req.early:
                self.insert(req, len(req.tokens))

    def match_and_promote(self, tokens: np.ndarray, salt):
        """The scheduler's admission: the L1 match, locked, then promotion."""
        m = self.cache.match_prefix(tokens, salt)
        self.cache.lock(m.last_node)
        p = self.cache.promote(tokens, m, salt)
        assert sum(self.cache.last_match_tiers) == p.hit_len
        if p.last_node is not m.last_node:
            self.cache.lock(p.last_node)
            self.cache.unlock(m.last_node)
        return p

    def gen_tokens(self, data) -> np.ndarray:
        base: tuple = ()
        if self.model and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sorted(self.model, key=repr)))[1]
        tail = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=self.max_len))
        return np.array((list(base) + tail)[: self.max_len + 4], dtype=np.int32)

    def model_hit(self, tokens: np.ndarray, salt) -> int:
        ps, k = self.page_size, 0
        while k + ps <= len(tokens) and (salt, tuple(tokens[: k + ps].tolist())) in self.model:
            k += ps
        return k

    def alloc_or_evict(self, n: int):
        ids = self.alloc.alloc(n)
        if ids is None:
            self.cache.evict(n - self.alloc.num_free)
            ids = self.alloc.alloc(n)
        return ids

    def insert(self, req: Req, length: int) -> None:
        ps = self.page_size
        full = length - length % ps
        tokens = req.tokens[:full]
        cached_len, node = self.cache.insert(tokens, req.table[: full // ps], req.salt)
        assert cached_len >= req.locked_len
        keys = self.keys(tokens, req.salt)
        for k in range(ps, full + 1, ps):
            self.model.add((req.salt, tuple(tokens[:k].tolist())))
            self.prefix_of[keys[k // ps - 1]] = (req.salt, tuple(tokens[:k].tolist()))
        if cached_len > req.locked_len:
            req.dups.append(req.table[req.locked_len // ps : cached_len // ps])
        req.locked_len = max(req.locked_len, full)
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node

    # -------------------------------------------------------------- rules
    @rule(data=st.data(), salt=SALTS, cache_early=st.booleans())
    def start_request(self, data, salt, cache_early, tokens=None):
        """One step: match, lock, promote, allocate, copy; compute once arrived."""
        ps = self.page_size
        if tokens is None:
            tokens = self.gen_tokens(data)
        peek = self.cache.peek_prefix(tokens[:-1], salt)
        m = self.match_and_promote(tokens[:-1], salt)
        assert m.hit_len <= peek  # fewer only when the pool could not take them all
        need = -(-len(tokens) // ps) - m.hit_len // ps
        own = self.alloc_or_evict(need)
        self.end_step()
        if own is None:
            self.cache.unlock(m.last_node)  # passed over (its pages still arrive)
            return
        table = np.concatenate([m.pages, own]).astype(np.int32)
        self.reqs.append(Req(tokens, salt, m.last_node, m.hit_len, table, m.hit_len))
        self.reqs[-1].early = cache_early
        self.compute_ready()

    @precondition(lambda self: self.store.late)
    @rule(data=st.data())
    def finish_copies(self, data):
        """The worker reports a ticket (any of those in flight, late)."""
        ticket = data.draw(st.sampled_from(sorted(self.store.late)))
        self.store.finish(ticket)
        self.cache.copies_done([ticket])
        self.compute_ready()

    @precondition(lambda self: any(r.computed for r in self.reqs))
    @rule(data=st.data(), early=st.booleans())
    def finish(self, data, early):
        req = data.draw(st.sampled_from([r for r in self.reqs if r.computed]))
        self.reqs.remove(req)
        if not early:
            self.insert(req, len(req.tokens))
        ps = self.page_size
        for pages in [*req.dups, req.table[req.locked_len // ps :]]:
            self.alloc.free(pages)
        self.cache.unlock(req.node)

    @precondition(lambda self: any(not r.computed for r in self.reqs))
    @rule(data=st.data())
    def abandon_loading(self, data):
        """A request aborted (or retracted) while its pages are in flight: it
        frees its own pages; the pages in flight stay locked until they arrive."""
        req = data.draw(st.sampled_from([r for r in self.reqs if not r.computed]))
        self.reqs.remove(req)
        self.alloc.free(req.table[req.locked_len // self.page_size :])
        self.cache.unlock(req.node)

    @rule(data=st.data(), salt=SALTS, n=st.integers(0, 8))
    def match_then_evict(self, data, salt, n):
        """Pages promoted for a request that then gives them up, and an eviction in
        the same step: the pages in flight are not evicted, nothing is lost."""
        tokens = self.gen_tokens(data)
        m = self.match_and_promote(tokens, salt)
        self.cache.unlock(m.last_node)
        self.cache.evict(n)
        self.end_step()

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.cache.evict(n)
        self.end_step()

    @precondition(lambda self: self.dir is not None)
    @rule(data=st.data())
    def revisit_disk_page(self, data):
        """A request for a prefix whose last page is on disk (most are in no other
        tier by then): it is loaded, or a miss when its file is broken."""
        known = [k for k in self.cache.disk.cached_keys() if k in self.prefix_of]
        if not known:
            return
        salt, prefix = self.prefix_of[data.draw(st.sampled_from(sorted(known)))]
        tokens = np.array([*prefix, 0], dtype=np.int32)
        self.start_request(data=data, salt=salt, cache_early=False, tokens=tokens)

    @precondition(lambda self: not self.ample)
    @rule(keep_disk=st.booleans())
    def flush(self, keep_disk):
        self.cache.flush(keep_disk)
        if not keep_disk:
            self.model.clear()

    @precondition(lambda self: self.dir is not None and not self.reqs)
    @rule()
    def restart(self):
        """A new server over the same directory: only the disk tier survives (a
        crash: the copies in flight never happen)."""
        self.start()

    @precondition(lambda self: self.dir is not None)
    @rule(data=st.data(), how=st.sampled_from(["truncate", "flip", "garbage"]))
    def corrupt_file(self, data, how):
        # A file a ticket in flight is reading is left alone: damage between the
        # scheduler's check and the worker's read is the documented hard error
        # (worker/host_cache.py: the step fails), not a miss this model follows.
        reading = {kv_file.file_name(k) for _, _, load in self.store.late.values()
                   for k, _ in load}  # fmt: skip
        names = sorted(n for n in os.listdir(self.dir)
                       if n.endswith(kv_file.SUFFIX) and n not in reading)  # fmt: skip
        if not names:
            return
        path = os.path.join(self.dir, data.draw(st.sampled_from(names)))
        with open(path, "rb") as f:
            raw = f.read()
        if how == "truncate":
            raw = raw[: len(raw) // 2]
        elif how == "flip" and raw:  # (a file truncated to nothing stays empty)
            raw = raw[:-1] + bytes([raw[-1] ^ 1])
        else:
            raw = b"not a page"
        with open(path, "wb") as f:
            f.write(raw)

    # --------------------------------------------------------- invariants
    @invariant()
    def tiers_hold_their_kv(self):
        cache, ps = self.cache, self.page_size
        cache.check()
        assert cache.in_flight == len(self.store.late)
        tree = cache.inner
        for salt, root in tree._roots.items():
            stack = [(c, ()) for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                full = prefix + tuple(node.key.tolist())
                keys = self.keys(np.array(full, dtype=np.int32), salt)
                for i, page in enumerate(node.pages.tolist()):
                    key = keys[len(prefix) // ps + i]
                    if cache.loading(np.array([page])):
                        assert node.lock_ref > 0, "a page in flight is evictable"
                        continue
                    assert self.store.pool[page] == content(key), "a tree page holds other KV"
                stack.extend((c, full) for c in node.children.values())
        for key in cache.host.cached_keys():
            assert self.store.host[cache.host.slot(key)] == content(key), "a host slot is wrong"
        if cache.disk is not None:
            for key in cache.disk.cached_keys():
                path = cache.disk.path(key)
                payload = kv_file.read_payload(path, key, IDENTITY, PAYLOAD)
                assert payload is None or payload == content(key), "a page file holds other KV"

    @invariant()
    def pool_is_conserved(self):
        ps = self.page_size
        held = sum(len(r.table) - r.locked_len // ps + sum(map(len, r.dups)) for r in self.reqs)
        assert self.alloc.num_free + self.cache.cached_pages + held == self.num_pages

    @invariant()
    def nothing_is_lost(self):
        if not self.ample:
            return
        for salt, prefix in list(self.model)[:20]:
            tokens = np.array(prefix, dtype=np.int32)
            assert self.cache.peek_prefix(tokens, salt) == self.model_hit(tokens, salt)


SETTINGS = settings(
    max_examples=30,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class Page1(TieredMachine):
    pass


class Page4(TieredMachine):
    page_size = 4
    num_pages = 8
    max_len = 20


class NoDisk(TieredMachine):
    disk_files = None


class Ample(TieredMachine):
    """L2 larger than anything cached: evicted pages must all stay hits."""

    disk_files = None
    host_slots = 400


class AmplePage4(Ample):
    page_size = 4
    num_pages = 8
    max_len = 20


TestTieredPage1 = Page1.TestCase
TestTieredPage4 = Page4.TestCase
TestTieredNoDisk = NoDisk.TestCase
TestTieredAmple = Ample.TestCase
TestTieredAmplePage4 = AmplePage4.TestCase
for case in (
    TestTieredPage1,
    TestTieredPage4,
    TestTieredNoDisk,
    TestTieredAmple,
    TestTieredAmplePage4,
):
    case.settings = SETTINGS
del case  # a TestCase bound to a module name would be collected twice

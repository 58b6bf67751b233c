"""The native radix tree against the Python reference, operation by operation.

Both trees get the same random operations (match, peek, insert, lock, unlock,
evict, reset, misuse) at page sizes 1, 4 and 16, with salts and a three-token
alphabet so edges split often. Each tree has its own PageAllocator; since both
follow the same deterministic LRU clock and free pages in the same order, the
allocators stay identical, so page ids can be compared directly. After every
step: the same answers, sizes, clocks, node states of every held handle, the
same free pages, and both trees pass check().
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCache, RadixCacheError
from radixserve.scheduler.radix_impl import NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON
from tests.helpers.native import require_built

require_built(NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON, "native radix tree", module=True)

from radixserve.scheduler.radix_native import NativeRadixCache  # noqa: E402

SALTS = st.sampled_from([None, None, "a", "b"])


def py_info(node):
    """The Python node as native node_info reports it."""
    if node.is_root:
        return (0, 0, 0, 0)
    if node.parent is None:
        return None
    return (node.node_id, node.lock_ref, node.last_access, len(node.key))


def cached_paths(tree: RadixCache, salt) -> list[list[int]]:
    """Every root-to-node token path of ``salt``'s namespace in the Python tree."""
    out = []
    for node in tree._iter_nodes():
        if not _under(node, salt, tree):
            continue
        parts = []
        n = node
        while n is not None and not n.is_root:
            parts.append(n.key.tolist())
            n = n.parent
        out.append([t for part in reversed(parts) for t in part])
    return out


def _under(node, salt, tree) -> bool:
    while node.parent is not None:
        node = node.parent
    return node is tree._roots.get(salt)


def same_outcome(call_py, call_nat):
    """Run both calls; they must return equal values or raise the same type."""
    out = []
    for call in (call_py, call_nat):
        try:
            out.append(("ok", call()))
        except (RadixCacheError, ValueError, TypeError) as e:
            out.append(("raised", type(e)))
    assert out[0][0] == out[1][0], f"python {out[0]} vs native {out[1]}"
    if out[0][0] == "raised":
        assert out[0][1] is out[1][1]
    return out[0][0] == "ok", out[0][1], out[1][1]


class DiffMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 48
    max_len = 24

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc_py = PageAllocator(self.num_pages, ps)
        self.alloc_nat = PageAllocator(self.num_pages, ps)
        self.py = RadixCache(self.alloc_py, ps)
        self.nat = NativeRadixCache(self.alloc_nat, ps)
        self.handles: list[tuple] = []  # (python node, native handle, how often we locked it)
        self.seen: list[np.ndarray] = []

    def gen_tokens(self, data) -> np.ndarray:
        base: list[int] = []
        if self.seen and data.draw(st.booleans()):
            seq = data.draw(st.sampled_from(self.seen))
            base = seq[: data.draw(st.integers(0, len(seq)))].tolist()
        tail = data.draw(st.lists(st.integers(0, 2), max_size=self.max_len))
        return np.array((base + tail)[: self.max_len + 8], dtype=np.int32)

    def keep(self, node_py, node_nat, locked: int) -> None:
        assert py_info(node_py) == self.nat.node_info(node_nat)
        self.handles.append([node_py, node_nat, locked])

    def evict_both(self, n: int) -> None:
        freed = self.py.evict(n)
        assert self.nat.evict(n) == freed

    # ------------------------------------------------------------------ rules
    @rule(data=st.data(), salt=SALTS, lock=st.booleans(), as_list=st.booleans())
    def match(self, data, salt, lock, as_list):
        tokens = self.gen_tokens(data)
        arg = tokens.tolist() if as_list else tokens
        assert self.py.peek_prefix(tokens, salt) == self.nat.peek_prefix(arg, salt)
        mp = self.py.match_prefix(tokens, salt)
        mn = self.nat.match_prefix(arg, salt)
        assert mn.hit_len == mp.hit_len
        assert mn.pages.dtype == np.int32 and mn.pages.tolist() == mp.pages.tolist()
        if lock:
            self.py.lock(mp.last_node)
            self.nat.lock(mn.last_node)
        self.keep(mp.last_node, mn.last_node, int(lock))

    @rule(data=st.data(), salt=SALTS, max_len=st.integers(0, 12))
    def continuation(self, data, salt, max_len):
        """Speculative decoding's radix drafts: the same tokens from both trees, and
        they continue ``tokens`` along a path the tree holds (brute force over
        every root-to-node path of the Python tree)."""
        tokens = self.gen_tokens(data)
        got = self.py.continuation(tokens, max_len, salt)
        assert got.dtype == np.int32
        assert self.nat.continuation(tokens, max_len, salt).tolist() == got.tolist()
        paths = cached_paths(self.py, salt)
        whole = tokens.tolist() + got.tolist()
        extends = [p for p in paths if len(p) > len(tokens) and p[: len(tokens)] == tokens.tolist()]
        assert bool(len(got)) == bool(extends and max_len > 0)
        if len(got):
            assert any(p[: len(whole)] == whole for p in extends)
            # It stops at max_len or at a leaf: nothing cached continues it further.
            if len(got) < max_len:
                assert not any(len(p) > len(whole) and p[: len(whole)] == whole for p in paths)

    @rule(salt=SALTS, every=st.booleans(), max_label=st.integers(-1, 5))
    def export_nodes(self, salt, every, max_label):
        """The tree's shape (explain, the dashboard): equal array for array, and the
        Python export rebuilds exactly the paths the tree holds."""
        got = self.py.export_nodes(max_label, salt, every)
        nat = self.nat.export_nodes(max_label, salt, every)
        assert got.keys() == nat.keys() and got["salts"] == nat["salts"]
        for k, v in got.items():
            if k != "salts":
                assert nat[k].dtype == v.dtype and nat[k].tolist() == v.tolist(), k
        if max_label < 0:
            paths: list[list[int]] = []
            for i, p in enumerate(got["parent"].tolist()):
                edge = got["labels"][got["label_offsets"][i] : got["label_offsets"][i + 1]]
                paths.append(([] if p < 0 else paths[p]) + edge.tolist())
            for ns, name in enumerate(got["salts"]):
                mine = [p for p, n in zip(paths, got["namespace"].tolist()) if n == ns]
                assert sorted(mine) == sorted(cached_paths(self.py, name))
            if not every:
                assert got["salts"] in ([], [salt])

    @rule(data=st.data(), salt=SALTS, lock=st.booleans())
    def insert(self, data, salt, lock):
        ps = self.page_size
        tokens = self.gen_tokens(data)
        n = len(tokens) // ps
        if n > self.alloc_py.num_free:
            self.evict_both(n - self.alloc_py.num_free)
        pages = self.alloc_py.alloc(n)
        pages_nat = self.alloc_nat.alloc(n)
        if pages is None:  # all pages are locked
            assert pages_nat is None
            return
        assert pages_nat.tolist() == pages.tolist()
        cached_py, node_py = self.py.insert(tokens, pages, salt)
        cached_nat, node_nat = self.nat.insert(tokens, pages.copy(), salt)
        assert cached_nat == cached_py
        # The caller frees its pages that duplicate the tree's.
        self.alloc_py.free(pages[: cached_py // ps])
        self.alloc_nat.free(pages[: cached_py // ps])
        if lock:
            self.py.lock(node_py)
            self.nat.lock(node_nat)
        self.keep(node_py, node_nat, int(lock))
        self.seen.append(tokens)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def lock(self, data):
        h = data.draw(st.sampled_from(self.handles))
        ok, _, _ = same_outcome(lambda: self.py.lock(h[0]), lambda: self.nat.lock(h[1]))
        h[2] += ok

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def unlock(self, data):
        """Also unlocks below zero and stale handles: both must raise alike."""
        h = data.draw(st.sampled_from(self.handles))
        info = py_info(h[0])
        if h[2] == 0 and info is not None and info[1] > 0:
            return  # a lock some other holder owns: taking it breaks the contract
        ok, _, _ = same_outcome(lambda: self.py.unlock(h[0]), lambda: self.nat.unlock(h[1]))
        if ok and h[2]:
            h[2] -= 1

    @precondition(lambda self: self.handles)
    @rule()
    def release_all(self):
        """Every request finishes: drop all locks we hold."""
        for node_py, node_nat, locked in self.handles:
            for _ in range(locked):
                self.py.unlock(node_py)
                self.nat.unlock(node_nat)
        self.handles.clear()

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        self.evict_both(n)

    @rule()
    def reset(self):
        ok, _, _ = same_outcome(self.py.reset, self.nat.reset)
        if ok:
            self.handles = [h for h in self.handles if h[2] == 0]

    @rule(data=st.data())
    def misuse(self, data):
        tokens = self.gen_tokens(data)
        bad_pages = np.zeros(len(tokens) // self.page_size + 1, dtype=np.int32)
        same_outcome(
            lambda: self.py.insert(tokens, bad_pages), lambda: self.nat.insert(tokens, bad_pages)
        )
        same_outcome(
            lambda: self.py.match_prefix(tokens, salt=7),
            lambda: self.nat.match_prefix(tokens, salt=7),
        )
        same_outcome(
            lambda: self.py.peek_prefix([tokens.tolist()]),
            lambda: self.nat.peek_prefix([tokens.tolist()]),
        )

    # ------------------------------------------------------------- invariants
    @invariant()
    def identical(self):
        py, nat = self.py, self.nat
        py.check()
        nat.check()
        assert (nat.evictable_pages, nat.protected_pages, nat.cached_pages, nat.num_nodes) == (
            py.evictable_pages,
            py.protected_pages,
            py.cached_pages,
            py.num_nodes,
        )
        assert nat.clock == py._clock
        assert self.alloc_nat.num_free == self.alloc_py.num_free
        assert sorted(nat.all_pages().tolist()) == sorted(py.all_pages().tolist())
        n = self.alloc_py.num_free
        assert self.alloc_nat._stack[:n].tolist() == self.alloc_py._stack[:n].tolist()
        for node_py, node_nat, _ in self.handles:
            assert nat.node_info(node_nat) == py_info(node_py)


class DiffMachinePage4(DiffMachine):
    page_size = 4
    num_pages = 24
    max_len = 40


class DiffMachinePage16(DiffMachine):
    page_size = 16
    num_pages = 12
    max_len = 70


_settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestDiffPage1 = DiffMachine.TestCase
TestDiffPage1.settings = _settings
TestDiffPage4 = DiffMachinePage4.TestCase
TestDiffPage4.settings = _settings
TestDiffPage16 = DiffMachinePage16.TestCase
TestDiffPage16.settings = _settings

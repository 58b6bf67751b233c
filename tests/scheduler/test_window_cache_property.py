"""The radix tree with window pages against a brute-force model under random operations.

The model is a dict holding every cached page-aligned prefix: (salt, tokens) -> (the
full page id of its last page, that page's window page or -1). Requests drive the
tree as ``KVCacheManager`` does for a model with sliding layers: match the prompt
minus its last token (the longest *valid* prefix: window pages present on
[L - W, L)), lock, take references on the window pages their window needs, allocate
full and window pages (evicting whole nodes, or window pages, when short), let the
window pages older than W go as they advance, insert early and at finish (the tree
takes its own references, and fills in window pages it had dropped), release.
After every step the tree must hold exactly the model's prefixes, pass ``check()``,
and conserve both pools; ``evict_window`` must take nodes in LRU order and never
free a window page a request still holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCache, RadixNode
from radixserve.scheduler.window_cache import SlidingWindows, valid_length
from radixserve.scheduler.window_pages import WindowPages

SALTS = st.sampled_from([None, None, "a"])


@dataclass(eq=False)
class Req:
    tokens: np.ndarray
    salt: str | None
    node: RadixNode  # locked
    locked_len: int
    table: np.ndarray  # full pages
    win: np.ndarray  # window pages it holds a reference on (-1: none)
    dups: list[np.ndarray] = field(default_factory=list)

    def held(self, ps: int) -> list[np.ndarray]:
        return [*self.dups, self.table[self.locked_len // ps :]]


def tree_contents(tree: RadixCache) -> dict:
    ps = tree.page_size
    windows = tree.components["window"]
    out = {}
    for salt, root in tree._roots.items():
        stack = [(c, ()) for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            win = windows.by_node[node]
            for i in range(len(node.pages)):
                key = (salt, prefix + tuple(node.key[: (i + 1) * ps].tolist()))
                out[key] = (int(node.pages[i]), int(win[i]))
            full = prefix + tuple(node.key.tolist())
            stack.extend((c, full) for c in node.children.values())
    return out


class WindowTreeMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 40
    num_window = 24
    span = 5
    max_len = 20

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = PageAllocator(self.num_pages, ps)
        self.wp = WindowPages(self.num_window, ps)
        self.windows = SlidingWindows(self.wp, self.span)
        self.tree = RadixCache(self.alloc, ps, components=[self.windows])
        self.model: dict[tuple, tuple[int, int]] = {}
        self.reqs: list[Req] = []

    # ------------------------------------------------------------- model side
    def model_path(self, tokens: np.ndarray, salt) -> list[tuple[int, int]]:
        ps, out, k = self.page_size, [], self.page_size
        while k <= len(tokens) and (salt, tuple(tokens[:k].tolist())) in self.model:
            out.append(self.model[(salt, tuple(tokens[:k].tolist()))])
            k += ps
        return out

    def model_valid(self, tokens: np.ndarray, salt) -> int:
        """Brute force: the longest L whose window pages cover [L - W, L)."""
        ps = self.page_size
        path = self.model_path(tokens, salt)
        for n in range(len(path), 0, -1):
            first = max(n * ps - self.span, 0) // ps
            if all(path[p][1] >= 0 for p in range(first, n)):
                return n * ps
        return 0

    def gen_tokens(self, data) -> np.ndarray:
        keys = list(self.model)
        base: tuple = ()
        if keys and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sorted(keys, key=repr)))[1]
        tail = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=self.max_len))
        return np.array((list(base) + tail)[: self.max_len + 4], dtype=np.int32)

    def adopt(self, may_lose_windows: bool = True) -> None:
        """After an eviction: surviving prefixes keep their pages (a window page may
        only have been dropped); none on a locked path is gone."""
        contents = tree_contents(self.tree)
        for key, (page, win) in contents.items():
            old_page, old_win = self.model[key]
            assert page == old_page, "eviction changed a surviving prefix's page"
            assert win == old_win or (may_lose_windows and win == -1)
        for r in self.reqs:
            ps = self.page_size
            for k in range(ps, r.locked_len + 1, ps):
                key = (r.salt, tuple(r.tokens[:k].tolist()))
                if key in self.model:
                    assert key in contents, "a locked prefix was evicted"
        self.model = contents

    def alloc_full(self, n: int):
        ids = self.alloc.alloc(n)
        if ids is None:
            self.tree.evict(n - self.alloc.num_free)
            self.adopt()
            ids = self.alloc.alloc(n)
        return ids

    def alloc_window(self, n: int):
        ids = self.wp.alloc(n)
        if ids is None:
            self.windows.evict_window(n - self.wp.num_free)
            self.adopt()
            ids = self.wp.alloc(n)
        return ids

    def slide(self, req: Req, start: int) -> None:
        """The request's next step starts at ``start``: pages wholly before
        ``start - W`` leave its window."""
        ps = self.page_size
        drop = max(start - self.span, 0) // ps
        self.wp.unref(req.win[:drop].copy())
        req.win[:drop] = -1

    def insert(self, req: Req, length: int) -> None:
        ps = self.page_size
        full = length - length % ps
        tokens = req.tokens[:full]
        path = self.model_path(tokens, req.salt)
        cached_len, node = self.tree.insert(
            tokens, req.table[: full // ps], req.salt, window=req.win[: full // ps]
        )
        assert cached_len == len(path) * ps
        assert cached_len >= req.locked_len
        for k in range(ps, full + 1, ps):
            key = (req.salt, tuple(tokens[:k].tolist()))
            mine = int(req.win[k // ps - 1])
            if k > cached_len:
                self.model[key] = (int(req.table[k // ps - 1]), mine)
            elif self.model[key][1] < 0 and mine >= 0:
                self.model[key] = (self.model[key][0], mine)  # filled in again
        if cached_len > req.locked_len:
            req.dups.append(req.table[req.locked_len // ps : cached_len // ps])
        req.locked_len = max(req.locked_len, full)
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node = node

    def grow(self, req: Req, tokens: np.ndarray) -> bool:
        ps = self.page_size
        need = -(-len(tokens) // ps) - len(req.table)
        full = self.alloc_full(need)
        if full is None:
            return False
        win = self.alloc_window(need)
        if win is None:
            self.alloc.free(full)
            return False
        req.tokens = tokens
        req.table = np.concatenate([req.table, full]).astype(np.int32)
        req.win = np.concatenate([req.win, win]).astype(np.int32)
        return True

    # ------------------------------------------------------------------ rules
    @rule(data=st.data(), salt=SALTS)
    def start_request(self, data, salt):
        ps = self.page_size
        tokens = self.gen_tokens(data)
        expect = self.model_valid(tokens[:-1], salt)
        assert self.tree.peek_prefix(tokens[:-1], salt) == expect
        m = self.tree.match_prefix(tokens[:-1], salt=salt)
        assert m.hit_len == expect
        path = self.model_path(tokens[:-1], salt)[: expect // ps]
        assert m.pages.tolist() == [p for p, _ in path]
        win = self.windows.window_pages(m.last_node)
        assert win.tolist() == [w for _, w in path]
        self.tree.lock(m.last_node)
        first = max(m.hit_len - self.span, 0) // ps
        mine = np.full(len(win), -1, dtype=np.int32)
        mine[first:] = win[first:]
        assert (mine[first:] >= 0).all(), "a valid match lacks a window page"
        self.wp.ref(mine[first:])
        req = Req(tokens[: m.hit_len], salt, m.last_node, m.hit_len, m.pages.copy(), mine)
        self.reqs.append(req)
        if not self.grow(req, tokens):
            self.finish_req(req, insert=False)
            return
        self.slide(req, data.draw(st.integers(m.hit_len, len(tokens))))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache_early(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        self.insert(req, len(req.tokens))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        extra = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))
        start = len(req.tokens)
        self.slide(req, start)
        if self.grow(req, np.concatenate([req.tokens, np.array(extra, dtype=np.int32)])):
            self.slide(req, data.draw(st.integers(start, len(req.tokens))))

    def finish_req(self, req: Req, insert: bool) -> None:
        self.reqs.remove(req)
        if insert:
            self.insert(req, len(req.tokens))
        self.wp.unref(req.win)
        for pages in req.held(self.page_size):
            self.alloc.free(pages)
        self.tree.unlock(req.node)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), early=st.booleans())
    def finish(self, data, early):
        self.finish_req(data.draw(st.sampled_from(self.reqs)), insert=not early)

    @rule(data=st.data(), salt=SALTS)
    def match_only(self, data, salt):
        tokens = self.gen_tokens(data)
        expect = self.model_valid(tokens, salt)
        assert self.tree.peek_prefix(tokens, salt=salt) == expect
        assert self.tree.match_prefix(tokens, salt=salt).hit_len == expect
        assert self.tree.kv_prefix(tokens, salt) == len(self.model_path(tokens, salt)) * (
            self.page_size
        )

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        evictable = self.tree.evictable_pages
        freed = self.tree.evict(n)
        assert freed >= min(n, evictable)
        self.adopt()

    @rule(n=st.integers(0, 12))
    def evict_window(self, n):
        evictable = self.wp.evictable
        windows = self.windows
        order = sorted(
            (nd for nd, w in windows.by_node.items() if (w >= 0).any()),
            key=lambda nd: (nd.last_access, nd.node_id),
        )
        before = {nd: windows.by_node[nd].copy() for nd in order}
        requests = np.concatenate([r.win for r in self.reqs]) if self.reqs else np.zeros(0, int)
        requests = requests[requests >= 0]
        freed = windows.evict_window(n)
        assert freed >= min(n, evictable)
        touched = [
            not nd.attached or not np.array_equal(windows.by_node.get(nd, before[nd]), before[nd])
            for nd in order
        ]
        k = sum(touched)
        assert touched == [True] * k + [False] * (len(order) - k), "not least recently used first"
        assert (self.wp.refs[requests] > 0).all(), "a window page a request holds was freed"
        self.adopt()

    # ------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        self.tree.check()
        assert tree_contents(self.tree) == self.model
        ps = self.page_size
        held = sum(len(p) for r in self.reqs for p in r.held(ps))
        assert self.alloc.num_free + self.tree.cached_pages + held == self.num_pages
        # Window pages: each reference is the tree's or a request's.
        refs = np.zeros(self.num_window, dtype=np.int32)
        for r in self.reqs:
            np.add.at(refs, r.win[r.win >= 0], 1)
        refs += self.wp.held
        assert (refs == self.wp.refs).all(), "a window page's references are miscounted"
        for r in self.reqs:  # a request holds its whole window
            first = max(len(r.tokens) - self.span, 0) // ps
            assert (r.win[first : -(-len(r.tokens) // ps)] >= 0).all() or len(r.win) == 0

    def teardown(self):
        for r in list(self.reqs):
            self.finish_req(r, insert=True)
        self.tree.reset()
        assert self.alloc.num_free == self.num_pages, "a full page leaked"
        assert self.wp.num_free == self.num_window, "a window page leaked"


class WindowTreeMachinePage4(WindowTreeMachine):
    page_size = 4
    num_pages = 24
    num_window = 16
    span = 9
    max_len = 40


def test_valid_length():
    w = np.array([5, -1, 7, 8, 9], dtype=np.int32)
    assert valid_length(w, 2, 1) == 5  # [3, 5) present
    assert valid_length(w, 4, 1) == 1  # L=5 needs [1, 5): page 1 missing; L=1 needs [0, 1)
    assert valid_length(np.array([-1, 3], dtype=np.int32), 1, 1) == 2
    assert valid_length(np.array([-1, -1], dtype=np.int32), 1, 1) == 0
    assert valid_length(np.array([-1, 3, 4], dtype=np.int32), 5, 4) == 12  # [7, 12): pages 1, 2


_settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestWindowTreePage1 = WindowTreeMachine.TestCase
TestWindowTreePage1.settings = _settings
TestWindowTreePage4 = WindowTreeMachinePage4.TestCase
TestWindowTreePage4.settings = _settings

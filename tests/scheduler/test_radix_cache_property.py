"""The radix tree against a brute-force model under random request lifecycles.

The model is a dict holding every cached page-aligned prefix: (salt, tokens)
-> the page id of its last page. Requests drive the tree the way the
scheduler does: match the prompt minus its last token, lock, allocate their own
pages (evicting when short), insert early ("cache early") and at finish, keep
duplicate pages until they finish, free them and the partial tail page, unlock.
After every step the tree must hold exactly the model's prefixes with the same
pages, pass ``check()``, and conserve pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCache, RadixCacheError, RadixNode

SALTS = st.sampled_from([None, None, "a", "b"])


@dataclass(eq=False)
class Req:
    tokens: np.ndarray
    salt: str | None
    node: RadixNode  # locked
    locked_len: int  # tokens whose pages the tree owns (or that are held duplicates)
    table: np.ndarray  # the request's page table
    dups: list[np.ndarray] = field(default_factory=list)

    def held(self, ps: int) -> list[np.ndarray]:
        return [*self.dups, self.table[self.locked_len // ps :]]


def tree_contents(tree: RadixCache) -> dict:
    """Every page-aligned prefix in the tree -> its last page."""
    ps = tree.page_size
    out = {}
    for salt, root in tree._roots.items():
        stack = [(c, ()) for c in root.children.values()]
        while stack:
            node, prefix = stack.pop()
            for i in range(len(node.pages)):
                out[(salt, prefix + tuple(node.key[: (i + 1) * ps].tolist()))] = int(node.pages[i])
            full = prefix + tuple(node.key.tolist())
            stack.extend((c, full) for c in node.children.values())
    return out


class TreeMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 40
    max_len = 24

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.alloc = PageAllocator(self.num_pages, ps)
        self.tree = RadixCache(self.alloc, ps)
        self.model: dict[tuple, int] = {}
        self.reqs: list[Req] = []

    # ------------------------------------------------------------- model side
    def model_match(self, tokens: np.ndarray, salt) -> tuple[int, list[int]]:
        ps = self.page_size
        pages = []
        k = ps
        while k <= len(tokens) and (salt, tuple(tokens[:k].tolist())) in self.model:
            pages.append(self.model[(salt, tuple(tokens[:k].tolist()))])
            k += ps
        return len(pages) * ps, pages

    def locked_tree_pages(self) -> set[int]:
        """The tree's pages on the paths that running requests lock."""
        out: set[int] = set()
        for r in self.reqs:
            out.update(self.model_match(r.tokens[: r.locked_len], r.salt)[1])
        return out

    def gen_tokens(self, data) -> np.ndarray:
        keys = list(self.model)
        base: tuple = ()
        if keys and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(sorted(keys, key=repr)))[1]
        tail = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=self.max_len))
        return np.array((list(base) + tail)[: self.max_len + 4], dtype=np.int32)

    def alloc_or_evict(self, n: int):
        ids = self.alloc.alloc(n)
        if ids is None:
            self.tree.evict(n - self.alloc.num_free)
            self.adopt_tree_after_eviction()
            ids = self.alloc.alloc(n)
        return ids

    def adopt_tree_after_eviction(self) -> None:
        contents = tree_contents(self.tree)
        for key, page in contents.items():
            assert self.model.get(key) == page, "eviction changed a surviving prefix"
        self.model = contents

    def insert(self, req: Req, length: int) -> None:
        ps = self.page_size
        full = length - length % ps
        tokens = req.tokens[:full]
        expect_cached, _ = self.model_match(tokens, req.salt)
        cached_len, node = self.tree.insert(tokens, req.table[: full // ps], salt=req.salt)
        assert cached_len == expect_cached
        assert cached_len >= req.locked_len  # the locked path is still there
        for k in range(cached_len + ps, full + 1, ps):
            self.model[(req.salt, tuple(tokens[:k].tolist()))] = int(req.table[k // ps - 1])
        if cached_len > req.locked_len:
            req.dups.append(req.table[req.locked_len // ps : cached_len // ps])
        if full > req.locked_len:
            req.locked_len = full
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node = node

    # ------------------------------------------------------------------ rules
    @rule(data=st.data(), salt=SALTS)
    def start_request(self, data, salt):
        ps = self.page_size
        tokens = self.gen_tokens(data)
        expect_hit, expect_pages = self.model_match(tokens[:-1], salt)
        m = self.tree.match_prefix(tokens[:-1], salt=salt)
        assert m.hit_len == expect_hit
        assert m.pages.tolist() == expect_pages
        self.tree.lock(m.last_node)
        need = -(-len(tokens) // ps) - m.hit_len // ps
        own = self.alloc_or_evict(need)
        if own is None:
            self.tree.unlock(m.last_node)
            return
        table = np.concatenate([m.pages, own]).astype(np.int32)
        self.reqs.append(Req(tokens, salt, m.last_node, m.hit_len, table))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cache_early(self, data):
        req = data.draw(st.sampled_from(self.reqs))
        self.insert(req, len(req.tokens))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def decode(self, data):
        """The request grows by a few tokens (allocating pages as it crosses them)."""
        ps = self.page_size
        req = data.draw(st.sampled_from(self.reqs))
        extra = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=6))
        tokens = np.concatenate([req.tokens, np.array(extra, dtype=np.int32)])
        need = -(-len(tokens) // ps) - len(req.table)
        new = self.alloc_or_evict(need)
        if new is None:
            return
        req.tokens = tokens
        req.table = np.concatenate([req.table, new]).astype(np.int32)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), early=st.booleans())
    def finish(self, data, early):
        req = data.draw(st.sampled_from(self.reqs))
        self.reqs.remove(req)
        if not early:  # an aborted request may not have cached anything more
            self.insert(req, len(req.tokens))
        for pages in req.held(self.page_size):
            self.alloc.free(pages)
        self.tree.unlock(req.node)

    @rule(data=st.data(), salt=SALTS)
    def match_only(self, data, salt):
        tokens = self.gen_tokens(data)
        expect_hit, expect_pages = self.model_match(tokens, salt)
        assert self.tree.peek_prefix(tokens, salt=salt) == expect_hit
        m = self.tree.match_prefix(tokens, salt=salt)
        assert (m.hit_len, m.pages.tolist()) == (expect_hit, expect_pages)

    @rule(n=st.integers(0, 20))
    def evict(self, n):
        ps = self.page_size
        before = set(self.tree.all_pages().tolist())
        locked = self.locked_tree_pages()
        evictable = self.tree.evictable_pages
        freed = self.tree.evict(n)
        after = set(self.tree.all_pages().tolist())
        gone = before - after
        assert len(gone) == freed and after <= before
        assert not (gone & locked), "a locked page was evicted"
        assert freed >= min(n, evictable)
        assert self.alloc.is_allocated(list(gone)).sum() == 0 if gone else True
        self.adopt_tree_after_eviction()
        for salt, prefix in self.model:  # what remains is prefix-closed
            if len(prefix) > ps:
                assert (salt, prefix[:-ps]) in self.model

    @rule()
    def reset(self):
        if self.tree.protected_pages:
            with pytest.raises(RadixCacheError):
                self.tree.reset()
        else:
            self.tree.reset()
            self.model.clear()

    # ------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        self.tree.check()
        assert tree_contents(self.tree) == self.model
        held = sum(len(p) for r in self.reqs for p in r.held(self.page_size))
        assert self.alloc.num_free + self.tree.cached_pages + held == self.num_pages
        assert self.tree.protected_pages == len(self.locked_tree_pages())


class TreeMachinePage4(TreeMachine):
    page_size = 4
    num_pages = 24
    max_len = 40


class TreeMachinePage16(TreeMachine):
    page_size = 16
    num_pages = 12
    max_len = 70


_settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestTreePage1 = TreeMachine.TestCase
TestTreePage1.settings = _settings
TestTreePage4 = TreeMachinePage4.TestCase
TestTreePage4.settings = _settings
TestTreePage16 = TreeMachinePage16.TestCase
TestTreePage16.settings = _settings

"""The radix tree of hybrid models (the core with ``StateSnapshots``): snapshots under
random operations.

Each snapshot id is saved, in the test, for one token prefix (its owner). Random
inserts (with and without snapshots, splitting edges), matches, locks, evictions
and snapshot allocations under a small pool run at page sizes 1 and 2 with two
salts; after each operation every snapshot the tree holds sits at the end of
exactly its owner's prefix, a match hits the longest prefix that ends at a
snapshot (found by brute force over every prefix of the query), the snapshot it
returns is that prefix's, and no snapshot or page is lost or held twice.
"""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.radix_impl import make_prefix_cache
from radixserve.scheduler.state_cache import StateSnapshots


def state_tree(alloc: PageAllocator, num_states: int) -> tuple[RadixCache, StateSnapshots]:
    tree = RadixCache(alloc, alloc.page_size, components=[StateSnapshots(num_states)])
    return tree, tree.components["state"]  # type: ignore[return-value]


def _paths(st: StateSnapshots) -> dict[tuple, int]:
    """(salt, full token prefix) -> snapshot, for every node holding one."""
    out = {}
    for node, state in st.by_node.items():
        parts, n = [], node
        while not n.is_root:
            parts.append(n.key)
            n = n.parent
        out[(n.salt, tuple(np.concatenate(parts[::-1]).tolist()))] = state
    return out


@pytest.mark.parametrize("page_size", [1, 2])
def test_snapshots_under_random_operations(page_size):
    rng = np.random.default_rng(page_size)
    alloc = PageAllocator(40, page_size)
    tree, st = state_tree(alloc, 6)
    owner: dict[int, tuple] = {}  # snapshot -> the (salt, prefix) it was saved for
    locks: list = []
    for _ in range(2500):
        op = rng.integers(6)
        salt = [None, "t"][rng.integers(2)]
        tokens = rng.integers(0, 3, rng.integers(0, 13)).tolist()
        end = len(tokens) - len(tokens) % page_size
        if op <= 1:  # insert, with a snapshot at its end half the time
            pages = alloc.alloc(end // page_size)
            if pages is None:
                tree.evict(end // page_size)
                pages = alloc.alloc(end // page_size)
            if pages is None:
                continue
            state = st.alloc_state() if op == 0 and end else None
            if state is not None:
                owner[state] = (salt, tuple(tokens[:end]))
            cached, _ = tree.insert(tokens, pages, salt, state=-1 if state is None else state)
            alloc.free(pages[: cached // page_size])
        elif op == 2:  # match: the deepest snapshot prefix, by brute force
            paths = _paths(st)
            want = max(
                (n for n in range(0, end + 1, page_size) if (salt, tuple(tokens[:n])) in paths),
                default=0,
            )
            assert tree.peek_prefix(tokens, salt) == want
            m = tree.match_prefix(tokens, salt)
            assert m.hit_len == want
            if want:
                assert owner[st.state_of(m.last_node)] == (salt, tuple(tokens[:want]))
                tree.lock(m.last_node)
                locks.append(m.last_node)
        elif op == 3 and locks:
            tree.unlock(locks.pop(rng.integers(len(locks))))
        elif op == 4:
            tree.evict(int(rng.integers(1, 6)))
        else:  # a request takes a snapshot and gives it back unused
            state = st.alloc_state()
            if state is not None:
                owner.pop(state, None)
                st.free_state(state)
        for key, state in _paths(st).items():
            assert owner[state] == key, "a snapshot sits at another prefix than its own"
        locked = {s for n, s in st.by_node.items() if n.lock_ref}
        assert locked <= set(st.by_node.values())
        tree.check()
        assert st.free_states + st.cached_states == st.num_states
        assert alloc.num_free + tree.cached_pages == alloc.num_pages
    for node in locks:
        tree.unlock(node)
    tree.reset()
    assert st.free_states == st.num_states and alloc.num_free == alloc.num_pages


def test_locked_snapshots_are_never_dropped():
    alloc = PageAllocator(16, 1)
    tree, st = state_tree(alloc, 2)
    for tokens in ([1, 2], [3, 4]):
        state = st.alloc_state()
        tree.insert(tokens, alloc.alloc(2), None, state=state)
    m = tree.match_prefix([1, 2, 9])
    assert m.hit_len == 2
    tree.lock(m.last_node)
    kept = st.state_of(m.last_node)
    assert st.alloc_state() is not None and st.dropped == 1  # [3, 4]'s went
    assert st.alloc_state() is None  # the only one left is locked
    assert st.state_of(m.last_node) == kept
    tree.unlock(m.last_node)


def test_hybrid_models_take_the_python_tree():
    alloc = PageAllocator(8, 1)
    tree = make_prefix_cache(alloc, "radix", "auto", num_states=4)
    assert isinstance(tree, RadixCache) and tree.components["state"].num_states == 4
    with pytest.raises(ValueError, match="native radix tree keeps no recurrent-state"):
        make_prefix_cache(alloc, "radix", "native", num_states=4)


def test_plan_states_saves_the_divergence_and_the_chunk_end():
    """A prompt's last chunk holding both where waiting requests part from it and its
    own last boundary before its last token saves both (the divergence point first
    when only one snapshot is free); one point when they coincide."""
    from radixserve.sampling_params import SamplingParams
    from radixserve.scheduler.kv_cache import KVCacheManager
    from radixserve.scheduler.request import ReqStatus, Request

    def prompt_at(kv_len: int, diverge_at: int) -> Request:
        # 45 tokens, page size 4: the last chunk [32, 45) ends its pages at 44.
        req = Request.create("r", 0, np.arange(4, 49, dtype=np.int32), SamplingParams(),
                             None, 0, 64, 16)  # fmt: skip
        req.status, req.kv_len = ReqStatus.PREFILL, kv_len
        req.cache_state.diverge_at = diverge_at
        return req

    alloc = PageAllocator(64, 4)
    tree, _ = state_tree(alloc, 3)
    kv = KVCacheManager(alloc, tree, components=tree.components)
    req = prompt_at(32, 40)
    restore, at1, s1, at2, s2 = kv.plan_states(req, 13)
    assert (restore, at1, at2) == (-1, 8, 12) and s1 >= 0 and s2 >= 0 and s1 != s2
    assert req.cache_state.own_states_at == [40, 44] and req.cache_state.own_states == [s1, s2]
    other = prompt_at(32, 44)
    assert kv.plan_states(other, 13)[1:] == (12, other.cache_state.own_states[0], 0, -1)
    # One snapshot left free (the other two are held): the divergence point has it.
    kv.states.free_state(s1)
    third = prompt_at(32, 40)
    assert kv.plan_states(third, 13)[1:] == (8, third.cache_state.own_states[0], 0, -1)
    assert third.cache_state.own_states_at == [40]

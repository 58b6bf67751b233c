"""Eviction policies of the Python radix tree against a brute-force choice.

Random match / insert / lock / unlock / retain / evict operations run on a tree
with each policy and a fake clock; at every victim the pages freed must be those
of the evictable leaf with the smallest key, computed from scratch over every
leaf: ``(last_access,)`` for lru, ``(hits, last_access)`` for lfu, and
``(level if the hint is still running else 0, last_access)`` for priority, with
the creation order breaking ties. The tree's own check runs after each step.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.radix_impl import make_radix_cache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def brute_key(tree: RadixCache, node) -> tuple:
    if tree.policy == "lru":
        key: tuple = (node.last_access,)
    elif tree.policy == "lfu":
        key = (node.hits, node.last_access)
    else:
        level = node.retention if node.retain_until > tree.clock() else 0
        key = (level, node.last_access)
    return (*key, node.node_id)


def brute_victim(tree: RadixCache):
    leaves = [n for n in tree._iter_nodes() if n.lock_ref == 0 and not n.children]
    return min(leaves, key=lambda n: brute_key(tree, n)) if leaves else None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["lru", "lfu", "priority"]),
    seed=st.integers(0, 2**32 - 1),
    page_size=st.sampled_from([1, 2]),
)
def test_every_victim_is_the_brute_force_minimum(policy, seed, page_size):
    rng = np.random.default_rng(seed)
    alloc = PageAllocator(256, page_size)
    clock = Clock()
    tree = RadixCache(alloc, page_size, policy, clock, max_retained_pages=40)
    templates = [rng.integers(0, 6, 24).astype(np.int32) for _ in range(3)]
    locked: list = []
    for _ in range(80):
        op = rng.random()
        clock.now += float(rng.random())
        t = templates[int(rng.integers(3))]
        tokens = np.concatenate([t[: int(rng.integers(1, 24))], rng.integers(0, 6, 4)])
        tokens = tokens[: len(tokens) - len(tokens) % page_size].astype(np.int32)
        if op < 0.45 and len(tokens):
            m = tree.match_prefix(tokens)
            need = len(tokens) // page_size - len(m.pages)
            if need > alloc.num_free:
                tree.evict(need - alloc.num_free)
            if need > alloc.num_free:
                continue
            own = alloc.alloc(need) if need else np.zeros(0, np.int32)
            cached, node = tree.insert(tokens, np.concatenate([m.pages, own]).astype(np.int32))
            dup = own[: max(0, cached // page_size - len(m.pages))]
            if len(dup):
                alloc.free(dup)
            if rng.random() < 0.3:
                tree.lock(node)
                locked.append(node)
            if policy == "priority" and rng.random() < 0.4:
                tree.retain(node, int(rng.integers(1, 4)), float(rng.random() * 5))
        elif op < 0.6 and locked:
            tree.unlock(locked.pop(int(rng.integers(len(locked)))))
        elif op < 0.7:
            tree.match_prefix(tokens)
        else:
            for _ in range(int(rng.integers(1, 4))):
                want = brute_victim(tree)
                if want is None:
                    break
                pages = set(want.pages.tolist())
                before = set(tree.all_pages().tolist())
                tree.evict(1)
                gone = before - set(tree.all_pages().tolist())
                assert gone == pages, f"{policy}: evicted {gone}, the minimum was {pages}"
        tree.check()
        held: dict = {}
        for n in tree._iter_nodes():
            if n.retention and n.retain_until > clock.now:
                salt = tree._salt_of(n)
                held[salt] = held.get(salt, 0) + len(n.pages)
        assert held == tree.retained
        assert all(v <= tree.max_retained_pages for v in held.values())


def test_a_tenant_cannot_retain_more_than_its_share():
    alloc = PageAllocator(64, 1)
    tree = RadixCache(alloc, 1, "priority", Clock(), max_retained_pages=12)
    _, a = tree.insert(np.arange(10, 20, dtype=np.int32), alloc.alloc(10), salt="t")
    assert tree.retain(a, 9, 5.0) and tree.retained == {"t": 10}
    _, b = tree.insert(np.arange(30, 35, dtype=np.int32), alloc.alloc(5), salt="t")
    assert not tree.retain(b, 9, 5.0)  # 15 > 12: not applied
    assert b.retention == 0 and tree.retained == {"t": 10}
    _, c = tree.insert(np.arange(30, 35, dtype=np.int32), alloc.alloc(5), salt="u")
    assert tree.retain(c, 9, 5.0) and tree.retained == {"t": 10, "u": 5}  # per tenant


def test_a_retained_prefix_outlives_others_until_its_hint_expires():
    alloc = PageAllocator(64, 1)
    clock = Clock()
    tree = RadixCache(alloc, 1, "priority", clock)
    kept = np.arange(10, 20, dtype=np.int32)
    _, node = tree.insert(kept, alloc.alloc(10))
    tree.retain(node, 50, 10.0)
    clock.now = 1.0
    _, other = tree.insert(np.arange(30, 40, dtype=np.int32), alloc.alloc(10))
    tree.evict(5)  # the newer, unretained prefix goes first, LRU notwithstanding
    assert tree.peek_prefix(kept) == 10 and tree.cached_pages == 10
    clock.now = 11.0  # the hint expired: the kept prefix is an ordinary old leaf now
    tree.insert(np.arange(40, 45, dtype=np.int32), alloc.alloc(5))
    tree.evict(5)
    assert tree.peek_prefix(kept) == 0 and tree.cached_pages == 5


def test_lfu_keeps_the_most_used_prefix():
    alloc = PageAllocator(64, 1)
    tree = RadixCache(alloc, 1, "lfu")
    hot = np.arange(10, 20, dtype=np.int32)
    tree.insert(hot, alloc.alloc(10))
    for _ in range(3):
        tree.match_prefix(hot)
    tree.insert(np.arange(30, 40, dtype=np.int32), alloc.alloc(10))  # newer, used once
    tree.evict(10)
    assert tree.peek_prefix(hot) == 10


def test_the_native_tree_is_lru_only():
    alloc = PageAllocator(8, 1)
    assert isinstance(make_radix_cache(alloc, 1, "auto", "lfu"), RadixCache)
    with pytest.raises(ValueError, match="LRU only"):
        make_radix_cache(alloc, 1, "native", "priority")

"""Unit tests of the radix tree: the seed's examples, eviction order, locks, errors.

Tests taking the ``impl`` fixture run on every built implementation (the
native tree too); the others look at the Python tree's nodes directly.
"""

import numpy as np
import pytest

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCacheError
from radixserve.scheduler.radix_impl import available_impls, make_radix_cache

A, B, C, D, E, X, Y = range(1, 8)


@pytest.fixture(params=available_impls())
def impl(request):
    return request.param


def make(impl="python", num_pages=64, page_size=1):
    alloc = PageAllocator(num_pages, page_size)
    return alloc, make_radix_cache(alloc, page_size, impl=impl)


def clock(tree):
    return tree._clock if hasattr(tree, "_clock") else tree.clock


def put(tree, alloc, tokens, salt=None):
    """Insert ``tokens`` with fresh pages, freeing duplicates like a request would."""
    pages = alloc.alloc(len(tokens) // tree.page_size)
    cached_len, node = tree.insert(tokens, pages, salt=salt)
    alloc.free(pages[: cached_len // tree.page_size])
    return node


def test_seed_split_example():
    alloc, tree = make()
    put(tree, alloc, [A, B, C, D, E])
    p1 = tree.match_prefix([A, B, C, D, E]).pages
    cached_len, leaf = tree.insert([A, B, C, X, Y], alloc.alloc(5))
    assert cached_len == 3
    root = tree._roots[None]
    (abc,) = root.children.values()
    assert abc.key.tolist() == [A, B, C]
    assert sorted(c.key.tolist() for c in abc.children.values()) == [[D, E], [X, Y]]
    assert leaf.key.tolist() == [X, Y] and leaf.parent is abc
    # [A B C] and its KV exist once: both paths share its pages.
    assert tree.match_prefix([A, B, C, X, Y]).pages[:3].tolist() == p1[:3].tolist()
    tree.check()


def test_split_keeps_existing_node_deeper_and_copies_lock(impl):
    alloc, tree = make(impl)
    node = put(tree, alloc, [A, B, C, D, E])
    tree.lock(node)
    m = tree.match_prefix([A, B, C, Y])  # ends inside the locked edge: split
    assert m.hit_len == 3
    prefix = m.last_node
    assert prefix != node
    if impl == "python":
        assert node.parent is prefix and node.key.tolist() == [D, E]
        assert prefix.lock_ref == 1  # inherited: the locked pages stay protected
    else:
        assert tree.node_info(prefix)[1] == 1 and tree.node_info(node)[3] == 2
    assert tree.protected_pages == 5 and tree.evictable_pages == 0
    assert tree.evict(100) == 0
    tree.unlock(node)  # the old handle is still valid
    assert tree.evictable_pages == 5
    tree.check()


def test_match_returns_longest_prefix_and_pages(impl):
    alloc, tree = make(impl)
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 5])
    m = tree.match_prefix([1, 2, 3, 9])
    assert m.hit_len == 3
    assert m.pages.tolist() == tree.match_prefix([1, 2, 3, 4]).pages[:3].tolist()
    assert tree.match_prefix([9]).hit_len == 0
    assert tree.match_prefix([]).hit_len == 0
    assert tree.peek_prefix(np.array([1, 2, 5, 7], dtype=np.int32)) == 3
    tree.check()


def test_peek_changes_nothing(impl):
    alloc, tree = make(impl)
    put(tree, alloc, [1, 2, 3, 4])
    nodes = tree.num_nodes
    before = clock(tree)
    assert tree.peek_prefix([1, 2, 9]) == 2
    assert tree.num_nodes == nodes and clock(tree) == before


def test_eviction_is_lru_and_parent_becomes_candidate(impl):
    alloc, tree = make(impl)
    put(tree, alloc, [1, 2, 3])  # creates [1 2 3]
    put(tree, alloc, [1, 2, 4])  # splits: [1 2] -> {[3], [4]}
    put(tree, alloc, [5, 6])
    tree.match_prefix([1, 2, 3])  # [1 2 3] is now the most recent
    # Order: [4] (oldest leaf), then [5 6], then [3], then [1 2] (childless by then).
    assert tree.evict(1) == 1
    assert tree.peek_prefix([1, 2, 4]) == 2 and tree.peek_prefix([5, 6]) == 2
    assert tree.evict(1) == 2  # a whole node: [5 6]
    assert tree.peek_prefix([5, 6]) == 0 and tree.peek_prefix([1, 2, 3]) == 3
    assert tree.evict(2) == 3  # [3], then [1 2] which became a leaf
    assert tree.cached_pages == 0 and alloc.num_free == alloc.num_pages
    tree.check()


def test_locked_path_survives_eviction(impl):
    alloc, tree = make(impl)
    keep = put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 7, 8])
    put(tree, alloc, [9, 9])
    tree.lock(keep)
    assert tree.protected_pages == 4
    freed = tree.evict(100)
    assert freed == 4  # [7 8] and [9 9]; the locked path [1 2]+[3 4] stays
    assert tree.peek_prefix([1, 2, 3, 4]) == 4
    tree.check()
    tree.unlock(keep)
    assert tree.evict(100) == 4
    tree.check()


def test_page_size_gt_1_whole_pages_only(impl):
    alloc, tree = make(impl, page_size=4)
    toks = list(range(10))  # 2 whole pages + 2 tokens
    pages = alloc.alloc(2)
    cached_len, node = tree.insert(toks, pages)
    assert cached_len == 0 and tree.peek_prefix(toks) == 8
    assert tree.match_prefix(list(range(9))).hit_len == 8
    assert tree.match_prefix(list(range(7))).hit_len == 4  # split at the page boundary
    assert tree.match_prefix([0, 1, 2, 3, 4, 5, 9, 9]).hit_len == 4  # diverges mid-page
    assert tree.match_prefix([0, 1, 2]).hit_len == 0
    tree.check()
    with pytest.raises(ValueError, match="page ids"):
        tree.insert(list(range(8)), alloc.alloc(1))


def test_salts_never_share_nodes_and_lru_is_global(impl):
    alloc, tree = make(impl)
    put(tree, alloc, [1, 2, 3], salt="a")
    assert tree.match_prefix([1, 2, 3]).hit_len == 0
    assert tree.match_prefix([1, 2, 3], salt="b").hit_len == 0
    assert tree.match_prefix([1, 2, 3], salt="a").hit_len == 3
    put(tree, alloc, [1, 2, 3])
    assert tree.cached_pages == 6
    tree.match_prefix([1, 2, 3], salt="a")  # salt "a" is now newer than the default one
    assert tree.evict(1) == 3
    assert tree.peek_prefix([1, 2, 3]) == 0 and tree.peek_prefix([1, 2, 3], salt="a") == 3
    tree.check()


def test_insert_returns_cached_len_and_existing_node(impl):
    alloc, tree = make(impl)
    node = put(tree, alloc, [1, 2, 3])
    pages = alloc.alloc(3)
    cached_len, same = tree.insert([1, 2, 3], pages)
    assert cached_len == 3 and same == node
    alloc.free(pages)
    cached_len, deeper = tree.insert([1, 2, 3, 4], np.concatenate([pages[:0], alloc.alloc(4)]))
    assert cached_len == 3 and deeper != node
    if impl == "python":
        assert deeper.parent is node
    tree.check()


def test_errors(impl):
    alloc, tree = make(impl)
    node = put(tree, alloc, [1, 2])
    with pytest.raises(RadixCacheError, match="below zero"):
        tree.unlock(node)
    tree.lock(node)
    with pytest.raises(RadixCacheError, match="locks"):
        tree.reset()
    tree.unlock(node)
    tree.evict(10)
    with pytest.raises(RadixCacheError, match="no longer in the tree"):
        tree.lock(node)
    with pytest.raises(ValueError):
        tree.match_prefix([[1, 2]])
    with pytest.raises(TypeError):
        tree.match_prefix([1], salt=3)
    with pytest.raises(ValueError):
        make_radix_cache(PageAllocator(4, 2), page_size=1, impl=impl)


def test_reset_frees_everything(impl):
    alloc, tree = make(impl)
    put(tree, alloc, [1, 2, 3])
    put(tree, alloc, [4, 5], salt="s")
    tree.reset()
    assert tree.cached_pages == 0 and alloc.num_free == alloc.num_pages
    assert tree.match_prefix([1, 2, 3]).hit_len == 0
    tree.check()


def test_check_detects_corruption():
    alloc, tree = make()
    node = put(tree, alloc, [1, 2, 3])
    node.lock_ref = 1  # a lock the counters do not know about
    with pytest.raises(AssertionError, match="evictable"):
        tree.check()
    node.lock_ref = 0
    alloc.free(node.pages[:1])  # the tree now holds a free page
    with pytest.raises(AssertionError, match="free page"):
        tree.check()


def test_bad_salt_raises_everywhere_before_the_clock_ticks(impl):
    alloc, tree = make(impl)
    before = clock(tree)
    for call in (
        lambda: tree.match_prefix([1], salt=3),
        lambda: tree.peek_prefix([1], salt=b"a"),
        lambda: tree.insert([1], alloc.alloc(1), salt=3),
    ):
        with pytest.raises(TypeError, match="salt"):
            call()
    assert clock(tree) == before


def test_reset_returns_pages_in_ascending_order(impl):
    alloc, tree = make(impl, num_pages=8)
    put(tree, alloc, [5, 6])  # pages 0, 1
    put(tree, alloc, [1, 2, 3])  # pages 2, 3, 4; a child inserted later
    tree.reset()
    # The free stack's top is the last id freed: ascending frees come back
    # 4, 3, 2, 1, 0 (then the never-used 5, 6, 7), whatever order the tree
    # visited its nodes in (children order would give 1, 0, 4, 3, 2).
    assert alloc.alloc(8).tolist() == [4, 3, 2, 1, 0, 5, 6, 7]

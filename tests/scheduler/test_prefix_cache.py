"""The prefix cache contract: every cache satisfies it; the no-cache keeps nothing."""

import numpy as np
import pytest

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.prefix_cache import CacheNode, NoCache, PrefixCache
from radixserve.scheduler.radix_impl import available_impls, make_prefix_cache


@pytest.mark.parametrize("impl", [*available_impls(), "none"])
def test_every_cache_satisfies_the_contract(impl):
    alloc = PageAllocator(16, 2)
    cache = (
        make_prefix_cache(alloc, "none")
        if impl == "none"
        else make_prefix_cache(alloc, "radix", impl)
    )
    assert isinstance(cache, PrefixCache)
    assert cache.keeps_prefixes == (impl != "none")
    assert cache.page_size == 2
    pages = alloc.alloc(2)
    cached_len, node = cache.insert([5, 6, 7, 8, 9], pages)
    assert isinstance(node, CacheNode) and isinstance(node.node_id, int)
    m = cache.match_prefix([5, 6, 7, 8, 9])
    assert isinstance(m.last_node, CacheNode)
    cache.lock(m.last_node)
    cache.unlock(m.last_node)
    cache.check()


def test_no_cache_keeps_nothing():
    alloc = PageAllocator(16, 4)
    cache = NoCache(alloc)
    pages = alloc.alloc(2)
    tokens = np.arange(10, dtype=np.int32)
    # The whole pages count as cached already: the caller keeps (and later frees) them all.
    cached_len, node = cache.insert(tokens, pages)
    assert cached_len == 8 and node is cache.root
    m = cache.match_prefix(tokens)
    assert m.hit_len == 0 and len(m.pages) == 0 and m.last_node is cache.root
    assert cache.peek_prefix(tokens) == 0
    assert cache.cached_pages == cache.evictable_pages == cache.protected_pages == 0
    assert cache.evict(8) == 0 and alloc.num_free == 14
    with pytest.raises(ValueError):
        cache.insert(tokens, pages[:1])


def test_unknown_cache_mode():
    with pytest.raises(ValueError, match="unknown cache"):
        make_prefix_cache(PageAllocator(8), "lru")

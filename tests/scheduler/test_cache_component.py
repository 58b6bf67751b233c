"""The radix core's component hooks (``radix_cache.py``'s ``CacheComponent``), with a component of
the test's own: entries keyed by node, as a next kind of cached entry would be."""

from __future__ import annotations

import pytest

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import CacheComponent, RadixCache


class Tags(CacheComponent):
    """A tag per node, given at insert; serves a match only up to ``limit`` tokens."""

    name = "tag"

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.by_node: dict = {}
        self.splits: list[int] = []
        self.freed: list[str] = []

    def serve(self, path, hit):
        return min(hit, self.limit)

    def inserted(self, node, num_pages, entry):
        if entry is not None:
            self.by_node[node] = entry

    def split(self, prefix, child, pages):
        self.splits.append(pages)
        if child in self.by_node:
            self.by_node[prefix] = self.by_node[child] + "-head"

    def removed(self, node):
        self.freed.append(self.by_node.pop(node, "-"))

    def reset(self):
        self.freed += self.by_node.values()
        self.by_node.clear()

    def check(self, nodes):
        assert set(self.by_node) <= set(nodes), "a tag on a lost node"


def test_hooks_see_match_insert_split_evict_and_reset():
    alloc = PageAllocator(32, 2)
    tags = Tags(limit=4)
    tree = RadixCache(alloc, 2, components=[tags])
    assert tree.components == {"tag": tags} and tags.tree is tree
    cached, node = tree.insert(list(range(8)), alloc.alloc(4), tag="a")
    assert cached == 0 and tags.by_node == {node: "a"}
    # The hit is the minimum of the plain match and what the component serves.
    assert tree.kv_prefix(list(range(9))) == 8
    assert tree.peek_prefix(list(range(9))) == 4
    m = tree.match_prefix(list(range(9)))
    assert m.hit_len == 4 and len(m.pages) == 2
    assert tags.splits == [2] and tags.by_node[m.last_node] == "a-head"  # split at 4 tokens
    tree.check()
    tree.evict(1)  # the leaf [4, 8) goes: the component frees its tag
    assert tags.freed == ["a"]
    tree.reset()
    assert tags.freed == ["a", "a-head"] and not tags.by_node
    assert alloc.num_free == alloc.num_pages


def test_entries_go_by_name_and_no_two_components_share_one():
    alloc = PageAllocator(8, 1)
    with pytest.raises(ValueError, match="two 'tag' components"):
        RadixCache(alloc, 1, components=[Tags(1), Tags(2)])
    plain = RadixCache(alloc, 1)
    with pytest.raises(ValueError, match="which no component of this tree keeps"):
        plain.insert([1, 2], [0, 1], tag="x")
    assert plain.cached_pages == 0  # refused before anything changed

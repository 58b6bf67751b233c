"""A read-only view of the radix tree's shape, for explain and the dashboard.

Both trees give their shape through ``export_nodes`` (``radix_cache.py`` and its
native twin, array for array): nodes breadth first, so every parent comes before
its children, levels are contiguous and ``parent`` never decreases. ``TreeView``
adds what both readers need from it, computed with numpy over whole levels
rather than node by node: each node's children (a contiguous range), its depth
in tokens, and the tokens and cached sequences (leaves) below it.

``core_tree(cache)`` finds the radix tree under the wrappers a cache may have
(cache tiers, the KV event recorder: ``PageFollower.inner``); None for a cache
that keeps nothing (``--cache none``).
"""

from __future__ import annotations

import numpy as np

from radixserve.scheduler.prefix_cache import PrefixCache


def core_tree(cache: PrefixCache) -> PrefixCache | None:
    """The radix tree itself (what has ``export_nodes``) under ``cache``'s wrappers."""
    while not hasattr(cache, "export_nodes"):
        inner = getattr(cache, "inner", None)
        if inner is None:
            return None
        cache = inner
    return cache


class TreeView:
    """``export_nodes``'s arrays with children, depths and subtree sizes."""

    def __init__(self, export: dict) -> None:
        self.salts: list[str | None] = export["salts"]
        self.parent: np.ndarray = export["parent"]
        self.namespace: np.ndarray = export["namespace"]
        self.node_id: np.ndarray = export["node_id"]
        self.last_access: np.ndarray = export["last_access"]
        self.lock_ref: np.ndarray = export["lock_ref"]
        self.num_tokens: np.ndarray = export["num_tokens"]
        self.labels: np.ndarray = export["labels"]
        self.offsets: np.ndarray = export["label_offsets"]
        n = len(self.parent)
        self.size = n
        # Children of i: [first_child[i], first_child[i] + num_children[i]).
        idx = np.arange(n)
        self.first_child = np.searchsorted(self.parent, idx, side="left")
        self.num_children = np.searchsorted(self.parent, idx, side="right") - self.first_child
        # Levels: level 0 hangs under the roots; level k + 1 is the run of nodes whose
        # parents are in level k.
        bounds = [0, int(np.searchsorted(self.parent, 0, side="left"))]
        while bounds[-1] < n:
            bounds.append(int(np.searchsorted(self.parent, bounds[-1], side="left")))
        self.levels = list(zip(bounds[:-1], bounds[1:]))
        # Depth: tokens above each node's edge; subtree: tokens in and below it;
        # leaves: the cached sequences that end in or below it.
        self.depth = np.zeros(n, dtype=np.int64)
        for lo, hi in self.levels[1:]:
            p = self.parent[lo:hi]
            self.depth[lo:hi] = self.depth[p] + self.num_tokens[p]
        self.subtree = self.num_tokens.astype(np.int64).copy()
        self.leaves = (self.num_children == 0).astype(np.int64)
        for lo, hi in reversed(self.levels[1:]):
            p = self.parent[lo:hi]
            np.add.at(self.subtree, p, self.subtree[lo:hi])
            np.add.at(self.leaves, p, self.leaves[lo:hi])

    def label(self, i: int) -> np.ndarray:
        """The exported tokens of node ``i``'s edge (its first ``max_label``)."""
        return self.labels[self.offsets[i] : self.offsets[i + 1]]

    def children(self, i: int) -> range:
        """Node indices under node ``i`` (-1: the top of namespace ``ns`` is
        ``top(ns)``)."""
        first = int(self.first_child[i])
        return range(first, first + int(self.num_children[i]))

    def top(self, ns: int) -> list[int]:
        """The nodes hanging under namespace ``ns``'s root."""
        lo, hi = self.levels[0] if self.levels else (0, 0)
        return [i for i in range(lo, hi) if self.namespace[i] == ns]

"""Sliding-window pages on the radix core's nodes: the ``SlidingWindows`` component.

A model mixing full and sliding attention keeps two kinds of K/V per token: the full
layers' (a page of the main pool, as every model) and the sliding layers' (a *window
page*, ``window_pages.py``). A sliding layer's query at position p reads keys in
(p - w, p] only, so the window pages of old tokens are of no use to the request that
wrote them, and of use to a later request only at a point where it diverges from
this sequence. ``SlidingWindows`` is the component (``radix_cache.py``'s ``CacheComponent``) that
gives the core's nodes, page by page, the window page of those tokens, or -1 where
the tree dropped it.

The invariant (W: the largest sliding window, in tokens): **a match of length L
is valid only if the full pages cover [0, L) and the window pages cover
[max(0, L - W), L)**, in whole pages: every page that holds a token of that range
has its window page in the tree.

Contract, beyond ``RadixCache``'s (``windows = tree.components["window"]``):

* ``match_prefix`` / ``peek_prefix`` end at the longest valid length (whole pages,
  at most the plain match: ``serve``); ``windows.window_pages(last_node)`` is the
  window pages of the match's path (-1 where dropped), the caller takes its own
  references on those it needs (``WindowPages.ref``). ``kv_prefix`` is the plain
  longest match.
* ``insert(tokens, pages, salt, window=...)`` takes ``window`` (the caller's window
  pages, aligned with ``pages``; -1 where the caller has none): the tree takes a
  reference of its own on each it keeps, at new nodes and where an existing node
  had dropped its own (so a path whose window pages were dropped is filled again by
  the next request that computes it). The caller keeps its references.
* ``windows.evict_window(n)`` frees at least ``n`` window pages if it can, least
  recently used node first (``last_access``, then the older node; a heap with lazy
  entries, O(log n) per node): an unlocked leaf is evicted whole (its full
  pages are no use without its window), any other node drops its window pages
  and stays (a tombstone: its full pages still serve longer matches whose window
  lies past it). Locks do not cover window pages: a running request holds its
  own references on what its window needs. ``evict`` (whole nodes) drops the window
  pages of what it removes.

Only the Python core takes components: a model with sliding layers in a window pool
runs it (``--radix-impl auto``; ``combinations.py`` refuses the native tree).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from radixserve.scheduler.radix_cache import CacheComponent
from radixserve.scheduler.window_pages import WindowPages

if TYPE_CHECKING:
    from radixserve.scheduler.radix_cache import RadixCache, RadixNode

_NONE = np.zeros(0, dtype=np.int32)


def valid_length(window: np.ndarray, span: int, page_size: int) -> int:
    """The longest L (tokens, whole pages, at most ``len(window) * page_size``) whose
    window pages [max(0, L - span), L) are all present in ``window`` (-1: absent)."""
    n = len(window)
    if n == 0:
        return 0
    idx = np.where(window < 0, np.arange(n), -1)
    last_missing = np.maximum.accumulate(idx)  # [i]: the last absent page <= i
    ends = np.arange(1, n + 1)  # L in pages
    first = np.maximum(ends * page_size - span, 0) // page_size  # first page needed
    ok = np.flatnonzero(last_missing < first)
    return int(ends[ok[-1]]) * page_size if len(ok) else 0


class SlidingWindows(CacheComponent):
    """Window pages on the core's nodes (module docstring)."""

    name = "window"

    def __init__(self, window_pages: WindowPages, span: int) -> None:
        if span < 1:
            raise ValueError(f"a window cache needs a window of at least one token, got {span}")
        self.window = window_pages
        self.span = span  # W: the largest sliding window, in tokens
        self.by_node: dict[RadixNode, np.ndarray] = {}  # node -> window pages (-1: dropped)
        self.dropped = 0  # window pages whose node stayed (tombstoned pages)
        # Nodes holding window pages, by (last_access, node_id) as of when pushed: every
        # such node has an entry whose key is at most its current one, so a popped entry
        # whose key is still current is the least recently used (stale ones go back in).
        self._heap: list[tuple[int, int, RadixNode]] = []

    def bind(self, tree: RadixCache) -> None:
        if self.window.allocator.page_size != tree.page_size:
            raise ValueError("the window pages' page size differs from the pool's")
        super().bind(tree)

    def _push(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.node_id, node))
        if len(self._heap) > 2 * len(self.by_node) + 64:
            self._heap = [
                (n.last_access, n.node_id, n) for n, w in self.by_node.items() if (w >= 0).any()
            ]
            heapq.heapify(self._heap)

    @property
    def cached_pages(self) -> int:
        """Window pages the tree holds."""
        return int(sum(np.count_nonzero(w >= 0) for w in self.by_node.values()))

    # ------------------------------------------------------------------ match
    def serve(self, path: list[tuple[RadixNode, int]], hit: int) -> int:
        """The longest valid length along the plain match (module docstring)."""
        ps = self.tree.page_size
        parts = [self.by_node[node][: c // ps] for node, c in path]
        return valid_length(np.concatenate(parts) if parts else _NONE, self.span, ps)

    def window_pages(self, node: RadixNode) -> np.ndarray:
        """The window pages of the path from the root to ``node`` (-1: dropped)."""
        parts = []
        while not node.is_root:
            parts.append(self.by_node[node])
            node = node.parent  # type: ignore[assignment]
        return np.concatenate(parts[::-1]) if parts else _NONE

    # ----------------------------------------------------------------- insert
    def inserted(self, node: RadixNode, num_pages: int, entry: object) -> None:
        """The tree takes its own reference on the window pages ``entry`` it keeps
        (module docstring); without ``entry`` new nodes get none."""
        n = num_pages
        window = np.full(n, -1, dtype=np.int32) if entry is None else entry
        window = np.asarray(window, dtype=np.int32)
        if len(window) != n:
            raise ValueError(f"insert needs {n} window page ids, got {len(window)}")
        end = n
        while not node.is_root:
            k = len(node.pages)
            mine = window[end - k : end]
            have = self.by_node.get(node)
            if have is None:
                have = self.by_node[node] = np.full(k, -1, dtype=np.int32)
            fill = (have < 0) & (mine >= 0)
            if fill.any():
                self.window.hold(mine[fill])
                have[fill] = mine[fill]
                self._push(node)
            end -= k
            node = node.parent  # type: ignore[assignment]

    def split(self, prefix: RadixNode, child: RadixNode, pages: int) -> None:
        win = self.by_node.get(child)
        if win is not None:
            self.by_node[prefix] = win[:pages]
            self.by_node[child] = win[pages:]
            if (win[:pages] >= 0).any():
                self._push(prefix)

    # --------------------------------------------------------------- eviction
    def evict_window(self, num_pages: int) -> int:
        """Free at least ``num_pages`` window pages if possible, LRU node first: an
        unlocked leaf whole, any other node's window pages only. Returns how many
        window pages were freed."""
        freed = 0
        heap = self._heap
        tree = self.tree
        while freed < num_pages and heap:
            key, nid, node = heapq.heappop(heap)
            win = self.by_node.get(node)
            if win is None or not (win >= 0).any():
                continue  # gone, or its window pages dropped already
            if key != node.last_access:
                heapq.heappush(heap, (node.last_access, nid, node))  # used since: later
                continue
            if tree.is_evictable_leaf(node):
                before = self.window.num_free
                tree.evict_node(node)
                freed += self.window.num_free - before
            else:
                self.dropped += int(np.count_nonzero(win >= 0))
                freed += self.window.drop(win)
                win[:] = -1
        return freed

    def removed(self, node: RadixNode) -> None:
        win = self.by_node.pop(node, None)
        if win is not None:
            self.window.drop(win)

    # ---------------------------------------------------------------- checks
    def reset(self) -> None:
        for win in self.by_node.values():
            self.window.drop(win)
        self.by_node.clear()
        self._heap = []

    def check(self, nodes: list[RadixNode]) -> None:
        assert set(nodes) == set(self.by_node), "a node without window pages, or a lost one"
        held = []
        for node in nodes:
            win = self.by_node[node]
            assert len(win) == len(node.pages), "window pages misaligned with a node's pages"
            held.append(win[win >= 0])
        held_ids = np.concatenate(held) if held else _NONE
        assert len(np.unique(held_ids)) == len(held_ids), "a window page held twice"
        assert self.window.held[held_ids].all(), "a window page the pool thinks is not held"
        assert np.count_nonzero(self.window.held) == len(held_ids), "a held page not in the tree"
        self.window.check()

"""The radix tree of a model with sliding-window layers: full pages plus window pages.

A model mixing full and sliding attention keeps two kinds of K/V per token: the full
layers' (a page of the main pool, as every model) and the sliding layers' (a *window
page*, ``window_pages.py``). A sliding layer's query at position p reads keys in
(p - w, p] only, so the window pages of old tokens are of no use to the request that
wrote them, and of use to a later request only at a point where it diverges from
this sequence. ``WindowRadixCache`` is the Python ``RadixCache`` whose nodes also
carry, page by page, the window page of those tokens, or -1 where the tree dropped it.

The invariant (W: the largest sliding window, in tokens): **a match of length L
is valid only if the full pages cover [0, L) and the window pages cover
[max(0, L - W), L)**, in whole pages: every page that holds a token of that range
has its window page in the tree.

Contract, beyond ``RadixCache``'s:

* ``match_prefix`` / ``peek_prefix`` end at the longest valid length (whole pages,
  at most the plain match); ``window_pages(last_node)`` is the window pages of the
  match's path (-1 where dropped), the caller takes its own references on those
  it needs (``WindowPages.ref``). ``kv_prefix`` is the plain longest match.
* ``insert(tokens, pages, salt, window)`` takes ``window`` (the caller's window
  pages, aligned with ``pages``; -1 where the caller has none): the tree takes a
  reference of its own on each it keeps, at new nodes and where an existing node
  had dropped its own (so a path whose window pages were dropped is filled again by
  the next request that computes it). The caller keeps its references.
* ``evict_window(n)`` frees at least ``n`` window pages if it can, least recently
  used node first (``last_access``, then the older node; a heap with lazy entries,
  O(log n) per node): an unlocked leaf is evicted whole (its full
  pages are no use without its window), any other node drops its window pages
  and stays (a tombstone: its full pages still serve longer matches whose window
  lies past it). Locks do not cover window pages: a running request holds its
  own references on what its window needs. ``evict`` (whole nodes) drops the window
  pages of what it removes.

Only this Python tree keeps window pages: models with sliding layers select it
(``--radix-impl auto``), and the native tree is refused for them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.prefix_cache import MatchResult
from radixserve.scheduler.radix_cache import RadixCache, RadixNode, as_tokens
from radixserve.scheduler.window_pages import WindowPages

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


class WindowRadixCache(RadixCache):
    """``RadixCache`` with window pages on its nodes (module docstring)."""

    def __init__(
        self, allocator: PageAllocator, window_pages: WindowPages, span: int, **kwargs
    ) -> None:
        super().__init__(allocator, allocator.page_size, **kwargs)
        if span < 1:
            raise ValueError(f"a window cache needs a window of at least one token, got {span}")
        if window_pages.allocator.page_size != allocator.page_size:
            raise ValueError("the window pages' page size differs from the pool's")
        self.window = window_pages
        self.span = span  # W: the largest sliding window, in tokens
        self._win: dict[RadixNode, np.ndarray] = {}  # node -> its window pages (-1: dropped)
        self.window_dropped = 0  # window pages whose node stayed (tombstoned pages)
        # Nodes holding window pages, by (last_access, node_id) as of when pushed: every
        # such node has an entry whose key is at most its current one, so a popped entry
        # whose key is still current is the least recently used (stale ones go back in).
        self._wheap: list[tuple[int, int, RadixNode]] = []

    def _wpush(self, node: RadixNode) -> None:
        heapq.heappush(self._wheap, (node.last_access, node.node_id, node))
        if len(self._wheap) > 2 * len(self._win) + 64:
            self._wheap = [
                (n.last_access, n.node_id, n) for n, w in self._win.items() if (w >= 0).any()
            ]
            heapq.heapify(self._wheap)

    @property
    def window_cached_pages(self) -> int:
        """Window pages the tree holds."""
        return int(sum(np.count_nonzero(w >= 0) for w in self._win.values()))

    # ------------------------------------------------------------------ match
    def _path_window(self, tokens: np.ndarray, salt: str | None) -> np.ndarray:
        """The window pages along the plain longest match of ``tokens`` (whole pages)."""
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        node = self._roots.get(salt)
        pos = 0
        parts = []
        while node is not None and pos < end:
            child = node.children.get(self._key_at(tokens, pos))
            if child is None:
                break
            c = _common(child.key, tokens, pos, end, ps)
            if c == 0:
                break
            parts.append(self._win[child][: c // ps])
            pos += c
            if c < len(child.key):
                break
            node = child
        return np.concatenate(parts) if parts else _NONE

    def _valid(self, tokens: np.ndarray, salt: str | None) -> int:
        return valid_length(self._path_window(tokens, salt), self.span, self.page_size)

    def match_prefix(
        self, tokens: np.ndarray | Sequence[int], salt: str | None = None
    ) -> MatchResult:
        """The longest valid prefix (module docstring); splits and stamps like the tree's."""
        tokens = as_tokens(tokens)
        self._check_salt(salt)
        return super().match_prefix(tokens[: self._valid(tokens, salt)], salt)

    def peek_prefix(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> int:
        tokens = as_tokens(tokens)
        self._check_salt(salt)
        return self._valid(tokens, salt)

    def kv_prefix(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> int:
        """The plain longest cached prefix (full pages), windows or not; changes nothing."""
        return super().peek_prefix(tokens, salt)

    def window_pages(self, node: RadixNode) -> np.ndarray:
        """The window pages of the path from the root to ``node`` (-1: dropped)."""
        parts = []
        while not node.is_root:
            parts.append(self._win[node])
            node = node.parent  # type: ignore[assignment]
        return np.concatenate(parts[::-1]) if parts else _NONE

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: np.ndarray | Sequence[int],
        pages: np.ndarray | Sequence[int],
        salt: str | None = None,
        window: np.ndarray | None = None,
    ) -> tuple[int, RadixNode]:
        """``RadixCache.insert``; the tree takes its own reference on the window pages
        ``window`` it keeps (module docstring). Without ``window`` new nodes get none."""
        cached_len, node = super().insert(tokens, pages, salt)
        ps = self.page_size
        n = len(tokens) // ps
        if window is None:
            window = np.full(n, -1, dtype=np.int32)
        window = np.asarray(window, dtype=np.int32)
        if len(window) != n:
            raise ValueError(f"insert needs {n} window page ids, got {len(window)}")
        end, last = n, node
        while not node.is_root:
            k = len(node.pages)
            mine = window[end - k : end]
            have = self._win.get(node)
            if have is None:
                have = self._win[node] = np.full(k, -1, dtype=np.int32)
            fill = (have < 0) & (mine >= 0)
            if fill.any():
                self.window.hold(mine[fill])
                have[fill] = mine[fill]
                self._wpush(node)
            end -= k
            node = node.parent  # type: ignore[assignment]
        return cached_len, last

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        prefix = super()._split(child, at)
        win = self._win.get(child)
        if win is not None:
            k = at // self.page_size
            self._win[prefix] = win[:k]
            self._win[child] = win[k:]
            if (win[:k] >= 0).any():
                self._wpush(prefix)
        return prefix

    # --------------------------------------------------------------- eviction
    def evict_window(self, num_pages: int) -> int:
        """Free at least ``num_pages`` window pages if possible, LRU node first: an
        unlocked leaf whole, any other node's window pages only. Returns how many
        window pages were freed."""
        freed = 0
        heap = self._wheap
        while freed < num_pages and heap:
            key, nid, node = heapq.heappop(heap)
            win = self._win.get(node)
            if win is None or not (win >= 0).any():
                continue  # gone, or its window pages dropped already
            if key != node.last_access:
                heapq.heappush(heap, (node.last_access, nid, node))  # used since: later
                continue
            if self._is_candidate(node):
                before = self.window.num_free
                self._evict_node(node)
                freed += self.window.num_free - before
            else:
                self.window_dropped += int(np.count_nonzero(win >= 0))
                freed += self.window.drop(win)
                win[:] = -1
        return freed

    def _evict_node(self, node: RadixNode) -> None:
        """Remove one unlocked leaf now (its full pages and its window pages)."""
        parent = node.parent
        assert parent is not None and self._is_candidate(node)
        if node.counted:
            self._uncount(node, self._salt_of(node))
        del parent.children[node.first_key]
        node.parent = None
        self._removed(node)
        self._num_nodes -= 1
        self._evictable -= len(node.pages)
        self.allocator.free(node.pages)
        if not parent.children and not parent.is_root and parent.lock_ref == 0:
            self._push_candidate(parent)
        elif not parent.children and parent.is_root and parent.salt is not None:
            del self._roots[parent.salt]

    def _removed(self, node: RadixNode) -> None:
        win = self._win.pop(node, None)
        if win is not None:
            self.window.drop(win)

    # ---------------------------------------------------------------- checks
    def reset(self) -> None:
        wins = list(self._win.values())
        super().reset()
        for win in wins:
            self.window.drop(win)
        self._win.clear()
        self._wheap = []

    def check(self) -> None:
        super().check()
        nodes = list(self._iter_nodes())
        assert set(nodes) == set(self._win), "a node without window pages, or a lost one"
        held = []
        for node in nodes:
            win = self._win[node]
            assert len(win) == len(node.pages), "window pages misaligned with a node's pages"
            held.append(win[win >= 0])
        held_ids = np.concatenate(held) if held else _NONE
        assert len(np.unique(held_ids)) == len(held_ids), "a window page held twice"
        assert self.window.held[held_ids].all(), "a window page the pool thinks is not held"
        assert np.count_nonzero(self.window.held) == len(held_ids), "a held page not in the tree"
        self.window.check()


def _common(key: np.ndarray, tokens: np.ndarray, pos: int, end: int, ps: int) -> int:
    n = min(len(key), end - pos)
    neq = key[:n] != tokens[pos : pos + n]
    c = int(neq.argmax()) if neq.any() else n
    return c - c % ps

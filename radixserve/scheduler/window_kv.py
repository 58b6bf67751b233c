"""The running requests' window pages (models whose sliding layers have a window pool).

``RequestWindows`` is ``KVCacheManager``'s part for window pages (``window_pages.py``;
docs/models.md, "Sliding windows and the cache"). A request holds one reference on
each window page its window needs, in ``req.cache_state.win`` (``w`` below; aligned
with its page table, -1 where it holds none; entries below ``w.win_low`` are -1,
entries from ``w.win_len`` on are not decided yet, the first ``w.win_sent`` went to
the worker):

* at admission, those of its match's last W tokens (``hold_match``: references on the
  tree's window pages);
* then the pages each step writes: a decoding request's with its other pages
  (``grow_decodes``: short of window pages, the caller retracts as for pages), a
  prefill chunk's when it is scheduled (``grow``: short, the request waits);
* before each, the pages wholly before ``kv_len - W`` are let go (``_slide``);
* after a verification the pages past the kept ones (``trim``); at release all
  (``release``), after the tree took its own references at insert (``of``).

So a request holds about W + its chunk of window pages, however long it runs.
``plan`` hands the worker the window table entries it lacks (a copy: an abort
between planning and the step's run resets the request's).
"""

from __future__ import annotations

import numpy as np

from radixserve.scheduler.cache_state import RequestCacheState
from radixserve.scheduler.prefix_cache import MatchResult
from radixserve.scheduler.request import Request
from radixserve.scheduler.window_cache import SlidingWindows
from radixserve.scheduler.window_pages import WindowPages


class RequestWindows:
    """The running requests' references on window pages (module docstring)."""

    def __init__(self, pages: WindowPages, span: int, tree: SlidingWindows | None) -> None:
        self.pages = pages
        self.span = span  # W: the largest sliding window, in tokens
        self.page_size = pages.allocator.page_size
        # The tree's window pages (None: ``--cache none`` keeps none).
        self.tree = tree
        self.evicted = 0  # window pages the tree freed to make room

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def _room(w: RequestCacheState, n: int) -> np.ndarray:
        """A request's window pages, grown (with -1) to hold ``n`` entries."""
        if n > len(w.win):
            grown = np.full(max(n, 2 * len(w.win)), -1, dtype=np.int32)
            grown[: len(w.win)] = w.win
            w.win = grown
        return w.win

    def of(self, req: Request, n: int) -> np.ndarray:
        """The request's first ``n`` window page entries (what an insert offers)."""
        return self._room(req.cache_state, n)[:n]

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` fresh window pages, the tree dropping its least recently used ones
        if needed; None if impossible."""
        ids = self.pages.alloc(n)
        if ids is None and self.tree is not None:
            self.evicted += self.tree.evict_window(n - self.pages.num_free)
            ids = self.pages.alloc(n)
        return ids

    def hold_match(self, req: Request, m: MatchResult) -> None:
        """The request's window starts with its match's: references on the tree's
        window pages of [hit - W, hit)."""
        w = req.cache_state
        n = len(m.pages)
        win = self._room(w, n)
        win[:n] = -1
        first = max(m.hit_len - self.span, 0) // self.page_size
        if self.tree is not None and n:
            win[first:n] = self.tree.window_pages(m.last_node)[first:n]  # type: ignore[arg-type]
        self.pages.ref(win[first:n])
        w.win_low, w.win_len, w.win_sent = first, n, 0

    def release(self, req: Request) -> None:
        """Let go of every window page the request holds."""
        w = req.cache_state
        self.pages.unref(w.win[w.win_low : w.win_len].copy())
        w.win[: w.win_len] = -1
        w.win_low = w.win_len = w.win_sent = 0

    def _slide(self, req: Request) -> None:
        """Let go of the request's window pages wholly before ``kv_len - W``."""
        w = req.cache_state
        drop = min(max(req.kv_len - self.span, 0) // self.page_size, w.win_len)
        if drop > w.win_low:
            self.pages.unref(w.win[w.win_low : drop].copy())
            w.win[w.win_low : drop] = -1
            w.win_low = drop

    def _extend(self, req: Request, ids: np.ndarray) -> None:
        w = req.cache_state
        n = w.win_len + len(ids)
        self._room(w, n)[w.win_len : n] = ids
        w.win_len = n

    def grow_decodes(self, reqs: list[Request]) -> bool:
        """Window pages for the decoding requests' next step, in one allocation;
        False when short (what left their windows stays let go: harmless)."""
        needy = []
        for r in reqs:
            self._slide(r)
            n = self._pages_for(r.num_tokens + len(r.spec.draft)) - r.cache_state.win_len
            if n > 0:
                needy.append((r, n))
        if not needy:
            return True
        ids = self.alloc(sum(n for _, n in needy))
        if ids is None:
            return False
        # If the pages are short after all, these stay the request's references and
        # go with the rest at retraction.
        at = 0
        for r, n in needy:
            self._extend(r, ids[at : at + n])
            at += n
        return True

    def grow(self, req: Request, n: int) -> bool:
        """Window pages for ``req``'s next ``n`` tokens; False, taking none, when
        short even after the tree dropped what it could."""
        w = req.cache_state
        self._slide(req)
        need = self._pages_for(req.kv_len + n) - w.win_len
        if need <= 0:
            return True
        ids = self.alloc(need)
        if ids is None:
            return False
        self._extend(req, ids)
        return True

    def plan(self, req: Request, n: int) -> tuple[int, np.ndarray]:
        """The window table entries the worker lacks for ``req``'s next step of ``n``
        tokens, ``(first entry, page ids)``. Its pages have their window pages already
        (``grow_decodes``, ``grow``); a path that did not take them takes them here,
        and fails the step when it cannot."""
        w = req.cache_state
        if not self.grow(req, n):
            raise RuntimeError(
                f"the window pool ({self.pages.num_pages} pages) cannot hold the windows "
                "of the running requests; give it more pages (--sliding-pool-pages)"
            )
        start = max(w.win_sent, w.win_low)
        w.win_sent = w.win_len
        return start, w.win[start : w.win_len].copy()

    def trim(self, req: Request, keep: int) -> None:
        """After a verification: let go of the window pages past the first ``keep``."""
        w = req.cache_state
        if w.win_len <= keep:
            return
        lo = max(keep, w.win_low)
        self.pages.unref(w.win[lo : w.win_len].copy())
        w.win[keep : w.win_len] = -1
        w.win_len = keep
        w.win_low = min(w.win_low, keep)
        w.win_sent = min(w.win_sent, keep)

    def check_idle(self) -> None:
        """At idle every window page is free or held by the tree alone."""
        w = self.pages
        w.check()
        held = int(np.count_nonzero(w.held))
        assert w.num_free + held == w.num_pages, (
            f"window page leak: {w.num_pages - w.num_free - held} pages"
        )
        assert (w.refs[w.held] == 1).all(), "a request's window reference survived it"

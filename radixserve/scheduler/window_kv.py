"""The running requests' window pages (models whose sliding layers have a window pool).

``RequestWindows`` is ``KVCacheManager``'s part for window pages (``window_pages.py``;
docs/models.md, "Sliding windows and the cache"). A request holds one reference on
each window page its window needs, in ``req.win`` (aligned with its page table, -1
where it holds none; entries below ``req.win_low`` are -1, entries from
``req.win_len`` on are not decided yet, the first ``req.win_sent`` went to the worker):

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

from radixserve.scheduler.prefix_cache import MatchResult, PrefixCache
from radixserve.scheduler.request import Request
from radixserve.scheduler.window_cache import WindowRadixCache
from radixserve.scheduler.window_pages import WindowPages


class RequestWindows:
    """The running requests' references on window pages (module docstring)."""

    def __init__(self, pages: WindowPages, span: int, cache: PrefixCache) -> None:
        self.pages = pages
        self.span = span  # W: the largest sliding window, in tokens
        self.page_size = pages.allocator.page_size
        # The tree, when the cache keeps window pages (None: ``--cache none``).
        self.tree = cache if isinstance(cache, WindowRadixCache) else None
        self.evicted = 0  # window pages the tree freed to make room

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @staticmethod
    def _room(req: Request, n: int) -> np.ndarray:
        """The request's window pages, grown (with -1) to hold ``n`` entries."""
        if n > len(req.win):
            grown = np.full(max(n, 2 * len(req.win)), -1, dtype=np.int32)
            grown[: len(req.win)] = req.win
            req.win = grown
        return req.win

    def of(self, req: Request, n: int) -> np.ndarray:
        """The request's first ``n`` window page entries (what an insert offers)."""
        return self._room(req, n)[:n]

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
        n = len(m.pages)
        win = self._room(req, n)
        win[:n] = -1
        first = max(m.hit_len - self.span, 0) // self.page_size
        if self.tree is not None and n:
            win[first:n] = self.tree.window_pages(m.last_node)[first:n]  # type: ignore[arg-type]
        self.pages.ref(win[first:n])
        req.win_low, req.win_len, req.win_sent = first, n, 0

    def release(self, req: Request) -> None:
        """Let go of every window page the request holds."""
        self.pages.unref(req.win[req.win_low : req.win_len].copy())
        req.win[: req.win_len] = -1
        req.win_low = req.win_len = req.win_sent = 0

    def _slide(self, req: Request) -> None:
        """Let go of the request's window pages wholly before ``kv_len - W``."""
        drop = min(max(req.kv_len - self.span, 0) // self.page_size, req.win_len)
        if drop > req.win_low:
            self.pages.unref(req.win[req.win_low : drop].copy())
            req.win[req.win_low : drop] = -1
            req.win_low = drop

    def _extend(self, req: Request, ids: np.ndarray) -> None:
        n = req.win_len + len(ids)
        self._room(req, n)[req.win_len : n] = ids
        req.win_len = n

    def grow_decodes(self, reqs: list[Request]) -> bool:
        """Window pages for the decoding requests' next step, in one allocation;
        False when short (what left their windows stays let go: harmless)."""
        needy = []
        for r in reqs:
            self._slide(r)
            n = self._pages_for(r.num_tokens + len(r.draft)) - r.win_len
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
        self._slide(req)
        need = self._pages_for(req.kv_len + n) - req.win_len
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
        if not self.grow(req, n):
            raise RuntimeError(
                f"the window pool ({self.pages.num_pages} pages) cannot hold the windows "
                "of the running requests; give it more pages (--sliding-pool-pages)"
            )
        start = max(req.win_sent, req.win_low)
        req.win_sent = req.win_len
        return start, req.win[start : req.win_len].copy()

    def trim(self, req: Request, keep: int) -> None:
        """After a verification: let go of the window pages past the first ``keep``."""
        if req.win_len <= keep:
            return
        lo = max(keep, req.win_low)
        self.pages.unref(req.win[lo : req.win_len].copy())
        req.win[keep : req.win_len] = -1
        req.win_len = keep
        req.win_low = min(req.win_low, keep)
        req.win_sent = min(req.win_sent, keep)

    def check_idle(self) -> None:
        """At idle every window page is free or held by the tree alone."""
        w = self.pages
        w.check()
        held = int(np.count_nonzero(w.held))
        assert w.num_free + held == w.num_pages, (
            f"window page leak: {w.num_pages - w.num_free - held} pages"
        )
        assert (w.refs[w.held] == 1).all(), "a request's window reference survived it"

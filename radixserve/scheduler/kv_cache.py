"""Per-request KV bookkeeping over the page allocator and the prefix cache.

This is the one place that decides who owns which page, the only writer of
a request's page table (``req.table[:req.num_pages]``), and the one place that
counts pages (``pages_for``, ``pages_missing``):

- ``acquire_prefix`` matches a request's tokens (``req.match_len`` of them:
  all but the last one, fewer when prompt logprobs need their logits; whole
  pages) and locks the match: those pages belong to the cache and are now
  protected; they start the request's page table.
- ``alloc`` hands out fresh pages, evicting unlocked cache leaves when short;
  ``grow`` and ``grow_decodes`` append such pages to page tables.
- ``cache_computed`` ("cache early") inserts the request's computed whole pages
  into the cache and moves its lock to the new node. Pages the cache already
  held are duplicates: the request keeps them (the worker's page table still
  points at them) in ``req.dups`` until it releases its KV.
- ``release`` (finish, abort, retraction) caches what was computed, frees the
  duplicates and every page past the inserted length (the partial tail page
  and pages allocated for tokens never computed), and unlocks. The computed KV
  stays in the cache, unlocked, so a retry hits it.

The cache is a ``PrefixCache``: a radix tree, or with ``cache="none"`` the
``NoCache``, whose inserts leave every page with the request (as duplicates),
so release frees the whole page table (plain PagedAttention), or a
``TieredCache`` (a tree with host and disk tiers below it, docs/cache-tiers.md):
``promote`` extends an admitted request's match with pages copied up from the
lower tiers, its evictions demote pages, and the copies that takes are handed to
the next step (``take_copies``, ``step_done``, ``copies_done``). A request whose
matched pages are still on their way (``loading``) must not compute yet.

A hybrid model's cache is a ``StateRadixCache`` (``state_cache.py``): a match
ends where the tree holds a recurrent-state snapshot, which the request's first
step restores, and ``plan_states`` picks where each step saves the request's
state into a snapshot of its own (``own_state``), which ``cache_computed``
hands to the tree with the pages ending there. The rule (docs/models.md):

- where the request's match stopped short of the cached KV (it diverges there
  from a cached sequence), or where a request held back for sharing this one's
  prefix diverges from it (``mark_divergence``): the next request there hits;
- otherwise at the last page boundary a step reaches: a prefill chunk's end (the
  prompt's last chunk: the last boundary before its last token, where the same
  prompt hits again), or during decode every page (page size 1: none, the state
  is saved at release);
- at release (finish, abort, retraction) when the computed length is a page
  boundary: the slot's state, copied before the slot is cleared
  (``take_state_saves``, ``Step.state_saves``).

A model with sliding layers keeps their K/V in window pages (``window_pages.py``,
``window`` here; ``span`` is W, the largest window), and its tree is a
``WindowRadixCache`` (``window_cache.py``): a match ends where the window pages of
[L - W, L) are cached. A request holds one reference on each window page its window
needs (``req.win``, aligned with its page table): those of its match's last W
tokens at admission (``acquire_prefix``), then the new pages each step writes, while the
pages wholly before ``kv_len - W`` are let go: a decoding request's with its other
pages (``grow_decodes``: short of window pages, it is retracted like one short of
pages), a prefill chunk's when it is scheduled (``grow_window``: short, the request
is not admitted, or the chunked one waits a step). ``plan_window`` then hands the
worker the entries it lacks. So a request holds about W + its chunk of window
pages, whatever its length. The
tree takes its own references at insert; release lets the request's go.
"""

from __future__ import annotations

import numpy as np

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.prefix_cache import MatchResult, PrefixCache
from radixserve.scheduler.request import ReqStatus, Request
from radixserve.scheduler.state_cache import StateRadixCache
from radixserve.scheduler.tiered_cache import TieredCache
from radixserve.scheduler.window_cache import WindowRadixCache
from radixserve.scheduler.window_pages import WindowPages

_NO_PAGES = np.zeros(0, dtype=np.int32)


class KVCacheManager:
    def __init__(
        self,
        allocator: PageAllocator,
        cache: PrefixCache,
        window: WindowPages | None = None,
        span: int = 0,
    ) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        # Sliding layers' window pages (None: the model has none, or one pool for all).
        self.window = window
        self.span = span
        self.wtree = cache if isinstance(cache, WindowRadixCache) else None
        self.window_evicted = 0  # window pages freed by eviction to make room
        # A hybrid model's tree, which keeps recurrent-state snapshots (None: not one).
        self.states = cache if isinstance(cache, StateRadixCache) else None
        self._state_saves: list[int] = []  # slot, snapshot pairs for the next step
        self._evicted = 0  # pages evicted to make room (not flushes)

    @property
    def tiers(self) -> TieredCache | None:
        """The tiered cache, when the tree has tiers below it."""
        return self.cache if isinstance(self.cache, TieredCache) else None

    @property
    def evicted_pages(self) -> int:
        """Pool pages evicted to make room since the start (for requests' pages and,
        with tiers, for promoted ones); a flush is not counted."""
        tiers = self.tiers
        return self._evicted + (tiers.promotion_evictions if tiers is not None else 0)

    @property
    def enabled(self) -> bool:
        """Whether cached prefixes can be hit (False with ``cache="none"``)."""
        return self.cache.keeps_prefixes

    @property
    def available_pages(self) -> int:
        """Pages that could be handed out now: free plus evictable."""
        return self.allocator.num_free + self.cache.evictable_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def pages_missing(self, req: Request, num_tokens: int) -> int:
        """Pages the request's table still lacks to cover ``num_tokens`` tokens."""
        return max(self.pages_for(num_tokens) - req.num_pages, 0)

    def peek(self, req: Request) -> int:
        """The request's cached prefix length, changing nothing."""
        return self.cache.peek_prefix(req.tokens[: req.match_len], req.salt)

    def acquire_prefix(self, req: Request) -> int:
        """Match and lock the request's cached prefix; it starts the page table."""
        assert req.num_pages == 0 and req.node is None
        m = self.cache.match_prefix(req.tokens[: req.match_len], req.salt)
        self.cache.lock(m.last_node)
        self._hold(req, m, (m.hit_len, 0, 0))
        if self.states is not None:
            req.restore_state = self.states.state_of(m.last_node) if m.hit_len else -1
            kv = self.states.kv_prefix(req.tokens[: req.match_len], req.salt)
            req.diverge_at = kv if kv > m.hit_len else 0
        return m.hit_len

    def _hold(self, req: Request, m: MatchResult, by_tier: tuple[int, int, int]) -> None:
        """The request holds match ``m`` (its node locked already): its page table
        starts with the matched pages, computed up to the hit."""
        req.node = m.last_node
        req.locked_len = req.kv_len = m.hit_len
        req.cached_by_tier = by_tier
        n = len(m.pages)
        req.table_room(n)[:n] = m.pages
        req.num_pages = n
        if self.window is not None:
            win = self._win_room(req, n)
            win[:n] = -1
            first = max(m.hit_len - self.span, 0) // self.page_size
            if self.wtree is not None and n:
                win[first:n] = self.wtree.window_pages(m.last_node)[first:n]
            self.window.ref(win[first:n])
            req.win_low, req.win_len, req.win_sent = first, n, 0

    def promote(self, req: Request) -> int:
        """With tiers: extend the request's locked match (``acquire_prefix``, no page
        of its own yet) with the pages the host and disk tiers hold after it; they
        arrive later (``loading``). Returns the new hit length."""
        tiers = self.tiers
        if tiers is None:
            return req.kv_len
        assert req.num_pages * self.page_size == req.locked_len == req.kv_len
        old = MatchResult(req.locked_len, req.table[: req.num_pages], req.node)  # type: ignore[arg-type]
        m = tiers.promote(req.tokens[: req.match_len], old, req.salt)
        if m.hit_len == req.locked_len:
            return req.kv_len
        self.cache.lock(m.last_node)
        self.cache.unlock(req.node)  # type: ignore[arg-type]
        self._hold(req, m, tiers.last_match_tiers)
        return m.hit_len

    def loading(self, req: Request) -> bool:
        """Whether some of the request's cached prefix is still being copied up."""
        tiers = self.tiers
        if tiers is None or not tiers.pages_loading:
            return False
        return tiers.loading(req.table[: req.locked_len // self.page_size])

    def release_prefix(self, req: Request) -> None:
        """Undo ``acquire_prefix`` for a request that was not admitted after all."""
        if req.node is not None:
            self.cache.unlock(req.node)
        self._win_release(req)
        req.node = None
        req.locked_len = req.kv_len = req.num_pages = 0
        req.restore_state, req.diverge_at = -1, 0

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` fresh pages, evicting LRU cache leaves if needed; None if impossible."""
        ids = self.allocator.alloc(n)
        if ids is None:
            self._evicted += self.cache.evict(n - self.allocator.num_free)
            ids = self.allocator.alloc(n)
        return ids

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Extend the request's table to cover ``num_tokens`` tokens with fresh
        pages; False, changing nothing, when they cannot be had."""
        n = self.pages_missing(req, num_tokens)
        ids = self.alloc(n)
        if ids is None:
            return False
        req.table_room(req.num_pages + n)[req.num_pages : req.num_pages + n] = ids
        req.num_pages += n
        return True

    def grow_decodes(self, reqs: list[Request]) -> bool:
        """Give every decoding request the pages its tokens still without KV need
        (one token's, or a grammar's forced tokens', and its drafts'), all in one
        allocation; False, changing nothing, when short. With a window pool their
        window pages too (first, so a short window pool also ends in a retraction):
        the pages out of each window go, and the new pages get window pages.
        """
        if self.window is not None and not self._grow_windows(reqs):
            return False
        needy = [(r, self.pages_for(r.num_tokens + len(r.draft)) - r.num_pages) for r in reqs]
        needy = [(r, n) for r, n in needy if n > 0]
        if not needy:
            return True
        ids = self.alloc(sum(n for _, n in needy))
        if ids is None:
            return False
        at = 0
        for req, n in needy:
            req.table_room(req.num_pages + n)[req.num_pages : req.num_pages + n] = ids[at : at + n]
            req.num_pages += n
            at += n
        return True

    def trim(self, req: Request) -> None:
        """After a verification: free the request's pages past its tokens with KV
        (those that held only rejected drafts' K/V); the worker is told to cut its
        table in the request's next step (``table_cut``)."""
        keep = max(self.pages_for(req.kv_len), req.locked_len // self.page_size)
        if keep >= req.num_pages:
            return
        self.allocator.free(req.table[keep : req.num_pages].copy())
        req.num_pages = keep
        if self.window is not None and req.win_len > keep:
            lo = max(keep, req.win_low)
            self.window.unref(req.win[lo : req.win_len].copy())
            req.win[keep : req.win_len] = -1
            req.win_len = keep
            req.win_low = min(req.win_low, keep)
            req.win_sent = min(req.win_sent, keep)
        if req.sent_pages > keep:
            req.sent_pages = keep
            req.table_cut = True

    def cache_computed(self, req: Request) -> None:
        """Insert the request's computed whole pages into the cache; move its lock.
        A hybrid model's request hands its snapshot over with the pages ending
        where it was saved (first, when that is short of the computed pages)."""
        ps = self.page_size
        full = req.kv_len - req.kv_len % ps
        if req.own_state >= 0 and req.locked_len < req.own_state_at <= full:
            state, req.own_state = req.own_state, -1
            self._insert(req, req.own_state_at, state)
        if full > req.locked_len:
            self._insert(req, full, -1)

    def _insert(self, req: Request, full: int, state: int) -> None:
        ps = self.page_size
        if state >= 0:
            assert self.states is not None
            cached_len, node = self.states.insert(
                req.tokens[:full], req.table[: full // ps], req.salt, state
            )
        elif self.wtree is not None:
            n = full // ps
            win = self._win_room(req, n)[:n]
            cached_len, node = self.wtree.insert(req.tokens[:full], req.table[:n], req.salt, win)
        else:
            cached_len, node = self.cache.insert(
                req.tokens[:full], req.table[: full // ps], req.salt
            )
        assert cached_len >= req.locked_len, "the locked prefix vanished from the cache"
        hint = req.sampling.cache_retention
        if hint is not None and (retain := getattr(self.cache, "retain", None)) is not None:
            retain(node, hint[0], hint[1])
        if cached_len > req.locked_len:
            req.dups.append(req.table[req.locked_len // ps : cached_len // ps].copy())
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node
        req.locked_len = full

    def release(self, req: Request) -> None:
        """Give up the request's KV: cache what was computed, free the rest."""
        if self.states is not None:
            self._save_at_release(req)
        self.cache_computed(req)
        if req.own_state >= 0:
            assert self.states is not None
            self.states.free_state(req.own_state)
        req.own_state, req.own_state_at, req.restore_state, req.diverge_at = -1, 0, -1, 0
        own = req.table[req.locked_len // self.page_size : req.num_pages]
        self.allocator.free(np.concatenate([*req.dups, own]) if req.dups else own)
        self.cache.unlock(req.node)
        self._win_release(req)
        req.node = None
        req.dups = []
        req.locked_len = req.kv_len = req.num_pages = req.sent_pages = 0
        req.table_cut = False  # the slot is released: the worker clears its table

    # ------------------------------------------------------ window pages
    @staticmethod
    def _win_room(req: Request, n: int) -> np.ndarray:
        """The request's window pages, grown (with -1) to hold ``n`` entries."""
        if n > len(req.win):
            grown = np.full(max(n, 2 * len(req.win)), -1, dtype=np.int32)
            grown[: len(req.win)] = req.win
            req.win = grown
        return req.win

    def _win_release(self, req: Request) -> None:
        """Let go of every window page the request holds."""
        if self.window is None:
            return
        self.window.unref(req.win[req.win_low : req.win_len].copy())
        req.win[: req.win_len] = -1
        req.win_low = req.win_len = req.win_sent = 0

    def alloc_window(self, n: int) -> np.ndarray | None:
        """``n`` fresh window pages, dropping the tree's least recently used ones
        if needed; None if impossible."""
        assert self.window is not None
        ids = self.window.alloc(n)
        if ids is None and self.wtree is not None:
            self.window_evicted += self.wtree.evict_window(n - self.window.num_free)
            ids = self.window.alloc(n)
        return ids

    def _slide(self, req: Request) -> None:
        """Let go of the request's window pages wholly before ``kv_len - W``."""
        assert self.window is not None
        drop = min(max(req.kv_len - self.span, 0) // self.page_size, req.win_len)
        if drop > req.win_low:
            self.window.unref(req.win[req.win_low : drop].copy())
            req.win[req.win_low : drop] = -1
            req.win_low = drop

    def _grow_windows(self, reqs: list[Request]) -> bool:
        """Window pages for the decoding requests' next step, in one allocation;
        False when short (what left their windows stays let go: harmless)."""
        assert self.window is not None
        needy = []
        for r in reqs:
            self._slide(r)
            n = self.pages_for(r.num_tokens + len(r.draft)) - r.win_len
            if n > 0:
                needy.append((r, n))
        if not needy:
            return True
        ids = self.alloc_window(sum(n for _, n in needy))
        if ids is None:
            return False
        # The full pages may still be short: hold these where the request can give
        # them back (its references, released by retraction like the rest).
        at = 0
        for r, n in needy:
            self._win_room(r, r.win_len + n)[r.win_len : r.win_len + n] = ids[at : at + n]
            r.win_len += n
            at += n
        return True

    def grow_window(self, req: Request, n: int) -> bool:
        """Window pages for ``req``'s next ``n`` tokens (a prefill chunk, when it is
        scheduled); False, taking none, when short even after the tree dropped what
        it could. True without a window pool."""
        if self.window is None:
            return True
        self._slide(req)
        need = self.pages_for(req.kv_len + n)
        if need <= req.win_len:
            return True
        ids = self.alloc_window(need - req.win_len)
        if ids is None:
            return False
        self._win_room(req, need)[req.win_len : need] = ids
        req.win_len = need
        return True

    def plan_window(self, req: Request, n: int) -> tuple[int, np.ndarray]:
        """Sliding layers: ``req``'s window for its next step of ``n`` tokens: the
        window table entries the worker does not have yet, ``(first entry, page
        ids)``. The pages the step writes have their window pages already
        (``grow_decodes``, ``grow_window``); a path that did not take them takes
        them here, and fails the step when it cannot."""
        if self.window is None:
            return 0, _NO_PAGES
        self._slide(req)
        need = self.pages_for(req.kv_len + n)
        if need > req.win_len:
            ids = self.alloc_window(need - req.win_len)
            if ids is None:
                raise RuntimeError(
                    f"the window pool ({self.window.num_pages} pages) cannot hold the "
                    "windows of the running requests; give it more pages "
                    "(--sliding-pool-pages)"
                )
            self._win_room(req, need)[req.win_len : need] = ids
            req.win_len = need
        start = max(req.win_sent, req.win_low)
        req.win_sent = req.win_len
        # A copy: an abort between planning and the step's run writes -1 into req.win.
        return start, req.win[start : req.win_len].copy()

    def check_window_idle(self) -> None:
        """At idle every window page is free or held by the tree alone."""
        w = self.window
        if w is None:
            return
        w.check()
        held = int(np.count_nonzero(w.held))
        assert w.num_free + held == w.num_pages, (
            f"window page leak: {w.num_pages - w.num_free - held} pages"
        )
        assert (w.refs[w.held] == 1).all(), "a request's window reference survived it"

    # ------------------------------------------------- recurrent states
    def plan_states(self, req: Request, n: int) -> tuple[int, int, int]:
        """A hybrid model's state work for ``req``'s next step of ``n`` tokens:
        ``(snapshot to restore or -1, tokens before the save or 0, snapshot to save
        into or -1)`` (the rule is in the module docstring)."""
        st = self.states
        if st is None:
            return -1, 0, -1
        restore, req.restore_state = req.restore_state, -1
        start, end, ps = req.kv_len, req.kv_len + n, self.page_size
        at = 0
        if start < req.diverge_at <= end:
            at = req.diverge_at
        elif not (ps == 1 and req.status is ReqStatus.DECODE):
            # A prompt's last chunk: where the same prompt sent again can hit (a
            # match leaves the last token to compute).
            last = end - 1 if req.status is ReqStatus.PREFILL and end == req.num_tokens else end
            if last - last % ps > start:
                at = last - last % ps
        if not at:
            return restore, 0, -1
        if req.own_state < 0:
            state = st.alloc_state()
            if state is None:  # every snapshot is on a running request's path
                return restore, 0, -1
            req.own_state = state
        req.own_state_at = at
        return restore, at - start, req.own_state

    def mark_divergence(self, req: Request, others: list[Request], shared: int) -> None:
        """``req`` waits for ``others`` (being prefilled) to cache the ``shared``
        tokens (whole pages) they have in common: the first of them that computes
        that point saves its state there, so ``req`` will hit it."""
        if self.states is None or shared <= 0:
            return
        for other in others:
            if (
                other.kv_len < shared <= other.num_tokens
                and not other.diverge_at
                and np.array_equal(other.tokens[:shared], req.tokens[:shared])
            ):
                other.diverge_at = shared
                return

    def _save_at_release(self, req: Request) -> None:
        """At a page boundary, the slot's state (all computed tokens) becomes the
        request's snapshot there: the worker copies it before clearing the slot."""
        assert self.states is not None
        at = req.kv_len
        if req.slot is None or at % self.page_size or at <= req.locked_len:
            return
        if req.own_state >= 0 and req.own_state_at == at:
            return  # saved there already
        if req.own_state < 0:
            state = self.states.alloc_state()
            if state is None:
                return
            req.own_state = state
        req.own_state_at = at
        self._state_saves += [req.slot, req.own_state]

    def take_state_saves(self) -> np.ndarray:
        """The ``slot, snapshot`` pairs the next step copies first (``Step.state_saves``)."""
        saves, self._state_saves = self._state_saves, []
        return np.asarray(saves, dtype=np.int32)

    def check_states_idle(self) -> None:
        """At idle every snapshot is free or held by the tree."""
        st = self.states
        if st is not None:
            assert st.free_states + st.cached_states == st.num_states, "a snapshot leaked"
            assert not self._state_saves, "state saves never sent"

    def held_pages(self, req: Request) -> int:
        """Pages the request holds outside the cache (own pages and duplicates)."""
        own = req.num_pages - req.locked_len // self.page_size
        return own + sum(len(d) for d in req.dups)

    def flush(self, keep_disk: bool = False) -> int:
        """Evict every unlocked page now; running requests keep theirs. With tiers,
        the host tier is emptied too, and the disk tier unless ``keep_disk``."""
        tiers = self.tiers
        if tiers is not None:
            return tiers.flush(keep_disk)
        return self.cache.evict(self.cache.evictable_pages)

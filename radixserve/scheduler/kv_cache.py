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

The cache is a ``PrefixCache`` put together by ``radix_impl.build_kv_cache``: a
radix tree (the core, with the components the model needs), or with
``cache="none"`` the ``NoCache``, whose inserts leave every page with the request
(as duplicates), so release frees the whole page table (plain PagedAttention);
``tiers`` (a ``TieredCache`` wrapping the tree, docs/cache-tiers.md) when there are
host and disk tiers below it: ``promote`` extends an admitted request's match with
pages copied up from the lower tiers, its evictions demote pages, and the copies
that takes are handed to the next step (``take_copies``, ``step_done``,
``copies_done``). With a shared KV store, ``fetch_from_store`` asks it for the
pages after an admitted request's match, read into the request's own pages; what
arrived counts as computed (``take_store_hit``), and a request let go meanwhile
leaves the pages being filled to the tiers until they are done (``release``). A
request whose matched pages are still on their way (``loading``) must not compute
yet. Every insert goes through one call, with each component's part of it
(``_insert``). ``evictions`` (``explain.py``'s ``EvictionLog``)
follows the pages the tree takes and logs the prefixes its evictions free, for the
cache's explain.

The model's components have a part here each, over the requests. A hybrid
model's tree carries ``StateSnapshots`` (``state_cache.py``): a match ends where
the tree holds a recurrent-state snapshot, and ``states_kv`` (``RequestStates``,
``state_kv.py``) plans where each step restores and saves the request's state
(``plan_states``; the rule is in its module). A model with sliding layers keeps
their K/V in window pages (``window_pages.py``) and its tree carries
``SlidingWindows`` (``window_cache.py``): a match ends where the window pages of
[L - W, L) are cached; ``windows`` (``RequestWindows``, ``window_kv.py``) keeps each
request's references on the window pages its window needs. This class calls its
parts where pages change hands (match, decode pages, prefill chunks, trim, insert,
release).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from radixserve.combinations import check_features, features_on
from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.disagg import DecodeSide
from radixserve.scheduler.explain import EvictionLog
from radixserve.scheduler.kv_events import KVEventRecorder
from radixserve.scheduler.prefix_cache import MatchResult, PrefixCache
from radixserve.scheduler.radix_cache import CacheComponent
from radixserve.scheduler.request import Request
from radixserve.scheduler.state_cache import StateSnapshots
from radixserve.scheduler.state_kv import NO_STATE_WORK, RequestStates
from radixserve.scheduler.tiered_cache import TieredCache
from radixserve.scheduler.window_cache import SlidingWindows
from radixserve.scheduler.window_kv import RequestWindows
from radixserve.scheduler.window_pages import WindowPages

_NO_PAGES = np.zeros(0, dtype=np.int32)


class KVCacheManager:
    def __init__(
        self,
        allocator: PageAllocator,
        cache: PrefixCache,
        window: WindowPages | None = None,
        span: int = 0,
        *,
        components: Mapping[str, CacheComponent] | None = None,
        tiers: TieredCache | None = None,
    ) -> None:
        """``cache`` (what every call goes to: the tree, or ``tiers`` wrapping it);
        ``window`` (the sliding layers' window pool, W = ``span``); ``components``
        (the tree's, by name: ``RadixCache.components``); ``tiers`` (the host and
        disk tiers, when ``cache`` is them)."""
        components = components or {}
        self.allocator = allocator
        self.cache = cache
        self.page_size = allocator.page_size
        self.tiers = tiers
        # Sliding layers' window pages (None: the model has none, or one pool for all).
        tree_windows: SlidingWindows | None = components.get("window")  # type: ignore[assignment]
        self.windows = None if window is None else RequestWindows(window, span, tree_windows)
        # The tree's recurrent-state snapshots (None: not a hybrid model's tree).
        self.states: StateSnapshots | None = components.get("state")  # type: ignore[assignment]
        self.states_kv = None if self.states is None else RequestStates(self.states, self.page_size)
        self._evicted = 0  # pages evicted to make room (not flushes)
        # What the tree evicted, for the cache's explain (explain.py).
        self.evictions = (
            EvictionLog(allocator.num_pages, self.page_size) if cache.keeps_prefixes else None
        )
        # A decode server's pulls (``disagg.DecodeSide``; None: no disaggregation):
        # pages arriving from a prefill server keep their request LOADING.
        self.remote: DecodeSide | None = None

    @property
    def evicted_pages(self) -> int:
        """Pool pages evicted to make room since the start (for requests' pages and,
        with tiers, for promoted ones); a flush is not counted."""
        tiers = self.tiers
        return self._evicted + (tiers.promotion_evictions if tiers is not None else 0)

    def retention_stats(self) -> dict[str, int]:
        """The tree's retention figures (``RadixCache.retention_stats``; the
        ``priority`` eviction policy runs the Python tree)."""
        core = self.tiers.inner if self.tiers is not None else self.cache
        return core.retention_stats()  # type: ignore[attr-defined]

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
        self._hold(req, m, (m.hit_len, 0, 0, 0))
        if self.states_kv is not None:
            self.states_kv.hold_match(req, m)
        return m.hit_len

    def _hold(self, req: Request, m: MatchResult, by_tier: tuple[int, ...]) -> None:
        """The request holds match ``m`` (its node locked already): its page table
        starts with the matched pages, computed up to the hit."""
        req.node = m.last_node
        req.locked_len = req.kv_len = m.hit_len
        req.cached_by_tier = by_tier
        n = len(m.pages)
        req.table_room(n)[:n] = m.pages
        req.num_pages = n
        if self.windows is not None:
            self.windows.hold_match(req, m)

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
        if self.evictions is not None:
            self.evictions.inserted(req.tokens[: m.hit_len], m.pages, old.hit_len, req.salt)
        self.cache.lock(m.last_node)
        self.cache.unlock(req.node)  # type: ignore[arg-type]
        self._hold(req, m, tiers.last_match_tiers)
        return m.hit_len

    def loading(self, req: Request) -> bool:
        """Whether some of the request's cached prefix is still being copied up, or
        read from the shared store, or its pages are still being pulled from a prefill
        server."""
        if req.remote is not None:
            return True
        tiers = self.tiers
        if tiers is None:
            return False
        run = req.cache_state.store_run
        if run and tiers.store.pending(run):  # type: ignore[union-attr]
            return True
        if not tiers.pages_loading:
            return False
        return tiers.loading(req.table[: req.locked_len // self.page_size])

    def will_fetch(self, req: Request) -> bool:
        """Whether ``fetch_from_store`` will ask the store for pages after the
        request's match (it then waits LOADING)."""
        tiers = self.tiers
        return (
            tiers is not None
            and tiers.store is not None
            and req.match_len // self.page_size > req.kv_len // self.page_size
        )

    def fetch_from_store(self, req: Request, counts: bool) -> None:
        """Ask the shared store for the whole pages after the request's match, read
        into the pages it holds for them (``grow`` gave them); it is LOADING until
        they arrived or not (``take_store_hit``). ``counts``: its hit counts (first
        admission)."""
        if not self.will_fetch(req):
            return
        tiers = self.tiers
        assert tiers is not None and req.kv_len == req.locked_len and not req.cache_state.store_run
        ps = self.page_size
        first, end = req.kv_len // ps, req.match_len // ps
        parent = int(req.table[first - 1]) if first else -1
        req.cache_state.store_run = tiers.fetch(
            req.tokens[: end * ps], req.table[first:end], first, req.salt, parent
        )
        req.cache_state.store_counts = counts

    def take_store_hit(self, req: Request) -> tuple[int, bool]:
        """After the request's store run arrived: its pages read count as computed.
        Returns (tokens read, whether they count as the request's hit)."""
        run = req.cache_state.store_run
        if not run:
            return 0, False
        req.cache_state.store_run = 0
        n = self.tiers.store.take(run) * self.page_size  # type: ignore[union-attr]
        req.kv_len += n
        return n, req.cache_state.store_counts

    def release_prefix(self, req: Request) -> None:
        """Undo ``acquire_prefix`` for a request that was not admitted after all."""
        if req.node is not None:
            self.cache.unlock(req.node)
        if self.windows is not None:
            self.windows.release(req)
        req.node = None
        req.locked_len = req.kv_len = req.num_pages = 0
        req.cache_state.restore_state, req.cache_state.diverge_at = -1, 0

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` fresh pages, evicting LRU cache leaves if needed; None if impossible."""
        ids = self.allocator.alloc(n)
        if ids is None:
            free = self.allocator.num_free
            self._evicted += self.cache.evict(n - free)
            self._log_evicted(free)
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
        if self.windows is not None and not self.windows.grow_decodes(reqs):
            return False
        needy = [(r, self.pages_for(r.num_tokens + len(r.spec.draft)) - r.num_pages) for r in reqs]
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
        if self.windows is not None:
            self.windows.trim(req, keep)
        if req.sent_pages > keep:
            req.sent_pages = keep
            req.table_cut = True

    def cache_computed(self, req: Request) -> None:
        """Insert the request's computed whole pages into the cache; move its lock.
        A hybrid model's request hands its snapshot over with the pages ending
        where it was saved (first, when that is short of the computed pages)."""
        full = req.kv_len - req.kv_len % self.page_size
        if self.states_kv is not None:
            for at, state in self.states_kv.saved_points(req, full):
                self._insert(req, at, state)  # ascending: each insert moves the lock on
        if full > req.locked_len:
            self._insert(req, full, -1)

    def _insert(self, req: Request, full: int, state: int) -> None:
        """The one insert: the request's first ``full`` tokens' pages, with what the
        tree's components keep of them (the snapshot ``state`` saved at ``full``, or
        -1; the request's window pages)."""
        ps = self.page_size
        n = full // ps
        entries: dict[str, object] = {}
        if state >= 0:
            entries["state"] = state
        if self.windows is not None and self.windows.tree is not None:
            entries["window"] = self.windows.of(req, n)
        cached_len, node = self.cache.insert(req.tokens[:full], req.table[:n], req.salt, **entries)
        if self.evictions is not None:
            self.evictions.inserted(req.tokens[:full], req.table[:n], cached_len, req.salt)
        assert cached_len >= req.locked_len, "the locked prefix vanished from the cache"
        hint = req.sampling.cache_retention
        if hint is not None:
            held = min(self.cache.retain(node, hint[0], hint[1]), req.prompt_len)
            req.stats.retained_tokens = max(req.stats.retained_tokens, held)
        if cached_len > req.locked_len:
            req.dups.append(req.table[req.locked_len // ps : cached_len // ps].copy())
        self.cache.lock(node)
        self.cache.unlock(req.node)
        req.node = node
        req.locked_len = full

    def release(self, req: Request) -> None:
        """Give up the request's KV: cache what was computed, free the rest (pages
        still being pulled go to the pulls' quarantine, ``disagg.py``; pages a store
        run still fills go when it is done)."""
        if req.remote is not None:
            self.remote.detach(req)  # type: ignore[union-attr]
        held = None
        run = req.cache_state.store_run
        if run:
            store = self.tiers.store  # type: ignore[union-attr]
            if store.pending(run):
                held = store.abandon(run)
                req.cache_state.store_run = 0
            else:
                self.take_store_hit(req)  # what arrived is computed KV: it is cached
        if self.states_kv is not None:
            self.states_kv.save_at_release(req)
        self.cache_computed(req)
        if self.states_kv is not None:
            self.states_kv.release(req)
        req.cache_state.restore_state, req.cache_state.diverge_at = -1, 0
        own = req.table[req.locked_len // self.page_size : req.num_pages]
        if held is not None:
            own = np.setdiff1d(own, held).astype(np.int32)
        self.allocator.free(np.concatenate([*req.dups, own]) if req.dups else own)
        self.cache.unlock(req.node)
        if self.windows is not None:
            self.windows.release(req)
        req.node = None
        req.dups = []
        req.locked_len = req.kv_len = req.num_pages = req.sent_pages = 0
        req.table_cut = False  # the slot is released: the worker clears its table

    # ------------------------------------------------------ window pages
    @property
    def window(self) -> WindowPages | None:
        """The window pool's pages (None: no window pool)."""
        return None if self.windows is None else self.windows.pages

    @property
    def window_evicted(self) -> int:
        return 0 if self.windows is None else self.windows.evicted

    def grow_window(self, req: Request, n: int) -> bool:
        """Window pages for ``req``'s next ``n`` tokens (a prefill chunk, when it is
        scheduled); False, taking none, when short. True without a window pool."""
        return self.windows is None or self.windows.grow(req, n)

    def plan_window(self, req: Request, n: int) -> tuple[int, np.ndarray]:
        """The window table entries the worker lacks for ``req``'s next step of ``n``
        tokens, ``(first entry, page ids)`` (``RequestWindows.plan``)."""
        if self.windows is None:
            return 0, _NO_PAGES
        return self.windows.plan(req, n)

    def check_window_idle(self) -> None:
        if self.windows is not None:
            self.windows.check_idle()

    # ------------------------------------------------- recurrent states
    def plan_states(self, req: Request, n: int) -> tuple[int, int, int, int, int]:
        """A hybrid model's state work for ``req``'s next step of ``n`` tokens
        (``RequestStates.plan``); none for another model."""
        if self.states_kv is None:
            return NO_STATE_WORK
        return self.states_kv.plan(req, n)

    def mark_divergence(self, req: Request, others: list[Request], shared: int) -> None:
        """``req`` waits for ``others`` to cache the ``shared`` tokens they have in
        common: the first of them that computes that point saves its state there."""
        if self.states_kv is not None:
            self.states_kv.mark_divergence(req, others, shared)

    def take_state_saves(self) -> np.ndarray:
        """The ``slot, snapshot`` pairs the next step copies first (``Step.state_saves``)."""
        saves = self.states_kv.take_saves() if self.states_kv is not None else []
        return np.asarray(saves, dtype=np.int32)

    def check_states_idle(self) -> None:
        """At idle every snapshot is free or held by the tree."""
        if self.states_kv is not None:
            self.states_kv.check_idle()

    def held_pages(self, req: Request) -> int:
        """Pages the request holds outside the cache (own pages and duplicates)."""
        own = req.num_pages - req.locked_len // self.page_size
        return own + sum(len(d) for d in req.dups)

    def flush(self, keep_disk: bool = False) -> int:
        """Evict every unlocked page now; running requests keep theirs. With tiers,
        the host tier is emptied too, and the disk tier unless ``keep_disk``."""
        tiers = self.tiers
        free = self.allocator.num_free
        if tiers is not None:
            freed = tiers.flush(keep_disk)
        else:
            freed = self.cache.evict(self.cache.evictable_pages)
        self._log_evicted(free)
        return freed

    def _log_evicted(self, free_before: int) -> None:
        """After an eviction (``free_before`` pages were free): its victims are the
        pages freed since, on top of the allocator's free stack."""
        if self.evictions is not None:
            freed = self.allocator.num_free - free_before
            self.evictions.evicted(self.allocator.last_freed(freed))

    def record_events(self) -> KVEventRecorder:
        """Wrap the tree in a ``KVEventRecorder`` (with tiers: the tree below them,
        whose own inserts and evictions are what a match promotes and an eviction
        demotes); from now on every change is recorded. Before any request."""
        check_features(
            features_on(
                kv_events=True,
                recurrent_states=self.states is not None,
                window_pool=self.windows is not None,
            )
        )
        if self.tiers is not None:
            recorder = KVEventRecorder(self.tiers.inner, self.allocator)
            self.tiers.inner = recorder
        else:
            recorder = KVEventRecorder(self.cache, self.allocator)
            self.cache = recorder
        return recorder

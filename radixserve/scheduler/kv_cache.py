"""Per-request KV bookkeeping over the page allocator and (optionally) the tree.

This is the one place that decides who owns which page:

- ``acquire_prefix`` matches a request's tokens (all but the last one, whole
  pages) and locks the match: those pages belong to the tree and are now
  protected; they start the request's page table.
- ``alloc`` hands out fresh pages, evicting unlocked tree leaves when short.
- ``cache_computed`` ("cache early") inserts the request's computed whole pages
  into the tree and moves its lock to the new node. Pages another request
  cached meanwhile are duplicates: the request keeps them (the worker's page
  table still points at them) in ``req.dups`` until it releases its KV.
- ``release`` (finish, abort, retraction) caches what was computed, frees the
  duplicates and every page past the inserted length (the partial tail page
  and pages allocated for tokens never computed), and unlocks. The computed KV
  stays in the tree, unlocked, so a retry hits it.

With ``cache="none"`` there is no tree: nothing is matched or inserted, and
release frees the whole page table (plain PagedAttention).
"""

from __future__ import annotations

import numpy as np

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.request import Request


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, tree=None) -> None:
        self.allocator = allocator
        self.tree = tree  # None: cache="none"
        self.page_size = allocator.page_size

    @property
    def enabled(self) -> bool:
        return self.tree is not None

    @property
    def available_pages(self) -> int:
        """Pages that could be handed out now: free plus evictable."""
        evictable = self.tree.evictable_pages if self.tree is not None else 0
        return self.allocator.num_free + evictable

    def peek(self, req: Request) -> int:
        """The request's cached prefix length, changing nothing."""
        if self.tree is None:
            return 0
        return self.tree.peek_prefix(req.tokens[: req.num_tokens - 1], req.salt)

    def acquire_prefix(self, req: Request) -> int:
        """Match and lock the request's cached prefix; it starts the page table."""
        assert req.num_pages == 0 and req.node is None
        if self.tree is None:
            return 0
        m = self.tree.match_prefix(req.tokens[: req.num_tokens - 1], req.salt)
        self.tree.lock(m.last_node)
        req.node = m.last_node
        req.locked_len = m.hit_len
        req.kv_len = m.hit_len
        n = len(m.pages)
        req.table[:n] = m.pages
        req.num_pages = n
        return m.hit_len

    def release_prefix(self, req: Request) -> None:
        """Undo ``acquire_prefix`` for a request that was not admitted after all."""
        if self.tree is not None and req.node is not None:
            self.tree.unlock(req.node)
        req.node = None
        req.locked_len = req.kv_len = req.num_pages = 0

    def alloc(self, n: int) -> np.ndarray | None:
        """``n`` fresh pages, evicting LRU tree leaves if needed; None if impossible."""
        ids = self.allocator.alloc(n)
        if ids is None and self.tree is not None:
            self.tree.evict(n - self.allocator.num_free)
            ids = self.allocator.alloc(n)
        return ids

    def append_pages(self, req: Request, ids: np.ndarray) -> None:
        req.table[req.num_pages : req.num_pages + len(ids)] = ids
        req.num_pages += len(ids)

    def cache_computed(self, req: Request) -> None:
        """Insert the request's computed whole pages into the tree; move its lock."""
        if self.tree is None:
            return
        ps = self.page_size
        full = req.kv_len - req.kv_len % ps
        if full <= req.locked_len:
            return
        cached_len, node = self.tree.insert(req.tokens[:full], req.table[: full // ps], req.salt)
        assert cached_len >= req.locked_len, "the locked prefix vanished from the tree"
        if cached_len > req.locked_len:
            req.dups.append(req.table[req.locked_len // ps : cached_len // ps].copy())
        self.tree.lock(node)
        self.tree.unlock(req.node)
        req.node = node
        req.locked_len = full

    def release(self, req: Request) -> None:
        """Give up the request's KV: cache what was computed, free the rest."""
        ps = self.page_size
        if self.tree is None:
            self.allocator.free(req.table[: req.num_pages])
        else:
            self.cache_computed(req)
            own = req.table[req.locked_len // ps : req.num_pages]
            self.allocator.free(np.concatenate([*req.dups, own]) if req.dups else own)
            self.tree.unlock(req.node)
        req.node = None
        req.dups = []
        req.locked_len = req.kv_len = req.num_pages = req.sent_pages = 0

    def held_pages(self, req: Request) -> int:
        """Pages the request holds outside the tree (own pages and duplicates)."""
        own = req.num_pages - (req.locked_len // self.page_size if self.tree is not None else 0)
        return own + sum(len(d) for d in req.dups)

    def flush(self) -> int:
        """Evict every unlocked page now; running requests keep theirs."""
        if self.tree is None:
            return 0
        return self.tree.evict(self.tree.evictable_pages)

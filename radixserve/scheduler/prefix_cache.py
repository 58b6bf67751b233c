"""The prefix cache contract the scheduler relies on, and the cache that keeps nothing.

``PrefixCache`` is what ``KVCacheManager`` calls; three caches satisfy it:
the Python radix tree (``RadixCache``, the core that also carries components:
window pages, recurrent-state snapshots, ``radix_cache.py``'s ``CacheComponent``), the native one
(``NativeRadixCache``) and ``NoCache`` (``--cache none``). The full contract of each call (splits,
ownership after insert, LRU order) is in ``radix_cache.py`` and
docs/architecture.md; in short:

* ``match_prefix`` returns the longest cached prefix in whole pages; the caller
  locks ``last_node`` before any other call. A node handle is valid while it
  is locked.
* ``insert`` returns ``(cached_len, node)``: the cache now owns the caller's
  pages past ``cached_len``; the caller's pages before it duplicate the cache's,
  and the caller keeps them while its page table points at them and frees them
  when it releases its KV. Keyword ``entries`` go to the tree's components by name
  (a cache without components is given none).
* ``continuation(tokens, max_len, salt)`` reads what follows the whole of
  ``tokens`` on a cached path (speculative decoding's radix drafts); it changes
  nothing.
* ``evict`` frees unlocked pages (LRU, or the tree's ``policy``); locked ones are
  never freed.
* ``retain(node, level, seconds)`` keeps the path from ``node`` up at a retention
  level for a while under the Python tree's ``priority`` eviction policy and returns
  the tokens it holds (clipped at the retention caps); every other cache (and
  policy) ignores the hint and returns 0.

``PageFollower`` is the base of the caches that wrap another through this
contract (the KV event recorder, the cache tiers): it hands the read-only calls
through and keeps, per page, whether the wrapped tree holds it, so an eviction's
victims are the pages it held that the allocator no longer counts as allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from radixserve.scheduler.allocator import PageAllocator

_EMPTY = np.zeros(0, dtype=np.int32)


@runtime_checkable
class CacheNode(Protocol):
    """A handle on a cache node (``RadixNode``, the native ``NodeHandle``, or
    ``NoCache``'s root): opaque to the scheduler, valid while locked."""

    @property
    def node_id(self) -> int: ...


class MatchResult(NamedTuple):
    hit_len: int  # tokens, a multiple of page_size
    pages: np.ndarray  # int32 page ids covering tokens[:hit_len]
    last_node: CacheNode  # deepest node of the match (a root when hit_len == 0)


Tokens = np.ndarray | Sequence[int]


@runtime_checkable
class PrefixCache(Protocol):
    """Token sequences -> KV pages, shared across requests (see the module docstring)."""

    # False only for the cache that keeps nothing: no match can ever hit, so the
    # scheduler neither orders requests by their cached prefix nor waits for one.
    keeps_prefixes: bool

    @property
    def page_size(self) -> int: ...

    @property
    def evictable_pages(self) -> int: ...  # pages in unlocked nodes

    @property
    def protected_pages(self) -> int: ...  # pages in locked nodes

    @property
    def cached_pages(self) -> int: ...  # all pages the cache holds

    def match_prefix(self, tokens: Tokens, salt: str | None = None) -> MatchResult: ...

    def peek_prefix(self, tokens: Tokens, salt: str | None = None) -> int: ...

    def continuation(self, tokens: Tokens, max_len: int, salt: str | None = None) -> np.ndarray: ...

    def insert(
        self, tokens: Tokens, pages: np.ndarray, salt: str | None = None
    ) -> tuple[int, CacheNode]: ...

    def lock(self, node: CacheNode) -> None: ...

    def unlock(self, node: CacheNode) -> None: ...

    def evict(self, num_pages: int) -> int: ...

    def retain(self, node: CacheNode, level: int, seconds: float) -> int: ...

    def reset(self) -> None: ...

    def check(self) -> None: ...


class _Root:
    """``NoCache``'s only node: every match ends here and nothing hangs below it."""

    __slots__ = ()
    node_id = 0

    def __repr__(self) -> str:
        return "NoCache.root"


class NoCache:
    """``--cache none``: a prefix cache that keeps nothing (plain PagedAttention).

    Nothing ever matches, and ``insert`` answers that the whole range is already
    cached: by the contract the caller then keeps every page it offered (as
    duplicates) and frees them all when it releases its KV, at finish, which is
    exactly what ``--cache none`` means. It holds no page, so lock, evict and
    reset have nothing to do.
    """

    keeps_prefixes = False
    root = _Root()

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size

    evictable_pages = protected_pages = cached_pages = 0

    def match_prefix(self, tokens: Tokens, salt: str | None = None) -> MatchResult:
        return MatchResult(0, _EMPTY, self.root)

    def peek_prefix(self, tokens: Tokens, salt: str | None = None) -> int:
        return 0

    def continuation(self, tokens: Tokens, max_len: int, salt: str | None = None) -> np.ndarray:
        return _EMPTY

    def insert(
        self, tokens: Tokens, pages: np.ndarray, salt: str | None = None
    ) -> tuple[int, CacheNode]:
        whole = len(tokens) - len(tokens) % self.page_size
        if len(pages) != whole // self.page_size:
            raise ValueError(f"{len(pages)} pages for {len(tokens)} tokens")
        return whole, self.root

    def lock(self, node: CacheNode) -> None:
        assert node is self.root, "a node of another cache"

    def unlock(self, node: CacheNode) -> None:
        assert node is self.root, "a node of another cache"

    def evict(self, num_pages: int) -> int:
        return 0

    def retain(self, node: CacheNode, level: int, seconds: float) -> int:
        return 0

    def reset(self) -> None:
        pass

    def check(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"NoCache(page_size={self.page_size})"


class PageFollower:
    """Wraps a prefix cache that keeps prefixes and follows which pool pages it holds.

    ``lock``/``unlock`` are the inner cache's bound methods (no extra frame on the
    hot path); subclasses mark pages in ``_owned`` as the tree takes them and call
    ``_gone`` after an ``evict`` of the inner cache."""

    keeps_prefixes = True

    def __init__(self, inner: PrefixCache, allocator: PageAllocator, needs: str) -> None:
        if not inner.keeps_prefixes:
            raise ValueError(f"{needs} need a prefix cache that keeps prefixes (--cache radix)")
        self.inner = inner
        self.allocator = allocator
        self.page_size = inner.page_size
        self.lock = inner.lock
        self.unlock = inner.unlock
        self.continuation = inner.continuation  # read-only: what the wrapped tree holds
        self.retain = inner.retain
        self._owned = np.zeros(allocator.num_pages, dtype=bool)  # pages the tree holds

    @property
    def evictable_pages(self) -> int:
        return self.inner.evictable_pages

    @property
    def protected_pages(self) -> int:
        return self.inner.protected_pages

    @property
    def cached_pages(self) -> int:
        return self.inner.cached_pages

    def _gone(self) -> np.ndarray:
        """The pages the tree held and has freed since the last call (no longer owned)."""
        owned = np.flatnonzero(self._owned)
        gone = owned[~self.allocator.is_allocated(owned)]
        self._owned[gone] = False
        return gone

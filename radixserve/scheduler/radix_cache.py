"""The radix tree: token sequences -> KV page ids, shared across requests.

Every cached sequence is a path from a root; each node holds a compressed edge
(``key``: its tokens) and the page ids of those tokens' KV (``pages``). Lengths
are in whole pages: ``len(key) == len(pages) * page_size`` for every node.

Contract (the scheduler and the native tree rely on it, see docs/architecture.md):

* ``match_prefix(tokens, salt)`` returns the longest cached prefix in whole
  pages (``hit_len`` tokens, their ``pages``, and ``last_node``). When the
  match ends inside an edge the node is split: a *new* node takes the matched
  prefix and the existing node keeps the deeper part, so a handle held on the
  existing node stays valid. The new parent inherits ``lock_ref`` and
  ``last_access``.
* ``insert(tokens, pages, salt)`` adds the whole pages of ``tokens`` and
  returns ``(cached_len, node)``: ``cached_len`` tokens were already cached (the
  caller still owns its own pages for that range and frees any that duplicate
  the tree's); the tree now owns the caller's pages beyond ``cached_len``.
* ``lock(node)`` / ``unlock(node)`` add / remove one reference on every node on
  the path to the root. Locked pages are never evicted. Locks are path-closed:
  a node's ``lock_ref`` is at least the sum of its children's.
* ``evict(n)`` frees whole unlocked leaves, least recently used first, until
  at least ``n`` pages are freed or nothing is evictable; a parent left
  childless and unlocked becomes a candidate.

LRU is a logical clock: each ``match_prefix`` and ``insert`` call ticks it once
and stamps every node on its path with the new time (so a parent is never older
than its children). Ties (impossible in practice, since one call stamps one
path) go to the node created first: every non-root node gets an id from a
creation counter, split-created nodes included. Eviction keeps a heap of
candidate leaves with lazy deletion: an entry is valid only while its node is
still an unlocked leaf with the same stamp, and stale entries are dropped when
popped or when the heap is compacted (amortised O(1) per push). Each victim
costs O(log n).

Eviction policies (``policy``, ``--radix-eviction-policy``; this tree only, the
native one is LRU): the heap orders candidates by a key, and an entry is valid
while its node's key is unchanged.

* ``lru``: ``(last_access,)``.
* ``lfu``: ``(hits, last_access)``: ``hits`` counts the match and insert calls
  that stamped the node (a split's new parent inherits it, so a parent never has
  fewer than its children), least used first, LRU among equals.
* ``priority``: ``(retention, last_access)``: ``retain(node, level, seconds)``
  gives the path from ``node`` up a retention level (1..100, higher kept longer)
  until a deadline on ``clock`` (a hint decays instead of pinning memory: past it
  the level is 0 again); the lowest effective level goes first, LRU within a
  level. Expiries are kept in a second heap and applied before each eviction, so
  every valid heap entry carries its node's current key. A tenant (salt) holds at
  most ``max_retained_pages`` pages under running hints, and all tenants together
  ``max_retained_total``: a hint that would take either past its cap is clipped to
  the longest run of the path's nodes from the root that fits (``retain`` returns
  the tokens it holds, 0 when nothing fits; counted in ``retention_clipped``), so no
  tenant pins the pool and retained prefixes never leave the others short of pages.

Salts give tenants separate namespaces: each salt has its own root, so two
salts never share a node; the LRU clock and the page pool are global.

Components (``CacheComponent`` below): the full-attention pages are the tree's own
entries; what else a model needs per cached prefix (window pages, recurrent-state
snapshots) is a ``CacheComponent`` the tree is built with (``components``). With
components, a match ends where every one of them can still serve it (the minimum:
``peek_prefix`` too; ``kv_prefix`` is the plain match), ``insert`` hands each its
``entries``, and splits, evictions and resets tell each what happened to a node.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.config import EVICTION_POLICIES
from radixserve.scheduler.prefix_cache import MatchResult
from radixserve.scheduler.radix_check import check_tree

_EMPTY = np.zeros(0, dtype=np.int32)


class CacheComponent:
    """What a kind of cached entry beyond the full-attention pages needs from the radix core.

    The radix core (``radix_cache.py``) keys token sequences to full-attention pages:
    those are its own entries (every node has them; locks, the LRU clock and ``evict``
    count them, and the native twin keeps exactly them). A model may need more per
    cached prefix before a hit is usable: its sliding layers' window pages
    (``window_cache.py``), its recurrent layers' state snapshots (``state_cache.py``).
    Each such kind is a ``CacheComponent``: the core calls it at the points where its
    entries change hands, and it keeps them by node.

    * **match.** ``serve(path, hit)``: how many tokens of the plain match (``hit``
      tokens, whole pages, along ``path``: each node with the tokens of it matched) the
      component can serve. The core's hit is the minimum over its components (vLLM's
      coordinator over per-attention-type managers does the same), and the match is
      then taken, split and stamped, to that length.
    * **insert.** ``inserted(node, num_pages, entry)``: after the core's insert of
      ``num_pages`` pages ending at ``node``; ``entry`` is the component's part of the
      insert (``insert(tokens, pages, salt, **entries)``, by the component's ``name``;
      None when the caller gave none).
    * **split.** ``split(prefix, child, pages)``: ``child``'s edge was cut after its
      first ``pages`` pages, which now form the new node ``prefix``.
    * **evict / release.** ``removed(node)``: the core took ``node`` out of the tree
      (an eviction); the component frees what it kept there. ``reset()``: the tree was
      emptied. A component that must make room in its own pool may remove an
      unlocked leaf whole through the core (``RadixCache.evict_node``).
    * **check.** ``check(nodes)``: its invariants, given every node of the tree.

    A new kind (say, a multimodal encoder's outputs keyed by the placeholder tokens
    they stand for) is a new component: its own ``serve`` (how far its entries
    cover), ``inserted`` (take the caller's entries), ``removed`` (free them), with
    no change to the core. Components run only in the Python core; which features
    can run together is ``combinations.py``'s table.
    """

    #: The key of its entries in ``RadixCache.insert(..., **entries)`` and of the
    #: component in ``RadixCache.components``.
    name: ClassVar[str]
    tree: RadixCache

    def bind(self, tree: RadixCache) -> None:
        """Called once, by the core this component belongs to."""
        self.tree = tree

    def serve(self, path: list[tuple[RadixNode, int]], hit: int) -> int:
        """Tokens (whole pages, at most ``hit``) of the plain match it can serve."""
        return hit

    def inserted(self, node: RadixNode, num_pages: int, entry: object) -> None:
        """The core inserted ``num_pages`` pages ending at ``node``; ``entry`` is
        this component's part of the insert (None: none given)."""

    def split(self, prefix: RadixNode, child: RadixNode, pages: int) -> None:
        """``prefix`` took the first ``pages`` pages of ``child``'s edge."""

    def removed(self, node: RadixNode) -> None:
        """``node`` left the tree (evicted): free what the component kept there."""

    def reset(self) -> None:
        """The tree was emptied."""

    def check(self, nodes: list[RadixNode]) -> None:
        """Raise AssertionError when an invariant is broken (``nodes``: the tree's)."""


class RadixCacheError(RuntimeError):
    """A misuse of the tree: stale handle, unlock below zero, reset while locked."""


class RadixNode:
    """One compressed edge of the tree. Roots have an empty key and no parent."""

    __slots__ = (
        "key",
        "pages",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "node_id",
        "first_key",
        "is_root",
        "salt",
        "hits",
        "retention",
        "retain_until",
        "counted",
    )

    def __init__(
        self,
        key: np.ndarray,
        pages: np.ndarray,
        parent: RadixNode | None,
        first_key: object,
        node_id: int,
        last_access: int,
        *,
        is_root: bool = False,
        salt: str | None = None,
    ) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[object, RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access
        self.node_id = node_id
        self.first_key = first_key  # this node's key in parent.children
        self.is_root = is_root
        self.salt = salt
        self.hits = 1  # match / insert calls that stamped it (lfu)
        self.retention = 0  # retention level while retain_until lasts (priority)
        self.retain_until = 0.0
        self.counted = False  # its pages count towards its salt's retained pages

    @property
    def attached(self) -> bool:
        """False once the node has been evicted or the tree reset."""
        return self.is_root or self.parent is not None

    def __repr__(self) -> str:
        return (
            f"RadixNode(id={self.node_id}, tokens={len(self.key)}, pages={len(self.pages)}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


def _lru_key(node: RadixNode) -> tuple:
    return (node.last_access,)


def _lfu_key(node: RadixNode) -> tuple:
    return (node.hits, node.last_access)


def _by_id(node: RadixNode) -> int:
    return node.node_id


# The per-node arrays of ``export_nodes`` and their dtypes (the native twin's).
_EXPORT_COLUMNS = {
    "parent": np.int32,
    "namespace": np.int32,
    "node_id": np.int64,
    "last_access": np.int64,
    "lock_ref": np.int32,
    "num_tokens": np.int64,
}


def as_tokens(tokens: np.ndarray | Sequence[int]) -> np.ndarray:
    """A 1-D int32 array view of ``tokens`` (no copy for int32 arrays)."""
    if type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1:
        return tokens
    arr = np.asarray(tokens, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape}")
    return arr


def _common_len(key: np.ndarray, tokens: np.ndarray, pos: int, end: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[pos:end]``."""
    n = min(len(key), end - pos)
    seg = tokens[pos : pos + n]
    # Whole-edge matches are the common case on a shared path; comparing bytes
    # answers them in one C call, without building a boolean array.
    if n == len(key) and key.tobytes() == seg.tobytes():
        return n
    neq = key[:n] != seg
    i = int(neq.argmax())
    return i if neq[i] else n


MAX_RETENTION = 100


class RadixCache:
    """The reference prefix cache (``PrefixCache``): a radix tree in Python, with the
    ``components`` a model needs beyond its full-attention pages."""

    keeps_prefixes = True

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int = 1,
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        max_retained_pages: int | None = None,
        components: Sequence[CacheComponent] = (),
        max_retained_total: int | None = None,
    ) -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction policy must be one of {EVICTION_POLICIES}, got {policy!r}")
        self.policy = policy
        self.clock = clock
        self._key = {"lru": _lru_key, "lfu": _lfu_key, "priority": self._retention_key}[policy]
        self._expiries: list[tuple[float, int, RadixNode]] = []
        self.max_retained_pages = (
            allocator.num_pages if max_retained_pages is None else max_retained_pages
        )
        self.max_retained_total = (
            allocator.num_pages if max_retained_total is None else max_retained_total
        )
        self.retained: dict[str | None, int] = {}  # pages under running hints, by salt
        self.retained_total = 0  # the sum of ``retained``
        self.retention_clipped = 0  # hints clipped at a cap (some not applied at all)
        if page_size != allocator.page_size:
            raise ValueError(
                f"page_size {page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self._roots: dict[str | None, RadixNode] = {}
        self._clock = 0
        self._next_id = 1
        self._num_nodes = 0  # non-root nodes
        self._evictable = 0  # pages in unlocked nodes
        self._protected = 0  # pages in locked nodes
        self._heap: list[tuple[tuple, int, RadixNode]] = []
        self._root(None)
        self.components: dict[str, CacheComponent] = {}
        for part in components:
            if part.name in self.components:
                raise ValueError(f"two {part.name!r} components in one tree")
            self.components[part.name] = part
            part.bind(self)
        self._parts = tuple(self.components.values())

    # ------------------------------------------------------------------ sizes
    @property
    def evictable_pages(self) -> int:
        """Pages that eviction could free now (every unlocked node's pages)."""
        return self._evictable

    @property
    def protected_pages(self) -> int:
        """Pages on a path locked by a running request."""
        return self._protected

    @property
    def cached_pages(self) -> int:
        """All pages held by the tree."""
        return self._evictable + self._protected

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _check_salt(salt: object) -> None:
        if salt is not None and not isinstance(salt, str):
            raise TypeError(f"salt must be a string or None, got {type(salt).__name__}")

    def _root(self, salt: str | None) -> RadixNode:
        root = self._roots.get(salt)
        if root is None:
            self._check_salt(salt)
            root = RadixNode(_EMPTY, _EMPTY, None, None, 0, 0, is_root=True, salt=salt)
            self._roots[salt] = root
        return root

    def _key_at(self, tokens: np.ndarray, pos: int) -> object:
        if self.page_size == 1:
            return int(tokens[pos])
        return tokens[pos : pos + self.page_size].tobytes()

    def _retention_key(self, node: RadixNode) -> tuple:
        level = node.retention if node.retain_until > self.clock() else 0
        return (level, node.last_access)

    def _push_candidate(self, node: RadixNode) -> None:
        heapq.heappush(self._heap, (self._key(node), node.node_id, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            self._compact_heap()

    @staticmethod
    def _is_candidate(node: RadixNode) -> bool:
        return node.parent is not None and node.lock_ref == 0 and not node.children

    is_evictable_leaf = _is_candidate  # what ``evict_node`` takes (for components)

    def _compact_heap(self) -> None:
        seen: set[int] = set()
        kept = []
        for entry in self._heap:
            key, nid, node = entry
            if nid not in seen and self._is_candidate(node) and self._key(node) == key:
                seen.add(nid)
                kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Split ``child``'s edge after ``at`` tokens; return the new prefix node.

        The existing node keeps the deeper part (handles on it stay valid); the
        new parent inherits its lock_ref and last_access.
        """
        ps = self.page_size
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key) and at % ps == 0
        prefix = RadixNode(
            child.key[:at],
            child.pages[: at // ps],
            parent,
            child.first_key,
            self._next_id,
            child.last_access,
        )
        self._next_id += 1
        self._num_nodes += 1
        prefix.lock_ref = child.lock_ref
        prefix.hits = child.hits
        prefix.retention, prefix.retain_until = child.retention, child.retain_until
        prefix.counted = child.counted  # the two split the pages: the salt's sum holds
        if child.retention:  # its hint runs out as the child's does
            heapq.heappush(self._expiries, (prefix.retain_until, prefix.node_id, prefix))
        child.key = child.key[at:]
        child.pages = child.pages[at // ps :]
        child.first_key = self._key_at(child.key, 0)
        child.parent = prefix
        prefix.children[child.first_key] = child
        parent.children[prefix.first_key] = prefix
        for part in self._parts:
            part.split(prefix, child, at // ps)
        return prefix

    # ------------------------------------------------------------------ match
    def match_prefix(
        self, tokens: np.ndarray | Sequence[int], salt: str | None = None
    ) -> MatchResult:
        """Longest cached prefix of ``tokens`` in whole pages (that every component
        serves); stamps its path."""
        tokens = as_tokens(tokens)
        if self._parts:
            tokens = tokens[: self._served(tokens, salt)]
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        node = self._root(salt)  # a bad salt raises before the clock ticks
        self._clock += 1
        now = self._clock
        pos = 0
        pages = []
        while pos < end:
            child = node.children.get(self._key_at(tokens, pos))
            if child is None:
                break
            c = _common_len(child.key, tokens, pos, end)
            if ps > 1:
                c -= c % ps
            ends_inside = c < len(child.key)
            if ends_inside:
                child = self._split(child, c)
            child.last_access = now
            child.hits += 1
            pages.append(child.pages)
            pos += c
            node = child
            if ends_inside:
                break
        if not node.is_root and self._is_candidate(node):
            self._push_candidate(node)
        if not pages:
            hit_pages = _EMPTY
        elif len(pages) == 1:
            hit_pages = pages[0].copy()
        else:
            hit_pages = np.concatenate(pages)
        return MatchResult(pos, hit_pages, node)

    def peek_prefix(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> int:
        """``match_prefix(...).hit_len`` without splitting or stamping anything."""
        if self._parts:
            return self._served(as_tokens(tokens), salt)
        return self.kv_prefix(tokens, salt)

    def _served(self, tokens: np.ndarray, salt: str | None) -> int:
        """How far every component serves the plain match of ``tokens`` (the minimum)."""
        self._check_salt(salt)
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        node = self._roots.get(salt)
        pos = 0
        path = []
        while node is not None and pos < end:
            child = node.children.get(self._key_at(tokens, pos))
            if child is None:
                break
            c = _common_len(child.key, tokens, pos, end)
            c -= c % ps
            if c == 0:
                break
            path.append((child, c))
            pos += c
            if c < len(child.key):
                break
            node = child
        for part in self._parts:
            pos = min(pos, part.serve(path, pos))
        return pos

    def kv_prefix(self, tokens: np.ndarray | Sequence[int], salt: str | None = None) -> int:
        """The plain longest cached prefix (full pages), whatever the components
        serve; changes nothing."""
        tokens = as_tokens(tokens)
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        self._check_salt(salt)  # the same TypeError as match_prefix, even for an unseen salt
        node = self._roots.get(salt)
        pos = 0
        while node is not None and pos < end:
            child = node.children.get(self._key_at(tokens, pos))
            if child is None:
                break
            c = _common_len(child.key, tokens, pos, end)
            if ps > 1:
                c -= c % ps
            pos += c
            if c < len(child.key):
                break
            node = child
        return pos

    def continuation(
        self, tokens: np.ndarray | Sequence[int], max_len: int, salt: str | None = None
    ) -> np.ndarray:
        """The tokens that follow the whole of ``tokens`` on a cached path, at most
        ``max_len`` (int32): the rest of the edge where ``tokens`` ends, then down the
        most recently used child (``last_access``, then the newer node) at each node.
        Empty when ``tokens`` is not a cached path. A last partial page is matched
        against the children's first tokens. Changes nothing (no split, no stamp).
        Speculative decoding's radix drafts (docs/speculative.md)."""
        tokens = as_tokens(tokens)
        self._check_salt(salt)
        node = self._roots.get(salt)
        if node is None or max_len <= 0:
            return _EMPTY
        ps, n, pos = self.page_size, len(tokens), 0
        newest = lambda c: (c.last_access, c.node_id)  # noqa: E731
        while True:
            rest = n - pos
            if rest == 0:
                off = len(node.key)
                break
            if rest >= ps:
                child = node.children.get(self._key_at(tokens, pos))
                if child is None:
                    return _EMPTY
                c = _common_len(child.key, tokens, pos, n)
                if c == len(child.key):
                    pos += c
                    node = child
                    continue
                if c < rest:
                    return _EMPTY  # a different token: not a cached path
                node, off = child, c
                break
            # A last partial page: the most recently used child whose edge starts with it.
            part = tokens[pos:].tobytes()
            fits = [c for c in node.children.values() if c.key[:rest].tobytes() == part]
            if not fits:
                return _EMPTY
            node, off = max(fits, key=newest), rest
            break
        out = [node.key[off : off + max_len]]
        got = len(out[0])
        while got < max_len and node.children:
            node = max(node.children.values(), key=newest)
            out.append(node.key[: max_len - got])
            got += len(out[-1])
        return np.concatenate(out).astype(np.int32, copy=False)

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: np.ndarray | Sequence[int],
        pages: np.ndarray | Sequence[int],
        salt: str | None = None,
        **entries: object,
    ) -> tuple[int, RadixNode]:
        """Insert the whole pages of ``tokens``; return ``(cached_len, node)``.

        ``len(pages)`` must equal ``len(tokens) // page_size``. ``cached_len``
        tokens were already in the tree; the tree takes ownership of
        ``pages[cached_len // page_size:]``, and the caller keeps (and must
        eventually free) its pages before that which differ from the tree's.
        ``node`` is the deepest node covering the inserted tokens. ``entries``:
        each component's part of the insert, by its name (``CacheComponent``).
        """
        if entries and entries.keys() - self.components.keys():
            unknown = sorted(entries.keys() - self.components.keys())
            raise ValueError(f"insert of {unknown} entries, which no component of this tree keeps")
        result = self._insert_pages(tokens, pages, salt)
        if self._parts:
            num_pages = len(tokens) // self.page_size
            for part in self._parts:
                part.inserted(result[1], num_pages, entries.get(part.name))
        return result

    def _insert_pages(
        self,
        tokens: np.ndarray | Sequence[int],
        pages: np.ndarray | Sequence[int],
        salt: str | None,
    ) -> tuple[int, RadixNode]:
        tokens = as_tokens(tokens)
        ps = self.page_size
        num_pages = len(tokens) // ps
        pages = np.asarray(pages, dtype=np.int32)
        if pages.ndim != 1 or len(pages) != num_pages:
            raise ValueError(
                f"insert needs exactly len(tokens) // page_size = {num_pages} page ids, "
                f"got {len(pages)}"
            )
        end = num_pages * ps
        node = self._root(salt)  # a bad salt raises before the clock ticks
        self._clock += 1
        now = self._clock
        pos = 0
        while pos < end:
            first_key = self._key_at(tokens, pos)
            child = node.children.get(first_key)
            if child is None:
                leaf = RadixNode(
                    tokens[pos:end].copy(),
                    pages[pos // ps :].copy(),
                    node,
                    first_key,
                    self._next_id,
                    now,
                )
                self._next_id += 1
                self._num_nodes += 1
                self._evictable += len(leaf.pages)
                node.children[first_key] = leaf
                self._push_candidate(leaf)
                return pos, leaf
            c = _common_len(child.key, tokens, pos, end)
            if ps > 1:
                c -= c % ps
            if c < len(child.key):
                child = self._split(child, c)
            child.last_access = now
            child.hits += 1
            pos += c
            node = child
        if not node.is_root and self._is_candidate(node):
            self._push_candidate(node)
        return pos, node

    # -------------------------------------------------------------- retention
    def retain(self, node: RadixNode, level: int, seconds: float) -> int:
        """Keep the path from ``node`` up at retention ``level`` (1..100) for
        ``seconds`` (the ``priority`` policy; the others ignore it). A node keeps the
        stronger of its hints: the higher level, or the same level for longer.

        Returns the tokens of the path the hint holds, from the root: all of them, or,
        when the whole path would take the salt past ``max_retained_pages`` or all
        salts past ``max_retained_total``, the longest run of its nodes from the root
        that fits (the hint is clipped, and counted in ``retention_clipped``); 0 under
        another policy."""
        if self.policy != "priority" or not node.attached or node.is_root:
            return 0
        if not 1 <= level <= MAX_RETENTION or not seconds > 0:
            raise ValueError(
                f"a retention hint needs a level in [1, {MAX_RETENTION}] and seconds > 0"
            )
        self._apply_expiries()
        now = self.clock()
        until = now + seconds
        path = []
        while not node.is_root:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        salt = node.salt
        path.reverse()  # from the root: a clipped hint keeps the prefix's head
        held, total = self.retained.get(salt, 0), self.retained_total
        kept = 0
        for n in path:
            extra = 0 if n.counted else len(n.pages)
            if held + extra > self.max_retained_pages or total + extra > self.max_retained_total:
                self.retention_clipped += 1
                break
            held, total, kept = held + extra, total + extra, kept + 1
        del path[kept:]
        for n in path:
            current = n.retention if n.retain_until > now else 0
            if level > current or (level == current and until > n.retain_until):
                n.retention, n.retain_until = level, until
                heapq.heappush(self._expiries, (until, n.node_id, n))
                if self._is_candidate(n):
                    self._push_candidate(n)
            if not n.counted:
                n.counted = True
                self.retained[salt] = self.retained.get(salt, 0) + len(n.pages)
                self.retained_total += len(n.pages)
        return sum(len(n.key) for n in path)

    def _uncount(self, node: RadixNode, salt: str | None) -> None:
        node.counted = False
        self.retained_total -= len(node.pages)
        left = self.retained[salt] - len(node.pages)
        if left:
            self.retained[salt] = left
        else:
            del self.retained[salt]

    @staticmethod
    def _salt_of(node: RadixNode) -> str | None:
        while node.parent is not None:
            node = node.parent
        return node.salt

    def _apply_expiries(self) -> None:
        """Hints whose time is up: their nodes go back to the heap at level 0."""
        now = self.clock()
        exp = self._expiries
        while exp and exp[0][0] <= now:
            until, _, node = heapq.heappop(exp)
            if node.retain_until != until or not node.attached:
                continue  # a stronger hint replaced it, or the node is gone
            if node.counted:
                self._uncount(node, self._salt_of(node))
            if self._is_candidate(node):
                self._push_candidate(node)

    # ------------------------------------------------------------------ locks
    def lock(self, node: RadixNode) -> None:
        """Add one reference on every node from ``node`` up to its root."""
        if not node.attached:
            raise RadixCacheError(f"lock of a node that is no longer in the tree: {node!r}")
        while not node.is_root:
            if node.lock_ref == 0:
                n = len(node.pages)
                self._evictable -= n
                self._protected += n
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        """Remove one reference on every node from ``node`` up to its root."""
        if node.is_root:
            return
        if node.parent is None:
            raise RadixCacheError(f"unlock of a node that is no longer in the tree: {node!r}")
        if node.lock_ref <= 0:
            raise RadixCacheError(f"unlock below zero: {node!r}")
        if not node.children:
            leaf = node
        else:
            leaf = None
        while not node.is_root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                n = len(node.pages)
                self._protected -= n
                self._evictable += n
            node = node.parent  # type: ignore[assignment]
        if leaf is not None and leaf.lock_ref == 0:
            self._push_candidate(leaf)

    # --------------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages of unlocked leaves, LRU first.

        Returns how many pages were freed (less only when nothing more is
        evictable; possibly more, since whole nodes are freed).
        """
        freed = 0
        victims = []
        if self._expiries:
            self._apply_expiries()
        heap = self._heap
        key_of = self._key
        while freed < num_pages and heap:
            key, _, node = heapq.heappop(heap)
            if not self._is_candidate(node) or key_of(node) != key:
                continue  # stale entry
            parent = self._detach(node)
            victims.append(node.pages)
            freed += len(node.pages)
            if parent.children:
                continue
            if parent.is_root:
                if parent.salt is not None:
                    del self._roots[parent.salt]
            elif parent.lock_ref == 0:
                heapq.heappush(heap, (key_of(parent), parent.node_id, parent))
        if victims:
            self.allocator.free(np.concatenate(victims))
        return freed

    def _detach(self, node: RadixNode) -> RadixNode:
        """Take the unlocked leaf ``node`` out of the tree (its pages are the caller's
        to free); return its parent."""
        parent = node.parent
        assert parent is not None
        if node.counted:
            self._uncount(node, self._salt_of(node))
        del parent.children[node.first_key]
        node.parent = None
        for part in self._parts:
            part.removed(node)
        self._num_nodes -= 1
        self._evictable -= len(node.pages)
        return parent

    def evict_node(self, node: RadixNode) -> None:
        """Remove one unlocked leaf now, freeing its pages (a component making room
        in a pool of its own takes a node whole this way)."""
        assert self._is_candidate(node)
        parent = self._detach(node)
        self.allocator.free(node.pages)
        if not parent.children and not parent.is_root and parent.lock_ref == 0:
            self._push_candidate(parent)
        elif not parent.children and parent.is_root and parent.salt is not None:
            del self._roots[parent.salt]

    def reset(self) -> None:
        """Empty an idle tree, returning every page to the allocator (ascending ids).

        The clock and the node id counter keep running, so stamps and ids stay
        unique across resets.
        """
        if self._protected:
            raise RadixCacheError(
                "reset() while requests hold locks on the tree; evict the unlocked part instead"
            )
        pages = []
        for node in self._iter_nodes():
            pages.append(node.pages)
            node.parent = None
        if pages:
            # Ascending ids: the allocator's state after a reset then depends
            # only on which pages were cached, not on the order children were
            # visited in (so every tree implementation leaves the same state).
            self.allocator.free(np.sort(np.concatenate(pages)))
        for root in self._roots.values():
            root.children = {}
        self._roots = {None: self._roots[None]}
        self._heap = []
        self._expiries = []
        self.retained = {}
        self.retained_total = 0
        self._num_nodes = 0
        self._evictable = 0
        self._protected = 0
        for part in self._parts:
            part.reset()

    # ------------------------------------------------------------ inspection
    def _iter_nodes(self):
        """Every non-root node, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def export_nodes(
        self, max_label: int, salt: str | None = None, every_namespace: bool = True
    ) -> dict:
        """The tree's shape, read-only, exactly as the native twin gives it (explain
        and the dashboard read it, ``explain.TreeView``): nodes breadth first from the
        roots (the default namespace first, then salts in order), children by id.
        ``salts``: the namespaces that hold nodes; per node (arrays) ``parent`` (its
        parent's index, -1 under a root), ``namespace`` (index into ``salts``),
        ``node_id``, ``last_access``, ``lock_ref``, ``num_tokens`` (edge length) and
        the first ``max_label`` tokens of its edge (all when < 0) concatenated in
        ``labels``, node i's at ``label_offsets[i]:label_offsets[i + 1]``. Without
        ``every_namespace``, only ``salt``'s namespace."""
        if every_namespace:
            named = sorted((s, r) for s, r in self._roots.items() if s is not None)
            roots = [(None, self._roots[None]), *named]
        else:
            self._check_salt(salt)
            roots = [(salt, self._roots[salt])] if salt in self._roots else []
        salts: list[str | None] = []
        queue: list[tuple[RadixNode, int, int]] = []
        for name, root in roots:
            if root.children:
                ns = len(salts)
                salts.append(name)
                queue += [(c, -1, ns) for c in sorted(root.children.values(), key=_by_id)]
        cols: dict[str, list] = {k: [] for k in _EXPORT_COLUMNS}
        labels, offsets = [], [0]
        for i, (node, parent, ns) in enumerate(queue):  # the queue grows as it is read
            cols["parent"].append(parent)
            cols["namespace"].append(ns)
            cols["node_id"].append(node.node_id)
            cols["last_access"].append(node.last_access)
            cols["lock_ref"].append(node.lock_ref)
            cols["num_tokens"].append(len(node.key))
            labels.append(node.key if max_label < 0 else node.key[:max_label])
            offsets.append(offsets[-1] + len(labels[-1]))
            queue += [(c, i, ns) for c in sorted(node.children.values(), key=_by_id)]
        out: dict = {k: np.asarray(v, dtype=_EXPORT_COLUMNS[k]) for k, v in cols.items()}
        out["salts"] = salts
        out["labels"] = np.concatenate(labels) if labels else _EMPTY
        out["label_offsets"] = np.asarray(offsets, dtype=np.int64)
        return out

    def all_pages(self) -> np.ndarray:
        """Every page id the tree holds (for checks and tests)."""
        chunks = [n.pages for n in self._iter_nodes()]
        return np.concatenate(chunks) if chunks else _EMPTY

    def retention_stats(self) -> dict[str, int]:
        """What retention hints hold now, and their caps (the ``priority`` policy)."""
        self._apply_expiries()
        return {
            "retained_pages": self.retained_total,
            "retained_pages_max_tenant": max(self.retained.values(), default=0),
            "retained_tenants": len(self.retained),
            "max_retained_pages_tenant": self.max_retained_pages,
            "max_retained_pages_total": self.max_retained_total,
            "retention_clipped": self.retention_clipped,
        }

    def check(self) -> None:
        """Verify every invariant; raise AssertionError naming the first broken one."""
        self._apply_expiries()  # a hint that ran out since the last eviction changes keys
        check_tree(self)
        assert self.retained_total == sum(self.retained.values()), "retained pages miscounted"
        if self._parts:
            nodes = list(self._iter_nodes())
            for part in self._parts:
                part.check(nodes)

    def __repr__(self) -> str:
        return (
            f"RadixCache(page_size={self.page_size}, nodes={self._num_nodes}, "
            f"cached_pages={self.cached_pages}, protected_pages={self._protected})"
        )

"""KV cache events: what changed in the tree, as page keys a subscriber can mirror.

``KVEventRecorder`` wraps a prefix cache (the Python or the native tree: it only
calls the ``PrefixCache`` contract) and records, in order, the changes of the
tree's contents: pages stored by ``insert``, pages removed by ``evict``, and the
tree emptied (``reset``, or an eviction that took everything). The scheduler
process takes them after each step (``take()``) and publishes them
(``kv_publisher.py``); ``snapshot_rows()`` gives the whole tree for a subscriber
that lost track.

Why pages, not nodes: the tree splits and merges edges as it likes, but the set
of cached page-aligned prefixes only changes by insert and evict, and each
cached prefix is held by exactly one page. Ownership follows the insert
contract: after ``insert`` returns ``cached_len``, the tree owns the caller's
pages from ``cached_len // page_size`` on, and those are the new pages. Pages
freed by an eviction are the owned pages the allocator no longer counts as
allocated, so no tree internals are needed (a pool-sized bitmap test per evict).

Keys (docs/scale-out.md): a page's key is a SHA-256 chain over (salt, parent
key, page tokens)::

    key_0 = SHA256(tag(salt) || 0^32    || le32(tokens of page 0))
    key_i = SHA256(tag(salt) || key_i-1 || le32(tokens of page i))

``tag(None) = 0x00``, ``tag(s) = 0x01 || le32(len(utf8(s))) || utf8(s)``. Keys
depend on nothing but the tokens, the salt and the page size, so any process
that tokenizes a prompt the same way computes the same keys (never Python's
``hash``, which is salted per process).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

from radixserve.protocol import KEY_BYTES, KVEvent
from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.lora import split_namespace
from radixserve.scheduler.prefix_cache import CacheNode, PageFollower, PrefixCache

NO_PARENT = bytes(KEY_BYTES)


def salt_tag(salt: str | None) -> bytes:
    """The salt's prefix in every key: unambiguous (length-prefixed), None distinct."""
    if salt is None:
        return b"\x00"
    raw = salt.encode()
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def next_page_key(tag: bytes, parent: bytes, page: bytes) -> bytes:
    """One link of the chain: SHA-256 over (salt tag, parent key, the page's tokens as
    little-endian int32 bytes)."""
    return hashlib.sha256(tag + parent + page).digest()


def page_keys(
    tokens: np.ndarray | Sequence[int],
    page_size: int,
    salt: str | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """The keys of the whole pages of ``tokens``, chained from ``parent`` (None: the
    first page of a prompt)."""
    data = np.asarray(tokens, dtype="<i4").tobytes()
    step = 4 * page_size
    n = len(data) // step
    tag = salt_tag(salt)
    key = parent if parent is not None else NO_PARENT
    keys = []
    for i in range(n):
        key = next_page_key(tag, key, data[i * step : (i + 1) * step])
        keys.append(key)
    return keys


class KVEventRecorder(PageFollower):
    """A ``PrefixCache`` that records its changes (see the module docstring).

    The hot read-only calls (match, peek, lock, unlock) are the inner cache's
    bound methods, so recording adds no frame to them.
    """

    def __init__(self, inner: PrefixCache, allocator: PageAllocator) -> None:
        super().__init__(inner, allocator, "KV events")
        self.match_prefix = inner.match_prefix
        self.peek_prefix = inner.peek_prefix
        self.check = inner.check
        n, ps = allocator.num_pages, self.page_size
        # Per page the tree owns: its key, its parent's key, depth, salt, tokens.
        self._key = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        self._parent = np.zeros((n, KEY_BYTES), dtype=np.uint8)
        self._depth = np.zeros(n, dtype=np.int32)
        self._salt = np.zeros(n, dtype=np.int32)
        self._tokens = np.zeros((n, ps), dtype=np.int32)
        self._salts: list[str | None] = [None]
        self._salt_ids: dict[str | None, int] = {None: 0}
        self._events: list[KVEvent] = []
        # LoRA adapter digest -> (name, path), as the scheduler knows them (set by
        # ``Scheduler.record_kv_events``); what stored events and snapshots name.
        self.lora_info: Callable[[str], tuple[str, str] | None] = lambda digest: None
        self._loras: dict[str, tuple[str, str]] = {}

    # ------------------------------------------------------------ contract
    def insert(
        self, tokens: np.ndarray | Sequence[int], pages: np.ndarray, salt: str | None = None
    ) -> tuple[int, CacheNode]:
        cached_len, node = self.inner.insert(tokens, pages, salt)
        ps = self.page_size
        first, end = cached_len // ps, len(tokens) // ps
        if first < end:
            self._stored(np.asarray(tokens, dtype=np.int32), np.asarray(pages), first, end, salt)
        return cached_len, node

    def evict(self, num_pages: int) -> int:
        freed = self.inner.evict(num_pages)
        if freed:
            self._removed(self._gone())
        return freed

    def reset(self) -> None:
        self.inner.reset()
        self._owned[:] = False
        self._events.append(KVEvent("cleared"))

    # -------------------------------------------------------------- events
    @property
    def has_events(self) -> bool:
        """Whether changes wait to be taken."""
        return bool(self._events)

    def take(self) -> list[KVEvent]:
        """The changes since the last call, in order."""
        events, self._events = self._events, []
        return events

    def snapshot_loras(self) -> dict[str, list[str]]:
        """The adapters of the tree's salts: digest -> [name, path] (as first stored)."""
        digests = {split_namespace(s)[0] for s in self._salts} - {None}
        return {d: list(self._loras[d]) for d in digests if d in self._loras}

    def snapshot_rows(self) -> tuple[bytes, bytes, np.ndarray, list[str | None], np.ndarray]:
        """The whole tree, a row per page, parents first: keys, parent keys, salt
        ids, the salt table, tokens (``protocol.KVSnapshot``'s columns)."""
        rows = np.flatnonzero(self._owned)
        rows = rows[np.argsort(self._depth[rows], kind="stable")]
        return (
            self._key[rows].tobytes(),
            self._parent[rows].tobytes(),
            self._salt[rows].astype(np.int32),
            list(self._salts),
            self._tokens[rows].reshape(-1),
        )

    def _stored(
        self, tokens: np.ndarray, pages: np.ndarray, first: int, end: int, salt: str | None
    ) -> None:
        ps = self.page_size
        parent = self._parent_key(tokens, pages, first, salt)
        chunk = tokens[first * ps : end * ps]
        keys = page_keys(chunk, ps, salt, parent)
        new = pages[first:end].astype(np.int64)
        key_rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, KEY_BYTES)
        self._owned[new] = True
        self._key[new] = key_rows
        self._parent[new[0]] = np.frombuffer(parent or NO_PARENT, dtype=np.uint8)
        self._parent[new[1:]] = key_rows[:-1]
        self._depth[new] = np.arange(first, end, dtype=np.int32)
        self._salt[new] = self._salt_id(salt)
        self._tokens[new] = chunk.reshape(-1, ps)
        name = path = None
        digest, _ = split_namespace(salt)
        if digest is not None:
            info = self._loras.get(digest) or self.lora_info(digest)
            if info is not None:
                self._loras.setdefault(digest, info)
                name, path = info
        self._events.append(
            KVEvent("stored", b"".join(keys), parent, chunk.copy(), salt, name, path)
        )

    def _parent_key(
        self, tokens: np.ndarray, pages: np.ndarray, first: int, salt: str | None
    ) -> bytes | None:
        """The key of the tree's page before page ``first`` of this prompt.

        Usually that page is the caller's (it matched it, or inserted it before), so
        its key is recorded; when the caller holds a duplicate there instead, the
        chain is computed from the first page."""
        if first == 0:
            return None
        ps = self.page_size
        p = int(pages[first - 1])
        if (
            self._owned[p]
            and self._depth[p] == first - 1
            and self._salts[self._salt[p]] == salt
            and np.array_equal(self._tokens[p], tokens[(first - 1) * ps : first * ps])
        ):
            return self._key[p].tobytes()
        return page_keys(tokens[: first * ps], ps, salt)[-1]

    def _removed(self, gone: np.ndarray) -> None:
        if not len(gone):
            return
        if self.inner.cached_pages == 0:
            self._owned[:] = False
            self._events.append(KVEvent("cleared"))
            return
        gone = gone[np.argsort(-self._depth[gone], kind="stable")]  # deepest first
        self._events.append(KVEvent("removed", self._key[gone].tobytes()))

    def _salt_id(self, salt: str | None) -> int:
        sid = self._salt_ids.get(salt)
        if sid is None:
            sid = self._salt_ids[salt] = len(self._salts)
            self._salts.append(salt)
        return sid

    def __repr__(self) -> str:
        return f"KVEventRecorder({self.inner!r})"

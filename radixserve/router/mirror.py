"""A replica's tree, rebuilt from its KV events: which page keys it caches now.

``KVMirror`` applies ``KVEventBatch``es in sequence order and loads
``KVSnapshot``s. It keeps, per cached page key, the parent key, the salt and the
page's tokens, and per LoRA adapter name the namespace digest its pages are stored
under (``loras``, from stored events and snapshots: the router keys a request under
an adapter with it, docs/lora.md), so it can give back every cached prefix (``paths()``, what the
tests compare with the scheduler's tree) and answer the router's question: how
many leading pages of a prompt's key chain does this replica hold
(``match``)?

A batch that does not follow the last one applied (a gap in ``seq``, another
``epoch``: the scheduler restarted) or that does not fit the tree (a stored
page whose parent is unknown) is refused with ``MirrorOutOfSync``: the
subscriber then asks the replay socket for the missing batches or a snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixserve import protocol as P
from radixserve.scheduler.kv_events import NO_PARENT
from radixserve.scheduler.lora import namespace, split_namespace


class MirrorOutOfSync(Exception):
    """The mirror cannot apply a batch: it must be resynchronised (replay, snapshot)."""


@dataclass(frozen=True)
class MirrorPage:
    parent: bytes | None
    salt: str | None
    tokens: tuple[int, ...]


class KVMirror:
    def __init__(self) -> None:
        self.pages: dict[bytes, MirrorPage] = {}
        self.epoch: int | None = None
        self.seq = 0
        self.page_size: int | None = None
        self.load: dict = {}
        self.loras: dict[str, str] = {}  # adapter name -> the digest of its namespace

    @property
    def synced(self) -> bool:
        """Whether a snapshot or a first batch set the epoch (the mirror is usable)."""
        return self.epoch is not None

    def reset(self) -> None:
        self.pages.clear()
        self.epoch = None
        self.seq = 0

    # -------------------------------------------------------------- apply
    def apply(self, batch: P.KVEventBatch) -> None:
        """Apply the next batch; ``MirrorOutOfSync`` (nothing changed) if it is not
        the next one or does not fit."""
        if batch.schema != P.KV_EVENTS_SCHEMA:
            raise MirrorOutOfSync(f"unknown KV events schema {batch.schema}")
        if self.epoch is None and batch.seq == 1:
            self.epoch, self.page_size = batch.epoch, batch.page_size  # a fresh replica
        if batch.epoch != self.epoch:
            raise MirrorOutOfSync(f"epoch {batch.epoch}, mirror has {self.epoch}")
        if batch.seq != self.seq + 1:
            raise MirrorOutOfSync(f"batch {batch.seq} after {self.seq}")
        staged = dict(self.pages)  # all or nothing
        for ev in batch.events:
            _apply_event(staged, ev, self.page_size or batch.page_size)
        self.pages = staged
        for ev in batch.events:
            self._learn(ev.lora, ev.salt)
        self.seq = batch.seq
        self.load = batch.load

    def load_snapshot(self, snap: P.KVSnapshot) -> None:
        ps = snap.page_size
        keys = _split_keys(snap.hashes)
        parents = _split_keys(snap.parents)
        if not (len(keys) == len(parents) == len(snap.salt_ids) == len(snap.tokens) // ps):
            raise MirrorOutOfSync("a snapshot whose columns differ in length")
        if len(snap.salt_ids) and int(np.max(snap.salt_ids)) >= len(snap.salts):
            raise MirrorOutOfSync("a snapshot row names an unknown salt")
        tokens = snap.tokens.reshape(-1, ps).tolist() if len(keys) else []
        pages: dict[bytes, MirrorPage] = {}
        for key, parent, sid, toks in zip(keys, parents, snap.salt_ids.tolist(), tokens):
            par = None if parent == NO_PARENT else parent
            if par is not None and par not in pages:
                raise MirrorOutOfSync("a snapshot row before its parent")
            pages[key] = MirrorPage(par, snap.salts[sid], tuple(toks))
        self.pages = pages
        self.epoch, self.seq, self.page_size, self.load = snap.epoch, snap.seq, ps, snap.load
        for digest, (name, _path) in snap.loras.items():
            self.loras[name] = digest

    def _learn(self, lora: str | None, salt: str | None) -> None:
        digest, _ = split_namespace(salt)
        if lora is not None and digest is not None:
            self.loras[lora] = digest

    def salt_for(self, lora: str | None, cache_salt: str | None) -> str | None:
        """The tree salt of a request (``cache_salt`` under the adapter ``lora``) on this
        replica. For an adapter that has stored nothing here, a salt no page has (so
        nothing matches) that is still the same for every request under that name (so
        the router's prompts in flight group them)."""
        if lora is None:
            return cache_salt
        return namespace(cache_salt, self.loras.get(lora, f"unseen:{lora}"))

    # -------------------------------------------------------------- query
    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading pages of a prompt's key chain are cached here."""
        pages = self.pages
        n = 0
        for key in keys:
            if key not in pages:
                break
            n += 1
        return n

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    def paths(self) -> set[tuple[str | None, tuple[int, ...]]]:
        """Every cached page-aligned prefix as (salt, tokens): the tree's contents."""
        memo: dict[bytes, tuple[int, ...]] = {}

        def path(key: bytes) -> tuple[int, ...]:
            chain = []
            k: bytes | None = key
            while k is not None and k not in memo:
                chain.append(k)
                k = self.pages[k].parent
            prefix = memo[k] if k is not None else ()
            for c in reversed(chain):
                prefix = prefix + self.pages[c].tokens
                memo[c] = prefix
            return prefix

        return {(page.salt, path(key)) for key, page in self.pages.items()}


def _split_keys(data: bytes) -> list[bytes]:
    n = P.KEY_BYTES
    return [data[i : i + n] for i in range(0, len(data), n)]


def _apply_event(pages: dict[bytes, MirrorPage], ev: P.KVEvent, page_size: int) -> None:
    if ev.kind == "cleared":
        pages.clear()
        return
    keys = _split_keys(ev.hashes)
    if ev.kind == "removed":
        for key in keys:
            if pages.pop(key, None) is None:
                raise MirrorOutOfSync("removal of a page the mirror does not hold")
        return
    if len(ev.tokens) != len(keys) * page_size:
        raise MirrorOutOfSync("a stored event whose tokens do not fill its pages")
    parent = ev.parent
    if parent is not None and parent not in pages:
        raise MirrorOutOfSync("a stored page whose parent the mirror does not hold")
    toks = ev.tokens.reshape(-1, page_size).tolist() if keys else []
    for key, t in zip(keys, toks):
        pages[key] = MirrorPage(parent, ev.salt, tuple(t))
        parent = key

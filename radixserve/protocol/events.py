"""The KV cache events a server publishes (``--kv-events``) and its replay socket
answers: what a router follows to mirror each replica's tree (docs/scale-out.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from radixserve.protocol.wire import (
    I32,
    INT,
    KEY,
    KEYS,
    MAP,
    STR,
    Kind,
    Message,
    _is_float,
    _nested,
    _optional,
    f,
)

# ------------------------------------------- KV cache events (docs/scale-out.md)
# The schema of the events stream; raised when its meaning changes (a subscriber
# refuses batches of a schema it does not know).
KV_EVENTS_SCHEMA = 1
KV_EVENT_KINDS = ("stored", "removed", "cleared")
FLOAT = Kind("a number", _is_float, float)
SALTS = Kind(
    "a list of strings or nulls",
    lambda x: isinstance(x, list) and all(i is None or isinstance(i, str) for i in x),
)


@dataclass
class KVEvent(Message):
    """One change of a replica's tree, in order.

    ``stored``: pages now cached, a chain: ``hashes[0]``'s parent is ``parent``
    (null: the first page of a prompt), each next page's parent the one before;
    ``tokens`` holds ``page_size`` tokens per page; ``salt`` the cache salt (under a
    LoRA adapter: its namespace, ``scheduler/lora.py``), and then ``lora`` and
    ``lora_path`` the adapter's name and folder (docs/lora.md).
    ``removed``: pages evicted (``hashes``), deepest first; a removed page's
    descendants are removed in the same event or before. ``cleared``: the tree is
    empty (a flush, or an eviction that took everything).
    """

    kind: str = f(Kind(f"one of {KV_EVENT_KINDS}", lambda x: x in KV_EVENT_KINDS))
    hashes: bytes = f(KEYS, b"")
    parent: bytes | None = f(_optional(KEY), None)
    tokens: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    salt: str | None = f(_optional(STR), None)
    lora: str | None = f(_optional(STR), None)
    lora_path: str | None = f(_optional(STR), None)


@dataclass
class KVEventBatch(Message):
    """What one scheduler step (or a flush) changed in the tree (PUB, one frame).

    ``seq`` counts batches from 1 per ``epoch`` (a random number drawn at each start
    of the scheduler: a new epoch means a new, empty tree). ``load``: running,
    waiting, pages_free, pages_evictable, num_pages at the time of the batch.
    There is no batch-level salt: one step serves requests of many salts, so each
    ``stored`` event names its own, and every key hashes its salt in, so a
    ``removed`` key needs none (``salt`` is null on ``removed`` and ``cleared``)."""

    TYPE: ClassVar[str] = "kv_events"
    replica: str = f(STR)
    epoch: int = f(INT)
    seq: int = f(INT)
    ts: float = f(FLOAT)
    page_size: int = f(INT)
    events: list[KVEvent] = f(_nested(KVEvent), [])
    load: dict = f(MAP, {})
    schema: int = f(INT, KV_EVENTS_SCHEMA)


@dataclass
class KVHeartbeat(Message):
    """Sent (PUB) when no batch went out for a while: the last ``seq`` and the load.
    A subscriber behind ``seq`` lost a batch and asks for a replay."""

    TYPE: ClassVar[str] = "kv_heartbeat"
    replica: str = f(STR)
    epoch: int = f(INT)
    seq: int = f(INT)
    ts: float = f(FLOAT)
    page_size: int = f(INT)
    load: dict = f(MAP, {})
    schema: int = f(INT, KV_EVENTS_SCHEMA)


@dataclass
class KVReplay(Message):
    """Subscriber -> the replay socket: every batch after ``since`` (-1: a snapshot)."""

    TYPE: ClassVar[str] = "kv_replay"
    since: int = f(INT)


@dataclass
class KVBatches(Message):
    """The replay socket's answer when it still holds every batch after ``since``."""

    TYPE: ClassVar[str] = "kv_batches"
    batches: list[KVEventBatch] = f(_nested(KVEventBatch))


@dataclass
class KVSnapshot(Message):
    """The whole tree as of batch ``seq``, one row per page, parents before children
    (the replay socket's answer when ``since`` is older than its buffer): row i is
    the page with key ``hashes[i]``, parent key ``parents[i]`` (32 zero bytes: none),
    cache salt ``salts[salt_ids[i]]`` and tokens ``tokens[i*page_size:(i+1)*page_size]``.
    ``loras``: the LoRA adapters of the salts that are adapter namespaces, digest ->
    ``[name, path]``."""

    TYPE: ClassVar[str] = "kv_snapshot"
    replica: str = f(STR)
    epoch: int = f(INT)
    seq: int = f(INT)
    ts: float = f(FLOAT)
    page_size: int = f(INT)
    hashes: bytes = f(KEYS, b"")
    parents: bytes = f(KEYS, b"")
    salt_ids: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    salts: list = f(SALTS, [])
    tokens: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    load: dict = f(MAP, {})
    schema: int = f(INT, KV_EVENTS_SCHEMA)
    loras: dict = f(MAP, {})


KV_STREAM = {c.TYPE: c for c in (KVEventBatch, KVHeartbeat)}
KV_REPLAY_REPLIES = {c.TYPE: c for c in (KVBatches, KVSnapshot)}

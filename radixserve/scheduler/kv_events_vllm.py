"""KV cache events in vLLM's wire format (``--kv-events-format vllm``).

A consumer written for vLLM's ``vllm.distributed.kv_events`` (a prefix-cache-aware
router or scheduler) reads a radixserve replica unchanged. What vLLM (0.32) sends,
and so what this module produces:

* PUB, three frames per batch: the topic (``--kv-events-topic``, default empty),
  the sequence number as 8 bytes big-endian (from 0), and the payload;
* the payload: msgpack of ``KVEventBatch``, an array-like struct
  ``[ts, events, data_parallel_rank]``; each event a map tagged by ``type``:
  ``BlockStored`` {block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name[, extra_keys], group_idx}, ``BlockRemoved``
  {block_hashes, medium, group_idx}, ``AllBlocksCleared`` {} (msgspec omits a
  field left at its default; ``lora_id``, ``medium`` and ``lora_name`` have none);
* block hashes as vLLM's default (``--prefix-caching-hash-algo sha256``)
  computes them: ``sha256(pickle((parent, tuple(block tokens), extra_keys)))``
  chained from ``NONE_HASH = sha256(pickle(seed))``, the seed being
  ``PYTHONHASHSEED`` when set, else ``"vllm-none-hash"``; a request's
  ``cache_salt`` is the extra key ``("cache_salt", salt)`` of the prompt's first
  block only, and is published in that block's ``extra_keys`` entry as ``(salt,)``;
  a request under a LoRA adapter has the extra key ``("lora", name, path)`` on every
  block, before the salt's, published as ``name`` (and the event's ``lora_name``;
  ``lora_id``, which vLLM keeps only for compatibility, stays null). radixserve's
  namespace is the adapter's content, vLLM's its name and path: the KV of two names
  for the same weights is published under the name it was stored with.
  (The hashed input is plain ints, bytes and strings, pickled only to hash them.)
* the replay socket (ROUTER): a request ``[b"", start seq (8 bytes BE)]`` gets
  every buffered batch from that seq as ``[b"", seq, payload]``, then
  ``[b"", -1 (8 bytes BE, signed), b""]``. vLLM has no snapshot and no
  heartbeat: a consumer that missed more than the buffer holds starts over.

One radixserve page is one vLLM block (``block_size`` = ``--page-size``); the
events map one to one (a ``stored`` chain is one ``BlockStored``). radixserve's own
page keys stay what the tree and the recorder use; ``VllmEncoder`` keeps the
vLLM hash of every cached page beside its key, so a chain's parent hash and a
removal's hashes are looked up, not recomputed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from radixserve import protocol as P
from radixserve.scheduler.kv_publisher import KVEventLog, KVEventPublisher
from radixserve.scheduler.lora import split_namespace

log = logging.getLogger("radixserve.scheduler")

DEFAULT_SEED = "vllm-none-hash"
MEDIUM = "GPU"  # the name vLLM gives its primary block pool, on every device
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER = 10_000  # batches kept for replay (vLLM's default buffer_steps)


def sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(seed: str | None = None) -> bytes:
    """vLLM's hash before a prompt's first block (``PYTHONHASHSEED`` when set)."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)
    return sha256_pickle(seed)


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    parent: bytes | None,
    salt: str | None,
    seed_hash: bytes,
    lora: tuple[str, str] | None = None,
) -> list[bytes]:
    """vLLM's hashes of the whole blocks of ``tokens``, chained from ``parent`` (None:
    they start the prompt, and the salt is the first block's extra key); ``lora``:
    the adapter's (name, path), every block's first extra key."""
    toks = [int(t) for t in np.asarray(tokens).reshape(-1)]
    out = []
    h = seed_hash if parent is None else parent
    for i in range(len(toks) // block_size):
        keys = [("lora", *lora)] if lora else []
        if parent is None and i == 0 and salt:
            keys.append(("cache_salt", salt))
        extra = tuple(keys) if keys else None
        h = sha256_pickle((h, tuple(toks[i * block_size : (i + 1) * block_size]), extra))
        out.append(h)
    return out


class VllmEncoder:
    """radixserve's ``KVEventBatch`` -> vLLM's payload, one replica's stream in order."""

    def __init__(self, seed_hash: bytes | None = None, data_parallel_rank: int = 0) -> None:
        self.seed_hash = none_hash() if seed_hash is None else seed_hash
        self.rank = data_parallel_rank
        self.hashes: dict[bytes, bytes] = {}  # radixserve page key -> vLLM block hash

    def encode(self, batch: P.KVEventBatch) -> bytes:
        events = [self._event(ev, batch.page_size) for ev in batch.events]
        return msgpack.packb([batch.ts, events, self.rank], use_bin_type=True)

    def _event(self, ev: P.KVEvent, block_size: int) -> dict:
        keys = [ev.hashes[i : i + P.KEY_BYTES] for i in range(0, len(ev.hashes), P.KEY_BYTES)]
        if ev.kind == "cleared":
            self.hashes.clear()
            return {"type": "AllBlocksCleared"}
        if ev.kind == "removed":
            gone = [self.hashes.pop(k) for k in keys]
            return {"type": "BlockRemoved", "block_hashes": gone, "medium": MEDIUM, "group_idx": 0}
        parent = None if ev.parent is None else self.hashes[ev.parent]
        digest, salt = split_namespace(ev.salt)  # the adapter's, the client's cache_salt
        lora = (ev.lora or digest, ev.lora_path or "") if digest is not None else None
        hashes = block_hashes(ev.tokens, block_size, parent, salt, self.seed_hash, lora)
        self.hashes.update(zip(keys, hashes))
        stored = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": ev.tokens.tolist(),
            "block_size": block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None if lora is None else lora[0],
        }
        if lora is not None:
            first = (lora[0], salt) if parent is None and salt else (lora[0],)
            stored["extra_keys"] = [first] + [(lora[0],)] * (len(hashes) - 1)
        elif parent is None and salt:
            stored["extra_keys"] = [(salt,)] + [None] * (len(hashes) - 1)
        stored["group_idx"] = 0
        return stored


class VllmKVEventPublisher(KVEventPublisher):
    """The PUB and replay sockets speaking vLLM's protocol (module docstring)."""

    def __init__(
        self,
        ctx: zmq.Context,
        log_: KVEventLog,
        endpoint: str,
        replay_endpoint: str | None = None,
        curve: tuple[bytes, bytes] | None = None,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_size: int = DEFAULT_BUFFER,
    ) -> None:
        super().__init__(ctx, log_, endpoint, replay_endpoint, curve)
        self.encoder = VllmEncoder(data_parallel_rank=data_parallel_rank)
        self.topic = topic.encode()
        self.seq = -1  # vLLM numbers batches from 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)

    def publish(self, load: dict) -> None:
        """Send the step's batch, if the tree changed (vLLM sends no heartbeats)."""
        batch = self.log.next_batch(load)
        if batch is None:
            return
        payload = self.encoder.encode(batch)
        self.seq += 1
        self.buffer.append((self.seq, payload))
        self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    def serve_replays(self, load: dict) -> None:
        """Answer every waiting replay request: the batches from its seq, then the end."""
        for frames in self.replay_requests():
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.info("kv replay: refused a request of %d frames", len(frames))
                continue
            peer, start = frames[0], int.from_bytes(frames[2], "big")
            # A subscriber that left asks again when it comes back.
            with contextlib.suppress(zmq.ZMQError):
                for seq, payload in self.buffer:
                    if seq >= start:
                        self.replay.send_multipart(
                            [peer, b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK
                        )
                self.replay.send_multipart([peer, b"", END_SEQ, b""], zmq.NOBLOCK)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "kv_events_format": "vllm",
            "kv_events_topic": self.topic.decode(),
            "kv_events_seq": self.seq,
        }

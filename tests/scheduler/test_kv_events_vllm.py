"""KV events in vLLM's wire format, decoded with a schema written from vLLM's fields.

The schema below is vLLM 0.32's (``vllm/distributed/kv_events.py``), restated with
msgspec as vLLM declares it (tests cannot import vLLM): an array-like batch, events
as maps tagged by ``type``, defaults omitted. Re-encoding a decoded payload with
it must give the very bytes radixserve sent. The hashes are checked against a
chain computed here the way vLLM's ``hash_block_tokens`` does, and a consumer that
only reads these events must hold exactly the blocks of the scheduler's tree.
"""

from __future__ import annotations

import hashlib
import pickle
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from radixserve import protocol as P
from radixserve.router.mirror import KVMirror
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_events_vllm import (
    END_SEQ,
    VllmEncoder,
    VllmKVEventPublisher,
    block_hashes,
    none_hash,
)
from radixserve.scheduler.kv_publisher import KVEventLog
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.sim_worker import SimWorker
from tests.scheduler.test_kv_events import VOCAB, check_mirror, drive, workloads


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def decode_exact(payload: bytes) -> KVEventBatch:
    batch = DECODER.decode(payload)
    assert msgspec.msgpack.encode(batch) == payload, "not byte for byte what vLLM encodes"
    return batch


def vllm_chain(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """vLLM's hash_block_tokens over a whole prompt, with the sha256 (pickle) algorithm."""
    h = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    out = []
    for i in range(len(tokens) // block_size):
        extra = (("cache_salt", salt),) if (i == 0 and salt) else None
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        h = hashlib.sha256(pickle.dumps((h, block, extra), protocol=pickle.HIGHEST_PROTOCOL))
        h = h.digest()
        out.append(h)
    return out


def test_hashes_chain_as_vllm_computes_them(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    toks = list(range(5, 17))
    for salt in (None, "tenant"):
        assert block_hashes(toks, 4, None, salt, none_hash()) == vllm_chain(toks, 4, salt)
        whole = vllm_chain(toks, 4, salt)
        assert block_hashes(toks[4:], 4, whole[0], salt, none_hash()) == whole[1:]
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert none_hash() == hashlib.sha256(pickle.dumps("7", protocol=5)).digest()


class Consumer:
    """A vLLM-events consumer: the set of blocks a replica holds, by hash."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    del self.blocks[h]
            else:
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.blocks
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    toks = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                    self.blocks[h] = (parent, toks)
                    parent = h


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_a_vllm_consumer_holds_exactly_the_trees_blocks(w):
    cfg = SchedulerConfig(
        num_pages=w["num_pages"], page_size=w["page_size"], max_context_len=4096,
        eos_token_ids=(2,), radix_impl=w["impl"], max_running_requests=w["slots"],
        chunked_prefill_size=max(16, w["page_size"]),
    )  # fmt: skip
    sched = Scheduler(cfg)
    log = KVEventLog(sched.record_kv_events(), "r0", epoch=7)
    worker = SimWorker(cfg.num_pages, cfg.page_size, cfg.max_running_requests, VOCAB)
    encoder = VllmEncoder(seed_hash=none_hash("vllm-none-hash"))
    mirror, consumer = KVMirror(), Consumer()

    def publish():
        batch = log.next_batch({})
        if batch is None:
            return
        mirror.apply(batch)
        consumer.apply(decode_exact(encoder.encode(batch)))
        check_mirror(sched, mirror)
        want = {vllm_chain(list(toks), w["page_size"], salt)[-1] for salt, toks in mirror.paths()}
        assert set(consumer.blocks) == want
        assert set(encoder.hashes.values()) == want and len(encoder.hashes) == len(want)

    drive(sched, worker, w, publish)
    sched.check_idle()


def test_a_stored_event_names_its_salt_only_on_a_prompts_first_block():
    encoder = VllmEncoder(seed_hash=none_hash("vllm-none-hash"))
    keys = b"".join(bytes([i]) * P.KEY_BYTES for i in (1, 2, 3))
    first = P.KVEvent("stored", keys[:64], None, np.arange(8, dtype=np.int32), "t1")
    more = P.KVEvent("stored", keys[64:], keys[32:64], np.arange(8, 12, dtype=np.int32), "t1")
    batch = P.KVEventBatch("r", 1, 1, 12.5, 4, [first, more], {})
    got = decode_exact(encoder.encode(batch))
    assert got.ts == 12.5 and got.data_parallel_rank == 0
    a, b = got.events
    assert a.extra_keys == [("t1",), None] and a.parent_block_hash is None
    assert b.extra_keys is None and b.parent_block_hash == a.block_hashes[1]
    assert a.block_hashes + b.block_hashes == vllm_chain(list(range(12)), 4, "t1")
    assert (a.medium, a.lora_id, a.lora_name, a.group_idx) == ("GPU", None, None, 0)
    gone = P.KVEventBatch("r", 1, 2, 13.0, 4, [P.KVEvent("removed", keys[64:])], {})
    (removed,) = decode_exact(encoder.encode(gone)).events
    assert removed.block_hashes == b.block_hashes and removed.medium == "GPU"


@pytest.mark.timeout(60)
def test_publisher_speaks_vllms_pub_and_replay_protocol():
    sched = Scheduler(SchedulerConfig(num_pages=256, page_size=4, max_context_len=512))
    log = KVEventLog(sched.record_kv_events(), "r0")
    ctx = zmq.Context()
    pub = VllmKVEventPublisher(ctx, log, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="kv")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    time.sleep(0.3)  # the PUB drops what a subscriber not yet joined would get
    worker = SimWorker(256, 4, sched.config.max_running_requests, VOCAB)
    for i in range(3):
        sp = SamplingParams(max_tokens=2, temperature=0.0)
        sched.add_request(f"r{i}", [5, 6, 7, 8, 9, 10, 11, 12, 13 + i], sp)
        while sched.has_work():
            sched.step(worker.step)
            pub.publish({})
    seen = []
    while sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        seen.append((int.from_bytes(seq, "big"), decode_exact(payload)))
        if seen[-1][0] == pub.seq:
            break
    assert [s for s, _ in seen] == list(range(pub.seq + 1))  # numbered from 0
    req = ctx.socket(zmq.DEALER)
    req.connect(pub.replay_endpoint)
    req.send_multipart([b"", (1).to_bytes(8, "big")])
    replies = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pub.serve_replays({})
        if req.poll(50):
            replies.append(req.recv_multipart())
            if replies[-1][1] == END_SEQ:
                break
    assert replies[-1] == [b"", END_SEQ, b""]
    assert [int.from_bytes(r[1], "big") for r in replies[:-1]] == list(range(1, pub.seq + 1))
    assert [r[2] for r in replies[:-1]] == [p for s, p in pub.buffer if s >= 1]
    pub.close()
    ctx.destroy(linger=0)

"""The router follows a replica that speaks vLLM's KV events.

In one process: a scheduler on the simulated worker publishing in vLLM's format
(``VllmKVEventPublisher``), and ``VllmEventFollower``s that translate what they
receive into the router's mirror. A follower that joins late rebuilds the tree
from the replay buffer; one that misses batches (they are dropped before it reads
them) catches up from the replay socket; after a restart (seq from 0 again) the
mirror starts over. Every mirror must hold exactly the tree's cached prefixes.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from radixserve.router.events_vllm import VllmEventFollower
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_events_vllm import VllmKVEventPublisher
from radixserve.scheduler.kv_publisher import KVEventLog
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.sim_worker import SimWorker
from tests.scheduler.test_kv_events import check_mirror


def pump(pub, followers, until=lambda: False, seconds=3.0):
    """Serve replays and let the followers read, for ``seconds`` or until ``until()``."""
    poller = zmq.Poller()
    for f in followers:
        for s in f.sockets():
            poller.register(s, zmq.POLLIN)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not until():
        pub.serve_replays({})
        for sock, _ in poller.poll(20):
            for f in followers:
                if sock in f.sockets():
                    f.on_readable(sock)
        for f in followers:
            f.tick()
            for s in f.sockets():  # a re-ask opens a fresh replay socket
                poller.register(s, zmq.POLLIN)


@pytest.mark.timeout(120)
def test_followers_mirror_a_vllm_format_replica():
    cfg = SchedulerConfig(num_pages=64, page_size=4, max_context_len=512, eos_token_ids=(2,),
                          max_running_requests=2, chunked_prefill_size=16)  # fmt: skip
    sched = Scheduler(cfg)
    worker = SimWorker(cfg.num_pages, cfg.page_size, cfg.max_running_requests, 64)
    ctx = zmq.Context()
    pub = VllmKVEventPublisher(ctx, KVEventLog(sched.record_kv_events(), "r0"),
                               "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic="t")  # fmt: skip
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 64, 24).tolist()

    def run(n, salt=None, start=0):
        for i in range(n):
            sp = SamplingParams(max_tokens=3, temperature=0.0)
            prompt = shared[: int(rng.integers(4, 24))] + rng.integers(3, 64, 5).tolist()
            sched.add_request(f"q{start + i}", prompt, sp, salt=salt)
            while sched.has_work():
                sched.step(worker.step)
                pub.publish({})

    run(6)  # published before any follower exists: only the replay buffer has it
    early = VllmEventFollower(ctx, "early", pub.endpoint, pub.replay_endpoint, topic="t")
    pump(pub, [early], until=lambda: early.last == pub.seq)
    check_mirror(sched, early.mirror)
    assert early.mirror.num_pages == sched.cache.cached_pages > 0

    lossy = VllmEventFollower(ctx, "lossy", pub.endpoint, pub.replay_endpoint, topic="t")
    pump(pub, [early, lossy], until=lambda: lossy.last == pub.seq)
    time.sleep(0.3)  # both subscribed
    run(8, salt="tenant", start=100)  # evictions too: 64 pages are tight
    lossy.sub.close(0)  # lossy misses everything published meanwhile ...
    run(4, start=200)
    lossy.sub = ctx.socket(zmq.SUB)
    lossy.sub.setsockopt(zmq.SUBSCRIBE, b"t")
    lossy.sub.connect(pub.endpoint)
    time.sleep(0.3)
    run(1, start=300)  # ... and sees a gap at the next batch: it replays
    pump(pub, [early, lossy], until=lambda: early.last == lossy.last == pub.seq)
    for f in (early, lossy):
        check_mirror(sched, f.mirror)
    assert lossy.resyncs >= 2

    sched.flush_cache()  # AllBlocksCleared
    pub.publish({})
    pump(pub, [early], until=lambda: early.last == pub.seq)
    assert early.mirror.num_pages == 0

    for f in (early, lossy):
        f.close()
    pub.close()
    ctx.destroy(linger=0)


def test_a_restart_numbering_from_zero_again_empties_the_mirror():
    ctx = zmq.Context()
    f = VllmEventFollower(ctx, "r", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9")
    f.pending_since = None  # no replay socket answers here
    stored = {"type": "BlockStored", "block_hashes": [b"h1"], "parent_block_hash": None,
              "token_ids": [1, 2], "block_size": 2, "lora_id": None, "medium": "GPU",
              "lora_name": None, "group_idx": 0}  # fmt: skip
    f._on_stream(0, msgpack.packb([1.0, [stored], 0]))
    f._on_stream(1, msgpack.packb([2.0, [{**stored, "block_hashes": [b"h2"],
                                          "token_ids": [3, 4]}], 0]))  # fmt: skip
    assert f.mirror.num_pages == 2 and f.last == 1
    f._on_stream(0, msgpack.packb([3.0, [{**stored, "token_ids": [7, 8]}], 0]))
    assert f.mirror.paths() == {(None, (7, 8))} and f.last == 0
    f.close()
    ctx.destroy(linger=0)

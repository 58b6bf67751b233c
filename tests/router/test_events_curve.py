"""KV events beyond loopback: CURVE on the PUB and replay sockets.

In one process, as the scheduler and the router wire them: a ``ZapHandler`` with
the allowed client keys, a ``KVEventPublisher`` bound to every interface with the
server's secret certificate, and ``EventFollower`` subscribers. The one holding an
allowed key mirrors the tree (snapshot, then the stream); one without CURVE and
one with a key the server does not allow receive nothing, neither stream nor
replay, while the same batches reach the first. A non-loopback events address
without keys is refused before anything starts.
"""

from __future__ import annotations

import time

import pytest
import zmq

from radixserve.client.common import curve_keys
from radixserve.curve import load_allowed_keys, load_secret_certificate, write_keys
from radixserve.launch import LaunchError, check_kv_events
from radixserve.router.events import EventFollower
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_publisher import KVEventLog, KVEventPublisher
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.sim_worker import SimWorker
from radixserve.zap import ZapHandler


def test_events_with_curve_reach_allowed_keys_only(tmp_path):
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    keys = tmp_path / "keys"
    write_keys(keys, ["router"], True)
    cfg = SchedulerConfig(num_pages=24, page_size=4, max_context_len=512, eos_token_ids=(2,),
                          max_running_requests=2, chunked_prefill_size=16)  # fmt: skip
    sched = Scheduler(cfg)
    worker = SimWorker(cfg.num_pages, cfg.page_size, cfg.max_running_requests, 64)
    log = KVEventLog(sched.record_kv_events(), "r0")

    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    zap = ZapHandler(server_ctx, load_allowed_keys(keys / "clients"))
    publisher = KVEventPublisher(server_ctx, log, "tcp://0.0.0.0:0", None,
                                 load_secret_certificate(keys / "server.key_secret"))  # fmt: skip
    ep, replay = (e.replace("0.0.0.0", "127.0.0.1")
                  for e in (publisher.endpoint, publisher.replay_endpoint))  # fmt: skip
    stranger = zmq.curve_keypair()
    followers = {
        "allowed": EventFollower(client_ctx, "allowed", ep, replay,
                                 curve_keys(keys / "server.key", keys / "router.key_secret")),
        "plain": EventFollower(client_ctx, "plain", ep, replay, None),
        "stranger": EventFollower(client_ctx, "stranger", ep, replay,
                                  curve_keys(keys / "server.key", stranger)),
    }  # fmt: skip
    load = {"running": 0, "waiting": 0}

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            zap.handle()
            publisher.serve_replays(load)
            for f in followers.values():
                for s in f.sockets():
                    f.on_readable(s)
            time.sleep(0.005)

    try:
        good = followers["allowed"].mirror
        deadline = time.monotonic() + 20
        while not good.synced:  # the first snapshot: an empty tree
            pump(0.05)
            assert time.monotonic() < deadline, "the allowed subscriber never synced"
        pump(0.3)  # the SUB's handshake too, before anything is published
        for i in range(3):
            prompt = [10 + i, 11, 12, 13, 14, 15, 16, 17, 18, 19]
            sched.add_request(f"q{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0))
        while sched.has_work():
            sched.step(worker.step)
            publisher.publish(load)
            pump(0.02)
        while good.seq != log.seq:
            pump(0.05)
            assert time.monotonic() < deadline, "the allowed subscriber missed batches"
        assert log.seq > 0 and good.num_pages == sched.cache.cached_pages > 0
        pump(1.2)  # a heartbeat goes out meanwhile; the others had every chance
        for name in ("plain", "stranger"):
            m = followers[name].mirror
            assert not m.synced and m.seq == 0 and m.num_pages == 0 and not m.load, name
    finally:
        for f in followers.values():
            f.close()
        publisher.close()
        zap.socket.close(0)
        client_ctx.term()
        server_ctx.term()


def test_a_public_events_address_needs_keys():
    with pytest.raises(LaunchError, match="needs CURVE keys"):
        check_kv_events("tcp://0.0.0.0:30100", None, curve=False)
    with pytest.raises(LaunchError, match="needs CURVE keys"):
        check_kv_events("tcp://127.0.0.1:30100", "tcp://10.1.2.3:30101", curve=False)
    check_kv_events("tcp://0.0.0.0:30100", None, curve=True)
    check_kv_events("tcp://127.0.0.1:30100", None, curve=False)

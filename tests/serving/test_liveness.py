"""Hostile routing ids, a killed launcher, a hung worker, a dead or stopped tokenizer:
the server survives what it can, and otherwise fails fast and leaves nothing behind.

Each test here but the first two launches its own server (they end it on purpose).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from radixserve.client import AsyncClient, Client, ConnectionLost, ServerError
from tests.helpers.server import Server
from tests.serving.conftest import SERVER_ARGS

LONG = {"max_tokens": 500, "ignore_eos": True, "temperature": 0.0}  # outlasts every wait here

# The first automatic routing id a ROUTER gives in a fresh process whose C library's
# rand() nobody seeded: what libzmq gives on every start unless the server prevents it.
FIRST_AUTO_ID = """
import zmq
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
port = router.bind_to_random_port("tcp://127.0.0.1")
dealer = ctx.socket(zmq.DEALER)
dealer.connect(f"tcp://127.0.0.1:{port}")
dealer.send(b"x")
print(router.recv_multipart()[0].hex())
"""


def admin(kind: str) -> bytes:
    return msgpack.packb({"type": kind, "v": 1, "id": kind})


@pytest.fixture(scope="module")
def victim(model_dir):
    """A server of its own: the last test of the module SIGKILLs its launcher."""
    srv = Server(model_dir, *SERVER_ARGS)
    yield srv
    srv.stop()
    assert srv.wait_orphans_gone() == []


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def dealer(ctx: zmq.Context, endpoint: str, routing_id: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)  # liveness only
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.connect(endpoint)
    return sock


@pytest.mark.timeout(120)
def test_peers_claiming_the_automatic_ids_cannot_crash_the_server(victim, zctx):
    out = subprocess.check_output([sys.executable, "-c", FIRST_AUTO_ID], text=True)
    start = int(out.strip()[2:], 16)
    claimers = []
    for i in range(32):
        claimed = b"\0" + ((start + i) % 2**32).to_bytes(4, "big")
        claimers.append(dealer(zctx, victim.endpoint, claimed))
        claimers[-1].send(admin("stats"))
    for sock in claimers:  # each connection is identified once the server answers it
        assert msgpack.unpackb(sock.recv())["type"] == "reply"
    anonymous = dealer(zctx, victim.endpoint)  # gets an automatic id
    anonymous.send(admin("health"))
    assert msgpack.unpackb(anonymous.recv())["type"] == "reply"
    with Client(victim.endpoint, timeout=60) as c:
        assert c.health()["status"] == "ok"
    assert victim.proc.poll() is None


@pytest.mark.timeout(120)
def test_a_peer_reusing_a_connected_id_is_refused_and_the_first_keeps_working(victim, zctx):
    first = dealer(zctx, victim.endpoint, b"taken-id")
    first.send(admin("stats"))
    assert msgpack.unpackb(first.recv())["type"] == "reply"
    second = dealer(zctx, victim.endpoint, b"taken-id")
    second.send(admin("stats"))
    assert not second.poll(1000), "the second peer with the id must not be served"
    first.send(admin("health"))
    assert msgpack.unpackb(first.recv())["type"] == "reply"  # nor take the first's replies
    assert not second.poll(200)
    assert victim.proc.poll() is None


@pytest.mark.timeout(120)
def test_sigkill_of_the_launcher_fails_requests_and_leaves_nothing_behind(victim):
    """Its children notice (PR_SET_PDEATHSIG and a parent check), the tokenizer fails the
    request in flight, every child exits, and the last removes the run dir."""
    with Client(victim.endpoint, timeout=60) as c:
        stream = c.generate_stream(input_ids=[5, 6, 7], **LONG)
        next(stream)
        os.kill(victim.proc.pid, signal.SIGKILL)
        with pytest.raises(ServerError, match="launcher"):
            for _ in stream:
                pass
    assert victim.wait_orphans_gone(20) == []


@pytest.mark.timeout(120)
def test_exit_with_parent_stops_the_server_when_its_parent_dies(model_dir):
    middle = [sys.executable, "-c", "import subprocess, sys; subprocess.call(sys.argv[1:])"]
    srv = Server(model_dir, *SERVER_ARGS, wrapper=middle)  # the helper passes the flag
    launcher = srv.launcher_pid()
    assert launcher != srv.proc.pid
    srv.proc.kill()  # the launcher's parent dies
    srv.proc.wait()
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{launcher}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.wait_orphans_gone(20) == []
    assert not os.path.exists(f"/proc/{launcher}") or _zombie(launcher)


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.timeout(120)
def test_watchdog_fails_requests_when_the_worker_stops(model_dir):
    srv = Server(model_dir, *SERVER_ARGS, "--watchdog-timeout", "2")
    try:
        with Client(srv.endpoint, timeout=60) as c:
            stream = c.generate_stream(input_ids=[5, 6, 7], **LONG)
            next(stream)
            os.kill(srv.pids["worker"], signal.SIGSTOP)
            with pytest.raises(ServerError, match="watchdog-timeout"):
                for _ in stream:
                    pass
        assert srv.wait(40) == 1
    finally:
        srv.stop()
    assert srv.wait_orphans_gone() == []


@pytest.mark.timeout(180)
def test_clients_notice_a_stopped_then_dead_tokenizer_within_seconds(model_dir):
    """A stopped tokenizer stops answering heartbeats; a dead one closes the connection.
    Either way pending requests fail with ConnectionLost long before their timeout."""
    srv = Server(model_dir, *SERVER_ARGS)
    try:
        with Client(srv.endpoint, timeout=120) as c:
            stream = c.generate_stream(input_ids=[5, 6, 7], **LONG)
            next(stream)

            async def pending_async() -> float:
                async with AsyncClient(srv.endpoint, timeout=120) as ac:
                    await ac.health()
                    t0 = time.monotonic()
                    with pytest.raises(ConnectionLost):
                        await ac.generate(input_ids=[8, 9], **LONG)
                    return time.monotonic() - t0

            loop = asyncio.new_event_loop()
            task = loop.create_task(pending_async())
            loop.run_until_complete(asyncio.sleep(0.5))  # its request is in flight
            os.kill(srv.pids["tokenizer"], signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(ConnectionLost, match="lost the server"):
                for _ in stream:
                    pass
            assert time.monotonic() - t0 < 60  # liveness bound only: the timeout is 120 s
            assert loop.run_until_complete(task) < 60
            loop.close()
            with pytest.raises(ConnectionLost):  # still down: a new request fails at once
                c.generate(input_ids=[5, 6], max_tokens=2)
        os.kill(srv.pids["tokenizer"], signal.SIGKILL)
        assert srv.wait(40) == 1
    finally:
        srv.stop()
    assert srv.wait_orphans_gone() == []


@pytest.mark.timeout(120)
def test_sigkill_of_the_scheduler_fails_plain_and_streaming_requests_in_flight(model_dir):
    """Nothing answers for a dead scheduler: the launcher notices, the tokenizer fails
    both requests (the plain one has no chunk to lose) at once, and nothing is left."""
    srv = Server(model_dir, *SERVER_ARGS)
    errors: dict[str, tuple[str, float]] = {}

    def plain() -> None:
        with Client(srv.endpoint, timeout=60) as c:
            try:
                c.generate(input_ids=[8, 9], **LONG)
            except ServerError as e:
                errors["plain"] = (str(e), time.monotonic())

    try:
        with Client(srv.endpoint, timeout=60) as c:
            stream = c.generate_stream(input_ids=[5, 6, 7], **LONG)
            next(stream)
            t = threading.Thread(target=plain)
            t.start()
            while c.stats()["running"] < 2:
                time.sleep(0.05)
            t0 = time.monotonic()
            os.kill(srv.pids["scheduler"], signal.SIGKILL)
            with pytest.raises(ServerError, match="scheduler"):
                for _ in stream:
                    pass
            t.join(30)
        assert "scheduler" in errors["plain"][0]
        assert errors["plain"][1] - t0 < 10  # the heartbeat timeout is 3 s
        assert srv.wait(30) == 1
    finally:
        srv.stop()
    assert srv.wait_orphans_gone() == []

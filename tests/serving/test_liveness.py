"""Hostile routing ids, a killed launcher, a hung worker, a dead or stopped tokenizer:
the server survives what it can, and otherwise fails fast and leaves nothing behind.

Each test here but the first two launches its own server (they end it on purpose).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq

from radixserve.client import AsyncClient, Client, ConnectionLost, ServerError
from tests.helpers.server import REPO_ROOT, Server
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
def victim(model_dir, tmp_path_factory):
    """A server of its own, logging everything (``victim.log``): the last test of the
    module SIGKILLs its launcher."""
    log = tmp_path_factory.mktemp("victim") / "server.log"
    srv = Server(model_dir, *SERVER_ARGS, "--log-level", "debug", stderr=log)
    srv.log = log
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


def learn_counters(victim, zctx) -> set[int]:
    """What a client can learn of the ROUTER's automatic-id counter: the value libzmq
    starts from in a process whose rand() nobody seeded, and every automatic id the
    server's log shows after an anonymous client with a request in flight went away."""
    out = subprocess.check_output([sys.executable, "-c", FIRST_AUTO_ID], text=True)
    counters = {int(out.strip()[2:], 16)}
    for _ in range(3):
        anonymous = dealer(zctx, victim.endpoint)
        anonymous.send(msgpack.packb({"type": "generate", "v": 1, "id": "g", "input_ids": [5, 6],
                                      "stream": True, "sampling": LONG}))  # fmt: skip
        assert msgpack.unpackb(anonymous.recv())["type"] == "chunk"
        anonymous.close(0)
    deadline = time.monotonic() + 30  # liveness only: the server notices the closes
    while victim.log.read_text().count("went away") < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    log = victim.log.read_text()
    assert log.count("went away") >= 3
    counters |= {int(h, 16) for h in re.findall(r"\b00([0-9a-f]{8})\b", log)}
    return counters


@pytest.mark.timeout(180)
def test_claiming_the_next_routing_id_cannot_crash_the_server(victim, zctx):
    """Learn the counter any way a client can, claim the ids around it, then connect
    ordinary clients: the server answers them all and stays up."""
    claimers = []
    for counter in learn_counters(victim, zctx):
        for d in range(-4, 28):
            claimed = b"\0" + ((counter + d) % 2**32).to_bytes(4, "big")
            claimers.append(dealer(zctx, victim.endpoint, claimed))
            claimers[-1].send(admin("stats"))
    for sock in claimers:  # each connection is identified once the server answers it
        assert msgpack.unpackb(sock.recv())["type"] == "reply"
    for _ in range(4):
        anonymous = dealer(zctx, victim.endpoint)  # an ordinary peer with no id
        anonymous.send(admin("health"))
        assert msgpack.unpackb(anonymous.recv())["type"] == "reply"
    with Client(victim.endpoint, timeout=60) as c:
        assert c.health()["status"] == "ok"
    assert victim.proc.poll() is None
    log = victim.log.read_text()
    for sock in claimers[:8]:  # no routing id, claimed or drawn, in the log
        assert sock.getsockopt(zmq.ROUTING_ID).hex() not in log
    assert not re.search(r"\b00[0-9a-f]{8}\b", log), "an automatic routing id was logged"
    assert "127.0.0.1:" not in log.replace(victim.endpoint, ""), "a peer address was logged"


@pytest.mark.timeout(120)
def test_a_peer_announcing_a_connected_peers_id_gets_its_own(victim, zctx):
    """Ids are the server's: a second peer that announces the first's id is served on
    an id of its own, and neither gets the other's replies."""
    first = dealer(zctx, victim.endpoint, b"taken-id")
    first.send(msgpack.packb({"type": "health", "v": 1, "id": "first"}))
    assert msgpack.unpackb(first.recv())["id"] == "first"
    second = dealer(zctx, victim.endpoint, b"taken-id")
    second.send(msgpack.packb({"type": "health", "v": 1, "id": "second"}))
    assert msgpack.unpackb(second.recv())["id"] == "second"
    first.send(msgpack.packb({"type": "health", "v": 1, "id": "first-again"}))
    assert msgpack.unpackb(first.recv())["id"] == "first-again"
    assert not second.poll(200) and not first.poll(200)
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


@pytest.mark.timeout(150)
def test_a_launcher_whose_stdout_reader_dies_keeps_serving(model_dir):
    """The pipe the launcher prints its start lines to is closed before the first
    line: the server serves on (as under nohup), and SIGTERM still stops it cleanly."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--model", str(model_dir),
           "--port", str(port), "--dtype", "float64", "--log-level", "warning",
           "--exit-with-parent", *SERVER_ARGS]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(cmd, stdout=write_end, env=env, cwd=REPO_ROOT)
    os.close(write_end)
    os.close(read_end)  # the reader is gone before the launcher has printed anything
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        deadline = time.monotonic() + 90  # liveness only: the server starts meanwhile
        while True:
            assert proc.poll() is None, "the launcher exited"
            try:
                with Client(endpoint, timeout=5) as c:
                    r = c.generate(input_ids=[5, 6, 7], max_tokens=4, temperature=0.0)
                    break
            except (ServerError, TimeoutError):
                assert time.monotonic() < deadline, "the server never answered"
                time.sleep(0.5)
        assert r.usage.completion_tokens == 4
        time.sleep(1)  # past the start lines: still serving
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


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

"""A connection flood against the routing-id gate at a low descriptor limit.

The ROUTER and its gate run in a subprocess whose ``RLIMIT_NOFILE`` is 256, as a
tokenizer's would be on a small machine: without limits the gate accepted every
connection (three descriptors each, relayed) until libzmq's ipc listener met
``EMFILE`` and aborted the process. Here the flood comes from this process (whose
limit is the usual one) and is several times larger than the server's whole
limit; the gate either relays to the ROUTER or serves through its ZMTP server (one
descriptor a connection), and the process answers on both.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from radixserve.utils.zmtp_gate import FDS_PER_CONNECTION
from radixserve.utils.zmtp_server import FDS_PER_CONNECTION as SERVED_FDS
from radixserve.utils.zmtp_server import built

SERVER = textwrap.dedent(
    """
    import os, resource, sys, tempfile, zmq
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    from radixserve.utils.descriptors import ConnectionLimits, open_descriptors
    from radixserve.utils.zmtp_gate import RoutingIdGate
    from radixserve.utils.zmtp_server import ZmtpServer
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    path = os.path.join(tempfile.mkdtemp(prefix="rs-"), "pub")
    router.bind("ipc://" + path)
    limits = ConnectionLimits(0, int(sys.argv[1]), float(sys.argv[2]))
    server = ZmtpServer() if sys.argv[3] == "served" else None
    upstream = path if server is None else None
    gate = RoutingIdGate("127.0.0.1", 0, upstream, limits, server=server)
    gate.start()
    print(gate.port, gate.limits.total, gate.limits.per_address, flush=True)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    if server is not None:
        poller.register(server.fd, zmq.POLLIN)

    def answer(msg):  # echo; "fds" is answered with this process's open descriptors
        return b"%d %d" % (open_descriptors(), len(gate)) if msg == b"fds" else msg

    while True:
        events = dict(poller.poll())
        if router in events:
            rid, msg = router.recv_multipart()
            router.send_multipart([rid, answer(msg)])
        if server is not None and server.fd in events:
            for rid, frames in server.take():
                if frames is not None:
                    server.send(rid, [answer(frames[0])])
    """
)


@pytest.fixture(
    params=[
        "relayed",
        pytest.param(
            "served",
            marks=pytest.mark.skipif(not built(), reason="csrc/zmtp_server.c not built"),
        ),
    ]
)
def mode(request):
    """Whether the gate relays to the ROUTER or serves through its ZMTP server."""
    return request.param


@pytest.fixture(params=[30.0])
def server(request, mode):
    """(process, port, total limit, per-address limit, a zmq context); the handshake
    timeout is the param."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, "0", str(request.param), mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    port, total, per_address = map(int, proc.stdout.readline().split())
    ctx = zmq.Context()
    yield proc, port, total, per_address, ctx
    ctx.destroy(linger=0)
    proc.kill()
    proc.wait()


def dealer(ctx: zmq.Context, port: int, source: str = "127.0.0.1") -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://{source}:0;127.0.0.1:{port}")
    return d


def ask(d: zmq.Socket, msg: bytes) -> bytes:
    d.send(msg)
    assert d.poll(20000), "no answer"
    return d.recv()


def descriptors(d: zmq.Socket) -> tuple[int, int]:
    fds, relayed = ask(d, b"fds").split()
    return int(fds), int(relayed)


def flood(port: int, n: int, sources: list[str]) -> list[socket.socket]:
    """``n`` connections that never greet, from ``sources`` in turn."""
    socks = []
    for i in range(n):
        s = socket.socket()
        s.bind((sources[i % len(sources)], 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        try:
            s.connect(("127.0.0.1", port))
        except OSError:  # the listen queue is full: refused at the door
            s.close()
            continue
        socks.append(s)
    return socks


def held(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the gate kept: it relays the ROUTER's greeting to those,
    and resets those it refuses. Waits until every one has had its answer."""
    kept = 0
    with selectors.DefaultSelector() as sel:
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        left = len(socks)
        deadline = time.monotonic() + 30  # liveness only
        while left and time.monotonic() < deadline:
            for key, _ in sel.select(1.0):
                sel.unregister(key.fileobj)
                left -= 1
                with contextlib.suppress(OSError):
                    kept += bool(key.fileobj.recv(10))
    assert left == 0, f"{left} connections neither served nor refused"
    return kept


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def wait_baseline(d: zmq.Socket, baseline: int) -> tuple[int, int]:
    deadline = time.monotonic() + 20  # liveness only: closes are noticed at once
    while (now := descriptors(d)) != (baseline, 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


@pytest.mark.timeout(120)
def test_a_flood_far_over_the_descriptor_limit_leaves_the_server_serving(server, mode):
    proc, port, total, per_address, ctx = server
    per_connection = SERVED_FDS if mode == "served" else FDS_PER_CONNECTION
    assert 128 // per_connection < total < 256 // per_connection  # the budget, d each
    assert 0 < per_address < total
    established = dealer(ctx, port, "127.0.0.3")
    baseline, relayed = descriptors(established)
    assert relayed == 1
    # One address: it gets its share, the rest are refused, another address is served.
    socks = flood(port, 1000, ["127.0.0.1"])
    assert held(socks) == per_address
    during = dealer(ctx, port, "127.0.0.2")
    assert ask(during, b"during") == b"during"
    assert ask(established, b"still") == b"still"
    close_all(socks)
    # Many addresses: the total fills, the connection made before keeps being served.
    socks = flood(port, 1000, [f"127.0.1.{i}" for i in range(1, 101)])
    assert held(socks) == total - 2
    assert ask(established, b"still") == b"still"
    fds, relayed = descriptors(established)
    assert fds < 256 - 32 and relayed == total
    close_all(socks)
    during.close()
    assert wait_baseline(established, baseline) == (baseline, 1)
    after = dealer(ctx, port, "127.0.0.4")
    assert ask(after, b"after") == b"after"
    assert proc.poll() is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", [1.0], indirect=True)
def test_an_unfinished_handshake_is_dropped_and_its_descriptors_freed(server):
    proc, port, _total, per_address, ctx = server
    d = dealer(ctx, port, "127.0.0.2")
    baseline, _ = descriptors(d)
    socks = flood(port, per_address, ["127.0.0.1"])
    for s in socks:
        s.sendall(b"\xff" + bytes(8))  # a greeting begun, never finished
    for s in socks:
        s.settimeout(20)  # the ROUTER's own handshake timeout is 30 s: this is the gate's
        got = b""
        while chunk := s.recv(100):
            got += chunk
        assert len(got) <= 64
    close_all(socks)
    assert wait_baseline(d, baseline) == (baseline, 1)
    assert proc.poll() is None

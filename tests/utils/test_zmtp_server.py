"""The ZMTP server behind the gate: ZMTP conformance against pyzmq DEALERs (and raw
sockets where a test needs to misbehave), heartbeats both ways, limits, and what a
closed or malformed connection does to the others (nothing)."""

from __future__ import annotations

import select
import socket
import time

import pytest
import zmq

from radixserve.utils.zmtp_gate import SERVER_GREETING, RoutingIdGate, command_frame, ready_body
from radixserve.utils.zmtp_server import Unsent, ZmtpServer, built

pytestmark = pytest.mark.skipif(not built(), reason="csrc/zmtp_server.c not built")

MAX_MESSAGE = 2 << 20
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 100, 300


@pytest.fixture
def served():
    """(zmq context, ZMTP server, gate)."""
    server = ZmtpServer(MAX_MESSAGE, heartbeat_ivl_ms=HEARTBEAT_IVL_MS,
                        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)  # fmt: skip
    gate = RoutingIdGate("127.0.0.1", 0, None, server=server).start()
    ctx = zmq.Context()
    yield ctx, server, gate
    gate.close()
    ctx.destroy(linger=0)


def take(server: ZmtpServer, n: int = 1, timeout: float = 20.0) -> list:
    """The next ``n`` events (messages and closes) of ``server``."""
    got: list = []
    deadline = time.monotonic() + timeout  # liveness only
    with select.epoll() as ep:
        ep.register(server.fd, select.EPOLLIN)
        while len(got) < n and time.monotonic() < deadline:
            ep.poll(0.5)
            got += server.take()
    assert len(got) >= n, f"{len(got)} of {n} events"
    return got


def dealer(ctx: zmq.Context, gate: RoutingIdGate, **options) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVTIMEO, 20000)
    for name, value in options.items():
        d.setsockopt(getattr(zmq, name), value)
    d.connect(gate.endpoint)
    return d


def raw(gate: RoutingIdGate, socket_type: bytes = b"DEALER") -> socket.socket:
    """A TCP peer that has done the ZMTP handshake by hand."""
    s = socket.create_connection(("127.0.0.1", gate.port))
    s.settimeout(20)
    s.sendall(SERVER_GREETING)  # a peer's greeting looks the same (NULL, as-server 0)
    s.sendall(command_frame(ready_body([(b"Socket-Type", socket_type)])))
    assert recv_exact(s, 64)[:1] == b"\xff"
    flags, body = read_frame(s)
    assert flags & 0x04 and body.startswith(b"\x05READY")
    return s


def recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk, "closed"
        data += chunk
    return data


def read_frame(s: socket.socket) -> tuple[int, bytes]:
    flags = recv_exact(s, 1)[0]
    size = int.from_bytes(recv_exact(s, 8 if flags & 0x02 else 1), "big")
    return flags, recv_exact(s, size)


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (what it sent before is read and dropped)."""
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_multipart_and_large_frames_pass_whole_both_ways(served):
    ctx, server, gate = served
    d = dealer(ctx, gate)
    sizes = [0, 1, 255, 256, 300, (1 << 20) + 7]
    frames = [bytes([i]) * n for i, n in enumerate(sizes)]
    d.send_multipart(frames)
    [(rid, got)] = take(server)
    assert got == frames
    assert len(rid) == 16 and rid[0] != 0
    server.send(rid, frames[::-1])
    server.send(rid, [b"single"])
    assert d.recv_multipart() == frames[::-1]
    assert d.recv() == b"single"


def test_the_routing_id_is_drawn_by_the_server_not_claimed(served):
    ctx, server, gate = served
    d = dealer(ctx, gate, ROUTING_ID=b"\0\0\0\0\1")
    d.send(b"x")
    [(rid, _)] = take(server)
    assert rid != b"\0\0\0\0\1" and len(rid) == 16 and rid[0] != 0


def test_many_connections_each_get_their_own_replies(served):
    ctx, server, gate = served
    clients = [dealer(ctx, gate) for _ in range(100)]
    for i, d in enumerate(clients):
        d.send(b"%d" % i)
    rids = {int(frames[0]): rid for rid, frames in take(server, len(clients))}
    assert len(set(rids.values())) == len(clients)
    for i, rid in rids.items():
        server.send(rid, [b"for %d" % i])
    assert [d.recv() for d in clients] == [b"for %d" % i for i in range(len(clients))]
    assert len(server) == len(gate) == len(clients)


def test_pings_are_answered_and_a_peer_that_answers_stays(served):
    ctx, server, gate = served
    s = raw(gate)
    s.sendall(command_frame(b"\x04PING\x00\x00ctx"))
    flags, body = read_frame(s)
    assert flags == 0x04 and body == b"\x04PONGctx"
    # The server pings every 100 ms; answering keeps the connection past its timeout.
    deadline = time.monotonic() + 4 * HEARTBEAT_TIMEOUT_MS / 1000
    while time.monotonic() < deadline:
        flags, body = read_frame(s)
        assert flags == 0x04 and body.startswith(b"\x04PING")
        s.sendall(command_frame(b"\x04PONG"))
    s.sendall(b"\x00\x05alive")
    [(_, frames)] = take(server)
    assert frames == [b"alive"]
    s.close()


def test_a_silent_peer_is_dropped_and_its_close_reported(served):
    ctx, server, gate = served
    s = raw(gate)
    s.sendall(b"\x00\x02hi")
    [(rid, _)] = take(server)
    assert take(server) == [(rid, None)]  # it never answers a PING
    assert closed_by_server(s)
    # A DEALER's libzmq answers the pings by itself: it stays.
    d = dealer(ctx, gate)
    d.send(b"idle")
    take(server)
    time.sleep(3 * HEARTBEAT_TIMEOUT_MS / 1000)
    assert len(server) == 1 and not server.take()


@pytest.mark.parametrize(
    "bad",
    [
        b"\x08\x01x",  # a reserved flag bit
        b"\x05\x05\x04PING",  # a command with MORE
        b"\x04\x03\x09ab",  # a command whose name overruns it
        b"\x06" + (1 << 40).to_bytes(8, "big"),  # a huge command
        b"\x02" + (MAX_MESSAGE + 1).to_bytes(8, "big"),  # a message over the limit
        b"\x01\x02ab\x03" + MAX_MESSAGE.to_bytes(8, "big"),  # two frames over the limit
        command_frame(b"\x05ERROR\x03bye"),
    ],
)
def test_a_malformed_stream_closes_that_connection_only(served, bad):
    ctx, server, gate = served
    d = dealer(ctx, gate)
    d.send(b"before")
    [(rid, _)] = take(server)
    s = raw(gate)
    s.sendall(bad)
    [(_, none)] = take(server)
    assert none is None and closed_by_server(s)
    d.send(b"after")
    assert take(server) == [(rid, [b"after"])]
    server.send(rid, [b"ok"])
    assert d.recv() == b"ok"


@pytest.mark.parametrize(
    "handshake",
    [
        b"GET / HTTP/1.1\r\n\r\n",
        SERVER_GREETING[:10] + b"\x02" + SERVER_GREETING[11:],  # ZMTP 2
        SERVER_GREETING[:12] + b"PLAIN".ljust(20, b"\0") + SERVER_GREETING[32:],
        SERVER_GREETING + b"\x00\x01x",  # a message before READY
    ],
)
def test_a_handshake_the_gate_cannot_answer_is_closed_and_the_rest_served(served, handshake):
    ctx, server, gate = served
    with socket.create_connection(("127.0.0.1", gate.port)) as s:
        s.settimeout(20)
        s.sendall(handshake)
        assert closed_by_server(s)
    assert len(server) == 0
    d = dealer(ctx, gate)
    d.send(b"still here")
    assert take(server)[0][1] == [b"still here"]


def test_a_peer_of_a_type_a_router_does_not_talk_to_is_refused(served):
    _, server, gate = served
    with pytest.raises(AssertionError, match="closed"):
        raw(gate, b"PUSH")
    assert len(server) == 0


def test_replies_to_a_gone_peer_are_dropped_without_error(served):
    ctx, server, gate = served
    d = dealer(ctx, gate)
    d.send(b"x")
    [(rid, _)] = take(server)
    d.close(0)
    assert take(server) == [(rid, None)]
    with pytest.raises(Unsent) as e:
        server.send(rid, [b"late"])
    assert not e.value.full
    with pytest.raises(Unsent):
        server.send(bytes(range(16)), [b"nobody"])


def test_queues_are_bounded_both_ways():
    # No heartbeats: the peers below do not read.
    server = ZmtpServer(MAX_MESSAGE, max_queued=4, max_unread=4)
    gate = RoutingIdGate("127.0.0.1", 0, None, server=server).start()
    ctx = zmq.Context()
    try:
        # A client that floods is not read past 4 messages waiting; none is lost.
        d = dealer(ctx, gate)
        for i in range(30):
            d.send(b"%d " % i + bytes(100_000))
        got: list = []
        while len(got) < 30:
            time.sleep(0.02)
            batch = take(server)
            assert len(batch) <= 4
            got += batch
        assert [f[0].split(b" ")[0] for _, f in got] == [b"%d" % i for i in range(30)]
        # Replies to a client that does not read: past 4 waiting, refused as full.
        s = raw(gate)
        s.sendall(b"\x00\x01x")
        [(rid, _)] = take(server)
        with pytest.raises(Unsent) as e:
            for _ in range(1000):
                server.send(rid, [bytes(1 << 20)])
        assert e.value.full
        s.close()
    finally:
        gate.close()
        ctx.destroy(linger=0)


def test_drain_sends_the_last_replies_before_closing(served):
    ctx, server, gate = served
    d = dealer(ctx, gate)
    d.setsockopt(zmq.RCVHWM, 0)
    d.send(b"request")
    [(rid, _)] = take(server)
    for i in range(20):
        server.send(rid, [b"last %d " % i + bytes(1 << 20)])
    gate.drain(10)
    for i in range(20):
        assert d.recv().startswith(b"last %d " % i)

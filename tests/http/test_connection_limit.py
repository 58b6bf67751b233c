"""The HTTP front's connection cap (radixserve/http/connection_limit.py): connections
past the limit are reset (at accept on asyncio's loop, once made on uvloop's), those
open keep being served, and one that never sends a request is closed after the
keep-alive timeout."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest
import uvicorn
import uvloop

from radixserve.http.connection_limit import ConnectionCap
from tests.http.uvicorn_thread import serving

LIMIT = 5
PER_ADDRESS = 3


async def app(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["asyncio", "uvloop"])
def port(request):
    cap = ConnectionCap(LIMIT, PER_ADDRESS)
    sock = socket.create_server(("127.0.0.1", 0))
    if request.param == "asyncio":
        sock = cap.listener(sock)  # uvloop accepts in libuv: the protocol admits
    config = uvicorn.Config(
        app,
        http=cap.protocol(),
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=1,
    )
    factory = uvloop.new_event_loop if request.param == "uvloop" else None
    with serving(config, sock, factory) as port:
        yield port


def get(s: socket.socket) -> bytes:
    """One request's whole response (the app's is chunked)."""
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(20)
    got = b""
    while not got.endswith(b"0\r\n\r\n") and (chunk := s.recv(1000)):
        got += chunk
    return got


def answer(s: socket.socket) -> bytes | None:
    """What the server sent first (b"": it closed), or None when it reset."""
    s.settimeout(20)
    try:
        return s.recv(1000)
    except ConnectionResetError:
        return None


def connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), source_address=(source, 0))


def refused(socks: list[socket.socket]) -> bool:
    """Whether every one of ``socks`` was reset or closed without an answer."""
    for s in socks:
        with contextlib.suppress(OSError):
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    return all(answer(s) in (None, b"") for s in socks)


def test_connections_past_the_limits_are_reset_and_those_open_are_served(port):
    kept = [connect(port, "127.0.0.1") for _ in range(PER_ADDRESS)]
    assert get(kept[0]).startswith(b"HTTP/1.1 200")  # all accepted by now
    assert refused([connect(port, "127.0.0.1") for _ in range(10)])  # per address
    kept += [connect(port, "127.0.0.2") for _ in range(LIMIT - PER_ADDRESS)]
    assert get(kept[-1]).startswith(b"HTTP/1.1 200")
    assert refused([connect(port, "127.0.0.3") for _ in range(10)])  # in all
    assert [get(s)[:15] for s in kept] == [b"HTTP/1.1 200 OK"] * LIMIT
    for s in kept:
        s.close()
    deadline = time.monotonic() + 20  # liveness: the server notices the closes
    while time.monotonic() < deadline:
        with connect(port, "127.0.0.3") as s:
            try:
                if get(s).startswith(b"HTTP/1.1 200"):
                    break
            except OSError:
                time.sleep(0.05)
    else:
        pytest.fail("no connection served after the flood")


def test_a_connection_that_sends_nothing_is_closed(port):
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert answer(s) == b""  # closed by the server (keep-alive timeout), not reset

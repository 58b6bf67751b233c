"""The HTTP front's poll keeper (``http/poll_keeper.py``, ``csrc/poll_keeper.c``).

The native thread on its own, over socket pairs: the learned head answered as often
and as pipelined as it comes, in order, however slowly the peer reads; anything else,
a head with no answer published, part of a head left idle, handed back with every
byte read; a peer that closes or idles closed and reported. Then the keeper behind the
front's protocol, served by uvicorn on uvloop as the front serves: kept-alive polls
answered by the thread with the protocol's bytes, another request on the same
connection answered by the app, the cap's count given back when the peer goes.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time

import pytest

from radixserve.http import poll_keeper
from tests.helpers.native import require_built
from tests.http.test_dashboard import KEYS, _raw, _read_answers, _served
from tests.utils.test_zmtp_server import recv_exact

require_built(poll_keeper.built(), "no module _poll_keeper", "the poll keeper", module=True)
native = poll_keeper.native

HEAD = b"GET /dashboard/data HTTP/1.1\r\nHost: x\r\n\r\n"


@contextlib.contextmanager
def _keeper(idle_ms: int = 10_000, gap_us: int = 0):
    h = native.start(idle_ms, gap_us)
    try:
        yield h
    finally:
        native.stop(h)


def _kept(h, token: int = 1) -> socket.socket:
    """A socket pair's end handed to the keeper with ``HEAD`` learned for route 1; the
    other end, the peer, returned."""
    peer, ours = socket.socketpair()
    ours.setblocking(False)
    native.add(h, token, ours.detach(), HEAD, 1)
    peer.settimeout(10)
    return peer


def _take(h, timeout: float = 10) -> list[tuple[int, int, bytes]]:
    """What the keeper reports next (waiting for it)."""
    assert select.select([native.fd(h)], [], [], timeout)[0], "nothing reported"
    taken = native.take(h)
    assert taken
    return taken


@pytest.mark.parametrize("gap_us", [0, 5000])  # answered at once, or gathered
def test_the_learned_head_is_answered_as_it_comes_and_anything_else_comes_back(gap_us):
    with _keeper(gap_us=gap_us) as h:
        native.set_answer(h, 1, b"ANSWER\n")
        native.set_answer(h, 0, b"the page")
        peer = _kept(h)
        peer.sendall(HEAD)
        assert recv_exact(peer, 7) == b"ANSWER\n"
        peer.sendall(HEAD * 3)  # pipelined
        assert recv_exact(peer, 21) == b"ANSWER\n" * 3
        for at in (1, 17, len(HEAD) - 1):  # a head in two reads
            peer.sendall(HEAD[:at])
            time.sleep(0.02)
            peer.sendall(HEAD[at:])
            assert recv_exact(peer, 7) == b"ANSWER\n"
        native.set_answer(h, 1, b"NEW")  # a new version: the next answer is it
        peer.sendall(HEAD)
        assert recv_exact(peer, 3) == b"NEW"
        assert native.stats(h) == (1, 8)
        other = b"GET /dashboard/data HTTP/1.1\r\nHost: y\r\n\r\n"
        peer.sendall(HEAD + other)  # one answered, the rest handed back as read
        assert recv_exact(peer, 3) == b"NEW"
        [(token, fd, data)] = _take(h)
        assert token == 1 and fd >= 0 and other.startswith(data) and data
        assert native.stats(h) == (0, 9)
        back = socket.socket(fileno=fd)  # the connection itself, still open
        back.sendall(b"pong")
        assert recv_exact(peer, 4) == b"pong"
        back.close()
        peer.close()


def test_no_answer_published_hands_the_head_back():
    with _keeper() as h:
        native.set_answer(h, 0, b"the page")  # but none for route 1
        peer = _kept(h)
        peer.sendall(HEAD)
        [(token, fd, data)] = _take(h)
        assert (token, data) == (1, HEAD) and native.stats(h)[1] == 0
        os.close(fd)
        peer.close()
        native.set_answer(h, 1, b"A")
        native.set_answer(h, 1, None)  # withdrawn (the server drains)
        peer = _kept(h, token=2)
        peer.sendall(HEAD)
        [(token, fd, data)] = _take(h)
        assert (token, data) == (2, HEAD)
        os.close(fd)
        peer.close()


def test_a_closed_or_idle_peer_is_closed_and_reported():
    with _keeper(idle_ms=200) as h:
        native.set_answer(h, 1, b"A")
        gone = _kept(h, token=1)
        gone.close()
        assert _take(h) == [(1, -1, b"")]
        idle = _kept(h, token=2)
        partial = _kept(h, token=3)
        partial.sendall(HEAD[:10])
        t0 = time.monotonic()
        taken: dict[int, tuple[int, bytes]] = {}
        while len(taken) < 2:
            taken.update((token, (fd, data)) for token, fd, data in _take(h))
        assert time.monotonic() - t0 < 5
        assert taken[2] == (-1, b"")  # idle between requests: closed
        fd, data = taken[3]
        assert fd >= 0 and data == HEAD[:10]  # part of a head: back to the front
        os.close(fd)
        assert idle.recv(1) == b""
        partial.close()
        assert native.stats(h)[0] == 0


def test_a_slow_reader_gets_every_answer_whole_and_is_not_read_meanwhile():
    big = [bytes([65 + i]) * (3 << 20) for i in range(3)]  # more than a socket buffer takes
    with _keeper() as h:
        peer = _kept(h)
        for answer in big:
            native.set_answer(h, 1, answer)
            peer.sendall(HEAD)
            time.sleep(0.05)  # the thread starts writing it, the socket fills
        time.sleep(0.2)
        got = recv_exact(peer, len(big[0]) * 3)
        # Each whole, the version published when its head was read: the first at once;
        # the others wait in the socket until the first was taken, when C is published.
        assert got == big[0] + big[2] + big[2]
        assert native.stats(h)[1] == 3
        peer.close()
        assert _take(h) == [(1, -1, b"")]


def _poll(sock: socket.socket, ask: tuple) -> tuple:
    sock.sendall(_raw(*ask))
    return _read_answers(sock, 1)[0]


def test_kept_alive_polls_are_answered_by_the_keeper_as_by_the_protocol():
    """Served as the front serves (uvloop, httptools, the cap, the keeper): one
    connection polls the figures many times, then the page; the keeper answers all but
    the first of each with the protocol's bytes; a validator on the same connection is
    answered by the protocol after the hand-back (a 304), and the next poll is taken
    over again; pipelined polls are answered in order; when the peer goes, the cap's
    count goes back to 0."""
    poll = ("GET", "/dashboard/data", {"Authorization": "Bearer admin-key"})
    page = ("GET", "/dashboard", {"Authorization": "Bearer admin-key"})
    with contextlib.contextmanager(_served)(KEYS, "on", True) as (port, counted):
        keeper, cap = counted.keeper, counted.cap
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            _poll(sock, poll)
            while not (counted.calls or keeper.taken):  # the figures fetched by the app
                _poll(sock, poll)
            calls, answered = counted.calls, keeper.answered()
            polls = [_poll(sock, poll) for _ in range(20)]
            assert all(p == polls[0] for p in polls) and polls[0][0].endswith(b"200 OK")
            assert keeper.answered() - answered >= 19 and counted.calls == calls
            etag = dict(polls[0][1])[b"etag"].decode()
            validated = _poll(sock, (*poll[:2], {**poll[2], "If-None-Match": etag}))
            assert validated[0].endswith(b"304 Not Modified") and keeper.returned >= 1
            assert _poll(sock, poll) == polls[0]  # by the protocol, then taken over again
            answered = keeper.answered()
            sock.sendall(_raw(*poll) * 5)
            assert _read_answers(sock, 5) == [polls[0]] * 5
            assert keeper.answered() - answered == 5
            pages = [_poll(sock, page) for _ in range(3)]  # back, and the page taken over
            assert pages[0] == pages[1] == pages[2] and b"<html" in pages[0][2].lower()
            assert counted.calls == calls  # the app saw none of it
            assert cap.open == 1 and len(keeper) == 1
        _settles(lambda: cap.open == 0 and len(keeper) == 0)  # closed by the keeper
        fds = len(os.listdir("/proc/self/fd"))
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            polls = [_poll(sock, poll) for _ in range(3)]
            # A request larger than what the keeper reads before it hands back, and a
            # poll after it, in one write: the new protocol reads the keeper's bytes
            # first, then the rest, in order (a POST with a body: its 405, then 200).
            body = b"x" * 20_000
            post = _raw("POST", "/dashboard/data", {"Content-Length": str(len(body))}) + body
            sock.sendall(post + _raw(*poll))
            answers = _read_answers(sock, 2)
            assert answers[0][0].endswith(b"405 Method Not Allowed") and answers[1] == polls[0]
            assert _poll(sock, poll) == polls[0]
            returned = keeper.returned
            assert _poll(sock, ("GET", "/v1/models", {})) != polls[0]  # handed back
            assert keeper.returned == returned + 1 and len(keeper) == 0 and cap.open == 1
        _settles(lambda: cap.open == 0)  # closed by the protocol that took it back
        assert len(os.listdir("/proc/self/fd")) == fds


def _settles(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


def test_the_keeper_can_be_turned_off():
    assert poll_keeper.enabled({})
    assert poll_keeper.enabled({"RADIXSERVE_POLL_KEEPER": "1"})
    assert not poll_keeper.enabled({"RADIXSERVE_POLL_KEEPER": "0"})

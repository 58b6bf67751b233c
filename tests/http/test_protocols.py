"""The front's HTTP/1.1 protocols (radixserve/http/httptools_protocol.py on uvloop, and
the h11 one of h11_protocol.py on asyncio's loop, its fallback) refuse alike: a head
over MAX_HEAD_BYTES is a JSON 431, what is not HTTP a JSON 400, each answered whole
before the close, on a connection's first request or a later one; the server goes on."""

from __future__ import annotations

import json
import socket

import pytest
import uvicorn
import uvloop

from radixserve.http.h11_protocol import MAX_HEAD_BYTES, HeadLimit, HeadLimitedH11Protocol
from radixserve.http.httptools_protocol import HeadLimitedHttpToolsProtocol
from tests.http.uvicorn_thread import serving


async def echo(scope, receive, send):
    assert scope["type"] == "http"
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# (protocol, loop, app). h11 parses a head that arrives in one read whatever its size,
# and leaves it to HeadLimit (as the front runs it); the httptools protocol limits
# every head itself, so it is tested without HeadLimit.
STACKS = {
    "httptools": (HeadLimitedHttpToolsProtocol, uvloop.new_event_loop, echo),
    "h11": (HeadLimitedH11Protocol, None, HeadLimit(echo)),
}


@pytest.fixture(scope="module", params=sorted(STACKS))
def port(request):
    protocol, loop_factory, app = STACKS[request.param]
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        http=protocol,
        lifespan="off",
        log_level="warning",
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
    )
    with serving(config, sock, loop_factory) as port:
        yield port


def request(pad: int, body: bytes = b"hello") -> bytes:
    """A POST whose head is ``pad`` bytes longer than without its X-Pad header."""
    return (
        f"POST /echo?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        f"X-Pad: {'p' * pad}\r\n\r\n"
    ).encode() + body


def head_size(pad: int) -> int:
    return request(pad).index(b"\r\n\r\n") + 4


def exchange(port: int, *messages: bytes) -> list[tuple[bytes, bytes]]:
    """Send ``messages`` one after another on one connection, reading each answer;
    (status line, body) for each answer, up to the server's close."""
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        buf = b""
        for message in messages:
            try:
                sock.sendall(message)
            except (BrokenPipeError, ConnectionResetError):
                break
            while b"\r\n\r\n" not in buf and (chunk := sock.recv(1 << 16)):
                buf += chunk
            if not buf:
                break
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = int(next(
                line.split(b":")[1] for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ))  # fmt: skip
            while len(buf) < length and (chunk := sock.recv(1 << 16)):
                buf += chunk
            answers.append((head.split(b"\r\n")[0], buf[:length]))
            buf = buf[length:]
    return answers


def is_431(answer: tuple[bytes, bytes]) -> bool:
    status, body = answer
    err = json.loads(body)["error"]
    return (
        status == b"HTTP/1.1 431 Request Header Fields Too Large"
        and err["code"] == "header_too_large"
        and f"{MAX_HEAD_BYTES} bytes" in err["message"]
    )


def test_a_head_at_the_limit_is_served_one_byte_more_is_a_431(port):
    base = head_size(0)
    assert head_size(MAX_HEAD_BYTES - base) == MAX_HEAD_BYTES
    [ok] = exchange(port, request(MAX_HEAD_BYTES - base))
    assert ok == (b"HTTP/1.1 200 OK", b"hello")
    [refused] = exchange(port, request(MAX_HEAD_BYTES - base + 1))
    assert is_431(refused), refused


def test_a_huge_head_is_a_431_read_whole_by_the_client(port):
    [refused] = exchange(port, request(1 << 20))
    assert is_431(refused), refused
    assert exchange(port, request(0)) == [(b"HTTP/1.1 200 OK", b"hello")]


def test_a_kept_alive_connections_later_head_is_limited_too(port):
    """The limit counts each request's head afresh, not the connection's bytes."""
    small = request(MAX_HEAD_BYTES // 2, b"x" * MAX_HEAD_BYTES)
    answers = exchange(port, small, small, small, request(1 << 20))
    assert answers[:3] == [(b"HTTP/1.1 200 OK", b"x" * MAX_HEAD_BYTES)] * 3
    assert len(answers) == 4 and is_431(answers[3]), answers[3:]


def test_what_is_not_http_is_a_json_400(port):
    [refused] = exchange(port, b"NOT HTTP AT ALL\x00\r\n\r\n")
    status, body = refused
    assert status == b"HTTP/1.1 400 Bad Request"
    assert "not valid HTTP" in json.loads(body)["error"]["message"]
    assert exchange(port, request(0)) == [(b"HTTP/1.1 200 OK", b"hello")]


def test_a_head_that_never_ends_is_a_431_once_past_the_limit(port):
    """The protocol stops reading a head at the limit, not at its end."""
    unfinished = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * (1 << 20)
    [refused] = exchange(port, unfinished)
    assert is_431(refused), refused

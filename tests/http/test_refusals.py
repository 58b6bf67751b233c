"""Requests the front refuses for what the client did: each gets its own 4xx, is counted
once in ``requests_total``, and is logged as one line at most, never a traceback; the
server and every other client's requests go on."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import httpx
import pytest

from radixserve import protocol as P
from radixserve.http.app import create_app
from radixserve.http.h11_protocol import MAX_HEAD_BYTES
from radixserve.http.metrics import Metrics
from radixserve.http.state import FrontState
from tests.helpers.server import wait_idle
from tests.http.conftest import MODEL
from tests.http.test_errors import GOOD, error_of
from tests.http.test_metrics import scrape, value

LONG = 400  # more tokens than any test waits for


@pytest.fixture
def http(http_server):
    with httpx.Client(base_url=http_server.http_url, timeout=120) as c:
        yield c


def test_a_request_past_its_own_timeout_is_a_408(http, http_server, zmq_client):
    """The deadline is the client's: 408 naming request_timeout, not a server failure,
    whether the answer was to be whole or streamed; counted as one error."""
    before = scrape(http_server.http_url)
    body = {**GOOD, "max_tokens": LONG, "ignore_eos": True, "request_timeout": 5e-324}
    for stream in (False, True):
        err = error_of(http.post("/v1/completions", json={**body, "stream": stream}), 408)
        assert err["message"].startswith(P.REQUEST_TIMED_OUT)
        assert not err["message"].startswith(P.SERVER_FAILED)
        assert (err["type"], err["param"], err["code"]) == (
            "timeout_error", "request_timeout", "request_timeout")  # fmt: skip
    wait_idle(zmq_client)
    after = scrape(http_server.http_url)
    assert (
        value(after, "requests_total", finish_reason="error")
        - value(before, "requests_total", finish_reason="error")
        == 2
    )
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_refused_batch_is_counted_once(http, http_server, zmq_client):
    """64 prompts with n over the server's limit: one 400, one error, no aborts (the
    prompts refused together, or cancelled by the first refusal, are not counted again)."""
    before = scrape(http_server.http_url)
    err = error_of(
        http.post("/v1/completions", json={**GOOD, "prompt": ["Hi"] * 64, "n": 128}), 400
    )
    assert "n" in err["message"]
    wait_idle(zmq_client)
    after = scrape(http_server.http_url)
    for reason, moved in (("error", 1), ("abort", 0), ("stop", 0), ("length", 0)):
        change = value(after, "requests_total", finish_reason=reason) - value(
            before, "requests_total", finish_reason=reason
        )
        assert change == moved, reason


class HeldClient:
    """A stand-in for the front's tokenizer client whose generations wait for ``go``
    (so a request stays in flight as long as the test needs); it records the ids it was
    given (refusing one given twice, as AsyncClient does) and the aborts, and ends an
    aborted generation with finish reason abort."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.started: list[str] = []
        self.aborted: list[str] = []

    async def generate_stream(self, **kw):
        rid = kw["request_id"]
        if rid in self.started:  # as AsyncClient refuses an id it has in flight
            raise ValueError(f"request id {rid!r} is already in use by this client")
        self.started.append(rid)
        await self.go.wait()
        reason = "abort" if rid in self.aborted else "length"
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
        yield P.Chunk(rid, 0, "x", [5], reason, usage)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_rid_in_flight_is_a_409_and_the_first_request_goes_on():
    """Every HTTP client shares the front's one tokenizer client, so a rid is only the
    HTTP client's name for its request: a second /generate with a rid in flight is a 409
    that leaves the first alone; /abort_request by the rid reaches the first under the
    front's own id; once the first ended, the rid is free again."""
    one = {"max_new_tokens": 1}

    async def run() -> tuple[HeldClient, list[httpx.Response]]:
        held = HeldClient()
        state = FrontState(held, Metrics(MODEL), MODEL, 512)  # type: ignore[arg-type]
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as c:
            body = {"text": "one", "rid": "dup-rid", "sampling_params": one}
            first = asyncio.create_task(c.post("/generate", json=body))
            while not held.started:
                await asyncio.sleep(0.01)
            out = [await c.post("/generate", json={**body, "stream": s}) for s in (False, True)]
            batch = {"text": ["a", "b"], "rid": ["other", "dup-rid"], "sampling_params": one}
            out.append(await c.post("/generate", json=batch))
            out.append(await c.post("/abort_request", json={"rid": "dup-rid"}))
            held.go.set()
            out.append(await first)
            out.append(await c.post("/generate", json=batch))
            assert state.sglang_requests == {}
        return held, out

    held, (dup, dup_stream, dup_batch, abort, first, again) = asyncio.run(run())
    for r in (dup, dup_stream, dup_batch):
        err = error_of(r, 409)
        assert "dup-rid" in err["message"] and err["param"] == "rid"
    assert abort.status_code == 200
    assert first.status_code == 200, first.text
    meta = first.json()["meta_info"]
    assert meta["id"] == "dup-rid" and meta["finish_reason"]["type"] == "abort"
    assert [m["meta_info"]["id"] for m in again.json()] == ["other", "dup-rid"]
    # The tokenizer client saw the front's own ids: the first, then the last batch's two.
    assert len(held.started) == 3 == len(set(held.started))
    assert all(i.startswith("http-") for i in held.started)
    assert held.aborted == held.started[:1]


def test_a_client_leaving_mid_body_is_one_info_line(caplog):
    """No body, no generation: the route ends at once, logged as one info line without
    a traceback (nothing reaches uvicorn, which would log another)."""

    async def run() -> list[dict]:
        state = FrontState(None, Metrics(MODEL), MODEL, 512)  # type: ignore[arg-type]
        app = create_app(state)
        sent: list[dict] = []
        parts = [
            {"type": "http.request", "body": b'{"model": "tiny", "pro', "more_body": True},
            {"type": "http.disconnect"},
        ]

        async def receive() -> dict:
            return parts.pop(0) if parts else {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
            "query_string": b"", "root_path": "", "scheme": "http",
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"999")],
            "client": ("127.0.0.1", 5555), "server": ("127.0.0.1", 80),
        }  # fmt: skip
        await app(scope, receive, send)  # raises nothing
        return sent

    with caplog.at_level(logging.DEBUG):
        asyncio.run(run())
    records = [r for r in caplog.records if r.name.startswith(("radixserve", "uvicorn"))]
    assert len(records) == 1, [r.getMessage() for r in records]
    [line] = records
    assert line.levelno == logging.INFO and line.exc_info is None
    assert "127.0.0.1:5555" in line.getMessage() and "/v1/completions" in line.getMessage()


def _exchange(http_url: str, pad: int) -> tuple[bytes, bytes, int]:
    """POST GOOD with a header padded so the head has ``pad`` more bytes than without
    it, over a raw socket; (status line, body, the head's size in bytes)."""
    url = httpx.URL(http_url)
    payload = json.dumps(GOOD).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        f"X-Pad: {'p' * pad}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head + payload)
        answer = b""
        while chunk := sock.recv(1 << 16):
            answer += chunk
    status, _, body = answer.partition(b"\r\n\r\n")
    return status.split(b"\r\n")[0], body, len(head)


def test_an_oversized_request_head_is_a_431(http_server, http):
    """A head of MAX_HEAD_BYTES is served; one byte more, or a 1 MiB header, is a 431 in
    OpenAI's shape, read whole by the client (the front reads the rest of a large head
    before it closes, so the close is no reset); the server goes on."""
    base = _exchange(http_server.http_url, 0)[2]
    status, body, size = _exchange(http_server.http_url, MAX_HEAD_BYTES - base)
    assert size == MAX_HEAD_BYTES and status == b"HTTP/1.1 200 OK", body
    assert json.loads(body)["usage"]["completion_tokens"] == 3
    for pad in (MAX_HEAD_BYTES - base + 1, 1 << 20):
        status, body, size = _exchange(http_server.http_url, pad)
        assert status == b"HTTP/1.1 431 Request Header Fields Too Large", (size, body[:200])
        err = json.loads(body)["error"]
        assert err["code"] == "header_too_large" and f"{MAX_HEAD_BYTES} bytes" in err["message"]
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_a_lost_link_to_the_server_is_a_503_not_the_clients_fault():
    """The front's client lost the tokenizer (it died, or stopped answering heartbeats):
    every request in flight is answered 503, as while the server stops."""
    from radixserve.client import ConnectionLost, ServerError
    from radixserve.http.completions import _refused

    state = FrontState(client=None, metrics=None, served_model_name=MODEL, max_context_len=64)  # type: ignore[arg-type]
    lost = _refused(state, ConnectionLost("lost the server at ipc://x: the connection dropped"))
    assert lost.status == 503 and lost.message.startswith("lost the server")
    assert _refused(state, ServerError("prompt too long")).status == 400
    assert _refused(state, ServerError(P.SERVER_FAILED + ": a bug")).status == 500

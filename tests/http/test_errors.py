"""Bad requests get OpenAI-shaped errors with the right status and a message saying why,
the server keeps serving, and an HTTP client that leaves has its request aborted."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from radixserve import protocol as P
from radixserve.client import AsyncClient, ServerError
from radixserve.http.app import create_app
from radixserve.http.metrics import Metrics
from radixserve.http.state import FrontState
from tests.helpers.server import wait_idle
from tests.http.conftest import MODEL

LONG = 400  # more tokens than any test waits for: finishing early proves the abort
GOOD = {"model": MODEL, "prompt": "still serving", "max_tokens": 3, "temperature": 0}


@pytest.fixture
def http(http_server):
    with httpx.Client(base_url=http_server.http_url, timeout=120) as c:
        yield c


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


BAD_BODIES = [
    # (body, what the message must mention, the param it must name)
    ({**GOOD, "max_tokens": "5"}, "valid integer", "max_tokens"),
    ({**GOOD, "temperature": "hot"}, "temperature", "temperature"),
    ({**GOOD, "n": True}, "valid integer", "n"),
    ({**GOOD, "stream": "yes"}, "valid boolean", "stream"),
    ({**GOOD, "prompt": {"text": "x"}}, "prompt", "prompt"),
    ({**GOOD, "max_token": 5}, "max_token", "max_token"),  # a typo is not ignored
    ({k: v for k, v in GOOD.items() if k != "model"}, "model", "model"),
    ({**GOOD, "top_p": 2.0}, "top_p must be in (0, 1]", None),
    ({**GOOD, "max_tokens": -1}, "max_tokens must be an integer >= 0", None),
    ({**GOOD, "seed": -1}, "seed", None),
    ({**GOOD, "logprobs": 21}, "logprobs must be null or an integer in [0, 20]", None),
    ({**GOOD, "logprobs": True}, "valid integer", "logprobs"),
    ({**GOOD, "presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]", None),
    ({**GOOD, "frequency_penalty": "1"}, "frequency_penalty", "frequency_penalty"),
    ({**GOOD, "repetition_penalty": 0}, "repetition_penalty", None),
    ({**GOOD, "logit_bias": {"x": 1}}, "logit_bias keys must be token ids", None),
    ({**GOOD, "logit_bias": {"5": "1"}}, "logit_bias", "logit_bias"),
    ({**GOOD, "logit_bias": {"99999": 1}}, "logit_bias token id 99999", None),
    ({**GOOD, "min_tokens": 20, "max_tokens": 5}, "min_tokens", None),
    ({**GOOD, "stop_token_ids": [-1]}, "greater than or equal", "stop_token_ids"),
    ({**GOOD, "suffix": "x"}, "suffix is not supported", None),
    ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options", None),
    # integers msgpack cannot carry are a 400 naming the field, not a 500
    ({**GOOD, "max_tokens": 2**64}, "less than or equal", "max_tokens"),
    ({**GOOD, "top_k": 2**64 + 5}, "less than or equal", "top_k"),
    ({**GOOD, "seed": 2**70}, "less than or equal", "seed"),
    ({**GOOD, "n": -(2**64)}, "greater than or equal", "n"),
    ({**GOOD, "prompt": [5, 2**64]}, "less than or equal", "prompt"),
    ({**GOOD, "prompt": [[5], [2**31]]}, "less than or equal", "prompt"),
    ({**GOOD, "max_tokens": 2**63}, "less than or equal", "max_tokens"),
    ({**GOOD, "prompt": [5, 2**31 - 1]}, "vocabulary", None),
    ({**GOOD, "seed": 2**63 - 1, "n": 2}, "seed", None),
    ({**GOOD, "x" * 5000: 1}, "xxx...", "x" * 61 + "..."),
]


@pytest.mark.parametrize("body,mentions,param", BAD_BODIES)
def test_bad_completion_bodies_are_400(http, body, mentions, param):
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert mentions in err["message"]
    assert len(err["message"]) < 1100  # never the whole bad value back
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_bad_json_oversized_prompt_and_unknown_model(http, zmq_client):
    bad = http.post(
        "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert "not valid JSON" in error_of(bad, 400)["message"]
    not_object = http.post("/v1/completions", json=["a", "list"])
    error_of(not_object, 400)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    assert (
        "needs logprobs" in error_of(http.post("/v1/chat/completions", json=chat), 400)["message"]
    )
    chat = {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}
    assert error_of(http.post("/v1/chat/completions", json=chat), 400)["param"] == "messages"
    huge = {**GOOD, "prompt": "word " * 2000}
    for stream in (False, True):
        err = error_of(http.post("/v1/completions", json={**huge, "stream": stream}), 400)
        assert "context" in err["message"]
    err = error_of(http.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    error_of(http.get("/v1/nothing"), 404)
    # Still serving, and nothing leaked (the fixture checks the idle invariant).
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_openai_client_raises_the_matching_errors(base_url, zmq_client):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError, match="top_p"):
            oai.completions.create(model=MODEL, prompt="x", top_p=5)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def read_events(response: httpx.Response, count: int) -> list[str]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line)
            if len(events) == count:
                break
    return events


def test_client_disconnect_aborts_stream_and_whole_requests(http_server, zmq_client):
    body = {**GOOD, "max_tokens": LONG, "ignore_eos": True}
    before = zmq_client.stats()["steps"]
    with (
        httpx.Client(base_url=http_server.http_url, timeout=120) as c,
        c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        assert len(read_events(r, 2)) == 2
    # leaving the block closed the connection mid-stream
    stats = wait_idle(zmq_client)
    assert stats["steps"] - before < LONG // 2
    # Answered in one piece: the front watches the connection while it waits. A raw
    # socket closes once the request is seen running, so the abort cannot come too late.
    before = stats["steps"]
    url = httpx.URL(http_server.http_url)
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        sock.sendall(head + payload)
        deadline = time.monotonic() + 60
        while zmq_client.stats()["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.002)
    stats = wait_idle(zmq_client)
    assert 0 < stats["steps"] - before < LONG - 10


def test_draining_front_answers_503(http_server, zmq_client):
    """The launcher drains the front before the tokenizer fails what is in flight; a
    draining front refuses new work with 503 (checked in-process, on the real server)."""

    async def run() -> list[httpx.Response]:
        async with AsyncClient(http_server.endpoint, timeout=60) as client:
            state = FrontState(client, Metrics(MODEL), MODEL, 512, draining=True)
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://front") as c:
                return [
                    await c.post("/v1/completions", json=GOOD),
                    await c.get("/health"),
                    await c.get("/v1/models"),
                ]

    completion, health, models = asyncio.run(run())
    assert "shutting down" in error_of(completion, 503)["message"]
    error_of(health, 503)
    assert models.status_code == 200


def test_a_front_over_its_requests_in_flight_answers_429():
    """The tokenizer refuses a client over --max-requests-per-client; for the HTTP front,
    one client of the tokenizer, that is a 429 (checked in-process with a stand-in)."""

    class Refusing:
        async def generate_stream(self, **kw):
            raise ServerError(f"{P.TOO_MANY_IN_FLIGHT} (at most 1 per client)", kw["request_id"])
            yield  # an async generator, as the client's

    async def run() -> httpx.Response:
        state = FrontState(Refusing(), Metrics(MODEL), MODEL, 512)
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as c:
            return await c.post("/v1/completions", json=GOOD)

    err = error_of(asyncio.run(run()), 429)
    assert err["type"] == "rate_limit_error"


def test_a_body_too_large_for_the_tokenizer_is_413_and_the_front_keeps_serving(http):
    """The tokenizer drops the connection of a peer that sends a message over
    --max-message-bytes, and the front is one peer for every HTTP request: it must refuse
    such a body itself (8 MiB by default) instead of forwarding it."""
    huge = {**GOOD, "prompt": "x" * (9 << 20)}
    err = error_of(http.post("/v1/completions", json=huge), 413)
    assert "bytes" in err["message"] and len(err["message"]) < 200
    ok = http.post("/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(300)
def test_rejected_large_prompts_leave_no_memory_behind(http, http_server):
    """100 prompts of 5 MiB that the tokenizer refuses (over --max-prompt-chars): the
    front answers each 400 and its resident memory ends within 30 MiB of where it
    started (the cycles a failed request leaves are collected soon after it)."""
    pid = http_server.pids["http"]
    big = {**GOOD, "prompt": "hello world " * (5 * 1024 * 1024 // 12)}
    error_of(http.post("/v1/completions", json=big), 400)  # warm the error path once
    time.sleep(1)
    start = _rss_mib(pid)
    for _ in range(100):
        assert "characters" in error_of(http.post("/v1/completions", json=big), 400)["message"]
    time.sleep(1)  # past the front's delayed collection
    assert _rss_mib(pid) - start < 30
    r = http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200


def test_priority_in_a_body_reaches_the_scheduler_and_a_bad_one_is_a_400(http):
    r = http.post("/v1/completions", json={**GOOD, "priority": -5, "cache_retention": [9, 30]})
    assert r.status_code == 200, r.text
    err = error_of(http.post("/v1/completions", json={**GOOD, "cache_retention": [0, 30]}), 400)
    assert "cache_retention" in err["message"]
    err = error_of(http.post("/v1/completions", json={**GOOD, "priority": "high"}), 400)
    assert "priority" in err["message"]

"""Bad input on the public socket: each gets an error reply to its sender, and a normal
request on the same socket right after succeeds."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq

from radixserve.client import AsyncClient, Client
from radixserve.protocol import MAX_ID_LEN


def gen(**fields):
    return msgpack.packb({"type": "generate", "v": 1, "id": "bad", **fields})


OK = {"prompt": "hello", "sampling": {"max_tokens": 3, "temperature": 0.0}}
CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}

CASES = {
    "malformed msgpack": (b"\xc1\x00garbage", None, "msgpack"),
    "not a map": (msgpack.packb([1, 2, 3]), None, "map"),
    "unknown type": (msgpack.packb({"type": "nope", "v": 1, "id": "bad"}), "bad", "unknown"),
    "internal type": (msgpack.packb({"type": "step", "v": 1, "id": "bad"}), "bad", "unknown"),
    "wrong version": (msgpack.packb({"type": "generate", "v": 99, "id": "bad"}), "bad", "version"),
    "missing id": (msgpack.packb({"type": "generate", "v": 1, "prompt": "x"}), None, "'id'"),
    "missing prompt": (gen(), "bad", "exactly one"),
    "unknown field": (gen(bogus=1, **OK), "bad", "bogus"),
    "prompt not a string": (gen(prompt=5), "bad", "prompt"),
    "input_ids not a list": (gen(input_ids="abc"), "bad", "input_ids"),
    "stream not a bool": (gen(prompt="x", stream="yes"), "bad", "stream"),
    "sampling not a map": (gen(prompt="x", sampling="hot"), "bad", "sampling"),
    "max_tokens a string": (gen(prompt="x", sampling={"max_tokens": "9"}), "bad", "max_tokens"),
    "token outside vocab": (gen(input_ids=[5, 100000]), "bad", "vocabulary"),
    "prompt longer than context": (gen(input_ids=[5] * 600), "bad", "context"),
    "max_tokens 0 with logprobs": (
        gen(prompt="x", sampling={"max_tokens": 0, "logprobs": 2}),
        "bad",
        "max_tokens",
    ),
    "max_tokens negative": (gen(prompt="x", sampling={"max_tokens": -5}), "bad", "max_tokens"),
    "temperature < 0": (gen(prompt="x", sampling={"temperature": -0.5}), "bad", "temperature"),
    "top_p 0": (gen(prompt="x", sampling={"top_p": 0.0}), "bad", "top_p"),
    "top_p > 1": (gen(prompt="x", sampling={"top_p": 1.5}), "bad", "top_p"),
    "unknown sampling field": (gen(prompt="x", sampling={"beam": 2}), "bad", "beam"),
    "empty prompt": (gen(prompt=""), "bad", "empty"),
    "empty input_ids": (gen(input_ids=[]), "bad", "empty"),
    "bad chat role": (gen(messages=[{"role": "wizard", "content": "hi"}]), "bad", "role"),
    "tools without messages": (gen(prompt="x", tools=[TOOL]), "bad", "with chat messages only"),
    "tools not maps": (gen(messages=CHAT, tools=["f"]), "bad", "'tools' must be a list of maps"),
    "special tokens in tools": (
        gen(messages=CHAT, tools=[{"type": "function", "function": {"name": "f</s>"}}]),
        "bad",
        "tool definitions contain special tokens",
    ),
    "two frames": (None, None, "single frame"),
    # limits (the defaults: docs/security.md)
    "n over the limit": (gen(prompt="x", sampling={"n": 17}), "bad", "at most 16"),
    "too many stop strings": (gen(prompt="x", sampling={"stop": ["a"] * 17}), "bad", "stop"),
    "stop string too long": (gen(prompt="x", sampling={"stop": ["a" * 257]}), "bad", "stop"),
    "seeds of n samples overflow": (
        gen(prompt="x", sampling={"seed": 2**63 - 1, "n": 2}),
        "bad",
        "seed",
    ),
    "token id beyond int64": (gen(input_ids=[5, 2**64 - 1]), "bad", "vocabulary"),
    "max_tokens beyond int64": (
        gen(prompt="x", sampling={"max_tokens": 2**64 - 1}),
        "bad",
        "max_tokens",
    ),
    "stop token id outside vocab": (
        gen(prompt="x", sampling={"stop_token_ids": [10**6]}),
        "bad",
        "vocabulary",
    ),
    "prompt over the character limit": (gen(prompt="x" * (1 << 20 | 1)), "bad", "characters"),
    # An id the server cannot echo: the error has no id (radixserve.client never sends one).
    "id too long": (
        msgpack.packb({"type": "generate", "v": 1, "id": "x" * 300, "prompt": "x"}),
        None,
        "256",
    ),
}


@pytest.fixture
def raw(server, client):  # client: the idle check after the test
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)  # liveness only
    sock.connect(server.endpoint)
    yield sock
    sock.close(linger=0)
    ctx.term()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gets_an_error_then_serving_goes_on(raw, case):
    data, error_id, words = CASES[case]
    if data is None:
        raw.send_multipart([gen(**OK), b"extra"])
    else:
        raw.send(data)
    reply = msgpack.unpackb(raw.recv())
    assert reply["type"] == "error"
    assert reply["id"] == error_id
    assert words in reply["message"]
    assert len(reply["message"]) < 300, "an error must not echo the input"
    raw.send(msgpack.packb({"type": "generate", "v": 1, "id": "good", **OK}))
    reply = msgpack.unpackb(raw.recv())
    assert reply["type"] == "result" and reply["id"] == "good"
    assert reply["finish_reason"] in ("stop", "length")


def test_duplicate_id_in_flight(raw):
    slow = {"prompt": "x", "sampling": {"max_tokens": 50, "ignore_eos": True}}
    raw.send(msgpack.packb({"type": "generate", "v": 1, "id": "dup", **slow}))
    raw.send(msgpack.packb({"type": "generate", "v": 1, "id": "dup", **OK}))
    first = msgpack.unpackb(raw.recv())
    assert first["type"] == "error" and "already in use" in first["message"]
    second = msgpack.unpackb(raw.recv())
    assert second["type"] == "result" and len(second["token_ids"]) == 50


@pytest.mark.timeout(120)
def test_a_request_id_the_server_cannot_echo_fails_at_once(server):
    """The server could only answer it with a null id, matching no pending call: the
    clients refuse it before sending instead of waiting out their timeout."""
    too_long = "x" * (MAX_ID_LEN + 1)
    with Client(server.endpoint, timeout=10) as c:
        with pytest.raises(ValueError, match="request_id"):
            c.generate("hello", max_tokens=2, request_id=too_long)
        with pytest.raises(ValueError, match="request_id"):
            next(iter(c.generate_stream("hello", max_tokens=2, request_id=too_long)))
        assert c.generate("hello", max_tokens=2, request_id="x" * MAX_ID_LEN).token_ids

    async def go() -> None:
        async with AsyncClient(server.endpoint, timeout=10) as ac:
            with pytest.raises(ValueError, match="request_id"):
                await ac.generate("hello", max_tokens=2, request_id=too_long)

    asyncio.run(go())

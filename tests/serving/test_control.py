"""Aborts, client disconnects, flushes while busy, timeouts: the server stays correct and
ends idle (the ``client`` fixture checks the idle invariant after each test)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from radixserve import SamplingParams
from radixserve.client import Client, RequestTimeout
from tests.helpers.server import wait_idle

LONG = 400  # more steps than any test waits for: finishing early proves the abort


def test_abort_mid_stream(client):
    stream = client.generate_stream(
        "Abort me", max_tokens=LONG, temperature=0.0, ignore_eos=True, request_id="victim"
    )
    chunks = [next(stream), next(stream)]
    client.abort("victim")
    chunks += list(stream)
    assert chunks[-1].finish_reason == "abort"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert len(chunks) < LONG


def test_abort_is_scoped_to_the_sender(server, client):
    with Client(server.endpoint, timeout=120) as other:
        stream = client.generate_stream(
            "Mine", max_tokens=LONG, temperature=0.0, ignore_eos=True, request_id="shared-id"
        )
        first = next(stream)
        other.abort("shared-id")  # another client's id space: must not touch ours
        # One peer's messages are handled in order, and stats passes through the scheduler:
        # once it answers, a misrouted abort would already have stopped the request.
        assert other.stats()["running"] == 1
        client.abort("shared-id")
        rest = list(stream)
    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort"
    assert 1 + len(rest) < LONG


def _raw_generate(server, rid: str, input_ids: list[int], stream: bool):
    """A long greedy request sent from a bare DEALER socket; returns (context, socket)."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(server.endpoint)
    request = {
        "type": "generate",
        "v": 1,
        "id": rid,
        "input_ids": input_ids,
        "sampling": {"max_tokens": LONG, "temperature": 0.0, "ignore_eos": True},
        "stream": stream,
    }
    raw.send(msgpack.packb(request))
    return ctx, raw


def test_client_disconnect_aborts_its_requests(server, client):
    steps_before = client.stats()["steps"]
    ctx, raw = _raw_generate(server, "leaver", [5, 6, 7, 8], stream=True)
    for _ in range(2):
        assert msgpack.unpackb(raw.recv())["type"] == "chunk"
    raw.close(linger=0)
    ctx.term()
    stats = wait_idle(client)
    # The request stopped long before its max_tokens: the server noticed the client left.
    assert stats["steps"] - steps_before < LONG // 2


def test_client_disconnect_aborts_a_non_streaming_request(server, client):
    """No reply goes to it before its request finishes: the server must notice the
    connection closing (socket monitor), not a reply it cannot route."""
    steps_before = client.stats()["steps"]
    ctx, raw = _raw_generate(server, "quiet-leaver", [5, 6, 7, 9], stream=False)
    while client.stats()["running"] == 0:
        pass
    raw.close(linger=0)
    ctx.term()
    stats = wait_idle(client)
    assert stats["steps"] - steps_before < LONG // 2


def test_flush_while_busy(client, engine):
    rng = np.random.default_rng(4)
    cached_prompt = rng.integers(4, 512, 40).tolist()
    client.generate(input_ids=cached_prompt, max_tokens=4, temperature=0.0)
    assert client.stats()["pages_evictable"] >= 10
    busy = rng.integers(4, 512, 30).tolist()
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    stream = client.generate_stream(input_ids=busy, sampling_params=sp)
    chunks = [next(stream)]
    freed = client.flush_cache()
    chunks += list(stream)
    assert freed >= 10  # the finished request's pages went; the running one kept its own
    [want] = engine.generate([busy], sp)
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    after = client.generate(input_ids=cached_prompt, max_tokens=4, temperature=0.0)
    assert after.usage.cached_tokens == 0  # it was flushed


def test_timeout_raises_clearly():
    ctx = zmq.Context()
    probe = ctx.socket(zmq.ROUTER)  # a peer that never answers
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=0.3) as c:
            with pytest.raises(RequestTimeout, match="no reply"):
                c.generate("hello", max_tokens=2)
            with pytest.raises(RequestTimeout):
                c.stats()
    finally:
        probe.close(linger=0)
        ctx.term()

"""The wire protocol: every message round-trips, and decode rejects what it must."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from radixserve import protocol as P
from radixserve.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=5, temperature=0.0, stop=["x"], seed=3)
I32 = np.array([1, -2, 2**31 - 1], dtype=np.int32)

MESSAGES = [
    P.Generate(id="a", prompt="hi", sampling=SP, stream=True, cache_salt="s"),
    P.Generate(id="b", input_ids=[1, 2], messages=None),
    P.Generate(id="c", messages=[{"role": "user", "content": "hi"}]),
    P.Generate(
        id="t",
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    ),
    P.Abort(id="a"),
    P.FlushCache(id="f"),
    P.FlushCache(id="f", admin_key="k"),
    P.Stats(id="s"),
    P.Health(id="h"),
    P.Check(id="c"),
    P.Check(id="c", admin_key="k"),
    P.Chunk(id="a", index=1, text="é", token_ids=[3], finish_reason="stop", usage={"x": 1}),
    P.ResultMsg(id="a", index=0, text="t", token_ids=[], finish_reason="length", usage={}),
    P.Error(id=None, message="bad"),
    P.Reply(id="s", data={"pages_free": 3}),
    P.AddRequest(rid="r", input_ids=I32, sampling=SP, salt=None),
    P.AbortRequest(rid="r", reason="stop", index=2),
    P.Flush(tag=1),
    P.GetStats(tag=2),
    P.CheckIdle(tag=3),
    P.Outputs(items=[P.OutputItem("r", 0, [1, -2, 2**31 - 1], None, 4, 1, 2)]),
    P.RequestError(rid="r", message="too long"),
    P.AdminReply(tag=1, data={"freed_pages": 0}),
    P.Step(
        [
            P.StepReq(0, I32, 5, I32[:1], False, None),
            P.StepReq(1, I32, 0, I32, True, SP),
            P.StepReq(2, I32, 9, I32, window_start=2, window_pages=I32),
        ],
        release=I32,
        step_id=7,
    ),
    P.StepResult(step_id=7, tokens=I32),
    P.Ready(process="worker", info={"num_pages": 8}),
    P.Shutdown(message="bye"),
    P.Draining(process="http"),
]


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype == np.int32 and np.array_equal(a, b)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, P.Message):
        return type(a) is type(b) and all(_same(v, getattr(b, k)) for k, v in vars(a).items())
    return a == b


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = msg.encode()
    raw = msgpack.unpackb(data)
    assert raw["type"] == msg.TYPE and raw["v"] == P.PROTOCOL_VERSION
    assert _same(P.decode(data), msg)


def test_int32_arrays_travel_as_little_endian_bytes():
    raw = msgpack.unpackb(P.StepResult(1, I32).encode())
    assert raw["tokens"] == b"\x01\x00\x00\x00\xfe\xff\xff\xff\xff\xff\xff\x7f"


def test_public_decode_refuses_internal_types():
    with pytest.raises(P.ProtocolError, match="unknown message type"):
        P.decode(P.Step([], I32, step_id=1).encode(), P.PUBLIC_REQUESTS)


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"type": "generate", "v": 1, "id": "q", "prompt": 1}, "'prompt' must be a string"),
        ({"type": "generate", "v": 1, "id": "q", "sampling": {"n": 0}}, "n must be"),
        ({"type": "generate", "v": 1, "id": "q", "sampling": {"stop": 5}}, "sampling"),
        ({"type": "generate", "v": 1, "id": "", "prompt": "x"}, "'id'"),
        ({"type": "generate", "v": 1, "id": "q", "tools": ["f"]}, "'tools' must be a list of maps"),
        ({"type": "generate", "id": "q"}, "version"),
        ({"type": "step_result", "v": 1, "step_id": 1, "tokens": b"abc"}, "int32"),
        ({"type": "abort_request", "v": 1, "rid": "r", "reason": "why"}, "reason"),
        ({"type": "outputs", "v": 1, "items": [{"rid": "r"}]}, "missing field"),
    ],
)
def test_decode_rejects(raw, words):
    with pytest.raises(P.ProtocolError, match=words) as info:
        P.decode(msgpack.packb(raw))
    if raw.get("id") == "q":
        assert info.value.request_id == "q"  # so the error reaches the right request

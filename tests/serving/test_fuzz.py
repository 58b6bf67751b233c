"""A bounded, seeded fuzz of the public socket: hostile frames never crash or wedge the server.

Several raw DEALER peers send a few thousand frames drawn from one seed: random
bytes, truncated and bit-flipped encodings of valid messages, maps with fields of
the wrong type, out-of-range integers, huge and nested values, unknown types,
multi-frame messages, and valid requests (some aborted, some left to finish).
Then:
- every reply is a msgpack map of a known type, and any reply with an id
  answers an id that peer sent;
- the server still answers every peer (a ``stats`` on each);
- once idle, the scheduler's invariant holds (no page leaked, no lock left), and
  a known request still gets the Engine's greedy tokens.

The longer run with kills and KV pressure belongs in ``bench/`` (a soak), not here.
"""

from __future__ import annotations

import random

import msgpack
import pytest
import zmq

from radixserve.sampling_params import SamplingParams
from tests.helpers.server import wait_idle

FRAMES = 2400
PEERS = 4
REPLY_TYPES = {"chunk", "result", "error", "reply"}  # protocol/public.py: what a client receives

VALID = [
    {"type": "generate", "v": 1, "id": "g", "input_ids": [5, 6, 7, 8],
     "sampling": {"max_tokens": 3, "temperature": 0.0}},
    {"type": "generate", "v": 1, "id": "g", "prompt": "hello there",
     "sampling": {"max_tokens": 2, "temperature": 0.7, "seed": 3, "n": 2}, "stream": True},
    {"type": "generate", "v": 1, "id": "g", "messages": [{"role": "user", "content": "hi"}],
     "sampling": {"max_tokens": 2, "stop": ["x"]}},
    {"type": "abort", "v": 1, "id": "g"},
    {"type": "stats", "v": 1, "id": "g"},
    {"type": "health", "v": 1, "id": "g"},
]  # fmt: skip

WILD_VALUES = [
    None, True, -1, 0, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1e308, float("nan"),
    float("-inf"), "", "x" * 5000, "\udcff".encode("utf-8", "surrogatepass"), b"\x00" * 17,
    [], [None], [[1, [2, [3]]]], {}, {"a": {"b": {"c": []}}}, [-5, 10**9], list(range(300)),
]  # fmt: skip


def _mutated_map(rng: random.Random, rid: str) -> dict:
    msg = dict(rng.choice(VALID))
    msg["id"] = rid
    if "sampling" in msg:
        msg["sampling"] = dict(msg["sampling"])
    for _ in range(rng.randint(1, 3)):
        target = msg["sampling"] if "sampling" in msg and rng.random() < 0.5 else msg
        keys = list(target) + ["max_tokens", "top_k", "n", "logprobs", "zzz", "type", "v"]
        target[rng.choice(keys)] = rng.choice(WILD_VALUES)
    return msg


def _frame(rng: random.Random, rid: str) -> list[bytes]:
    kind = rng.random()
    if kind < 0.15:
        return [rng.randbytes(rng.randint(0, 64))]
    if kind < 0.30:
        data = msgpack.packb({**rng.choice(VALID), "id": rid})
        data = bytearray(data[: rng.randint(0, len(data))])
        if data and rng.random() < 0.5:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        return [bytes(data)]
    if kind < 0.40:
        return [msgpack.packb(rng.choice([[1, 2], "generate", 7, None, {"type": rng.random()}]))]
    if kind < 0.48:
        return [msgpack.packb({**rng.choice(VALID), "id": rid}), b"extra"]
    if kind < 0.55:
        return [msgpack.packb({"type": rng.choice(["step", "outputs", "shutdown", "x"]),
                               "v": 1, "id": rid})]  # fmt: skip
    if kind < 0.70:
        return [msgpack.packb({**rng.choice(VALID), "id": rid})]
    try:
        return [msgpack.packb(_mutated_map(rng, rid))]
    except (OverflowError, TypeError, ValueError):  # msgpack cannot encode it: raw bytes instead
        return [rng.randbytes(8)]


def _drain(sock: zmq.Socket, sent: set[str], replies: list[dict]) -> None:
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        reply = msgpack.unpackb(data, raw=False)
        assert isinstance(reply, dict) and reply.get("type") in REPLY_TYPES, reply
        rid = reply.get("id")
        assert rid is None or rid in sent, f"a reply for an id this peer never sent: {rid!r}"
        replies.append(reply)


@pytest.mark.timeout(300)
def test_hostile_frames_neither_crash_nor_leak(server, client, engine):
    rng = random.Random(20261201)
    ctx = zmq.Context()
    peers = []
    for _ in range(PEERS):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        peers.append((sock, set(), []))
    try:
        for n in range(FRAMES):
            sock, sent, replies = peers[n % PEERS]
            rid = f"f{n}"
            sent.add(rid)
            frames = _frame(rng, rid)
            sock.send_multipart(frames)
            if n % 50 == 0:
                for p in peers:
                    _drain(*p)
        for sock, sent, _ in peers:
            sent.add("alive")
            sock.send(msgpack.packb({"type": "stats", "v": 1, "id": "alive"}))
        for sock, sent, replies in peers:
            # Everything before the stats was answered or dropped; the stats is answered.
            deadline_polls = 600
            while not any(r.get("id") == "alive" for r in replies) and deadline_polls:
                sock.poll(100)
                _drain(sock, sent, replies)
                deadline_polls -= 1
            assert any(r.get("id") == "alive" for r in replies), "the server stopped answering"
        assert sum(len(r) for _, _, r in peers) > FRAMES // 4  # most frames got an answer
    finally:
        for sock, _, _ in peers:
            sock.close(linger=0)
        ctx.term()
    wait_idle(client)
    assert client.check()["ok"]
    prompt = [11, 12, 13, 14, 15, 16]
    sp = SamplingParams(max_tokens=6, temperature=0.0)
    [expected] = engine.generate([prompt], sp)
    got = client.generate(input_ids=prompt, sampling_params=sp)
    assert got.token_ids == expected.token_ids

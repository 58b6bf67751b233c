"""The ZAP handler's answers: allowed keys in, others and malformed requests out."""

from __future__ import annotations

import pytest
import zmq
from zmq.utils import z85

from radixserve.zap import ZapHandler


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def request(mechanism: bytes, *credentials: bytes) -> list[bytes]:
    return [b"1.0", b"7", b"radixserve", b"10.0.0.9", b"", mechanism, *credentials]


def test_only_allowed_curve_keys_are_admitted(ctx):
    allowed_public, _ = zmq.curve_keypair()
    other_public, _ = zmq.curve_keypair()
    zap = ZapHandler(ctx, frozenset([allowed_public]))
    ok = zap.answer(request(b"CURVE", z85.decode(allowed_public)))
    assert ok[:3] == [b"1.0", b"7", b"200"] and ok[4] == allowed_public
    assert zap.answer(request(b"CURVE", z85.decode(other_public)))[2] == b"400"
    assert zap.answer(request(b"NULL"))[2] == b"400"
    assert zap.answer(request(b"PLAIN", b"user", b"password"))[2] == b"400"
    assert zap.answer([b"1.0", b"7"])[2] == b"500"
    assert zap.answer([b"2.0", *request(b"CURVE", b"k")[1:]])[2] == b"500"


def test_any_key_is_admitted_without_an_allowed_set(ctx):
    public, _ = zmq.curve_keypair()
    zap = ZapHandler(ctx, None)
    assert zap.answer(request(b"CURVE", z85.decode(public)))[2] == b"200"

"""The client's view of its connection (``client.common.Link``), driven by synthetic
socket-monitor events: what fails when, and what never fails early."""

from __future__ import annotations

import struct

import pytest
import zmq

from radixserve.client import ConnectionLost
from radixserve.client import common as C


def event(kind: int) -> list[bytes]:
    return [struct.pack("=hi", kind, 7), b"tcp://127.0.0.1:1"]


UP = event(zmq.EVENT_HANDSHAKE_SUCCEEDED)
DOWN = event(zmq.EVENT_DISCONNECTED)


def test_nothing_fails_before_the_first_connection():
    link = C.Link("tcp://x")
    assert not link.on_event(DOWN)  # a handshake that never succeeded is no drop
    assert link.to_fail(["a"], dropped=False) == []
    link.check_send("b")


def test_no_handshake_within_the_connect_timeout_fails_with_no_server(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(C.time, "monotonic", lambda: now[0])
    link = C.Link("tcp://x", connect_timeout=5.0)
    assert link.to_fail(["a"], dropped=False) == []  # still within its window
    now[0] += 5.0
    lost = link.to_fail(["a", "b"], dropped=False)
    assert [x.id for x in lost] == ["a", "b"] and {x.error for x in lost} == {C.NoServer}
    assert "nothing answered at tcp://x within 5 s" in lost[0].message
    assert [x.id for x in link.to_fail(["c"], dropped=False)] == ["c"]  # sent later: too
    with pytest.raises(C.NoServer, match="no server listens there"):
        C._raise_on_error(lost[0])
    assert issubclass(C.NoServer, ConnectionLost)
    assert not link.on_event(UP)  # a server came up after all: nothing fails any more
    assert link.to_fail(["d"], dropped=False) == []


def test_a_drop_fails_every_pending_request_once_then_a_long_outage_refuses(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(C.time, "monotonic", lambda: now[0])
    link = C.Link("tcp://x")
    assert not link.on_event(UP)
    assert link.on_event(DOWN)
    lost = link.to_fail(["a", "b"], dropped=True)
    assert [x.id for x in lost] == ["a", "b"] and "dropped" in lost[0].message
    link.check_send("c")  # within the grace a reconnect may still come
    assert link.to_fail(["c"], dropped=False) == []
    now[0] += C.LINK_GRACE_S
    assert [x.id for x in link.to_fail(["a", "c"], dropped=False)] == ["c"]  # a: failed
    assert link.to_fail(["a", "c"], dropped=False) == []  # once per request
    with pytest.raises(ConnectionLost) as info:
        link.check_send("d")
    assert info.value.request_id == "d"
    assert not link.on_event(UP)  # reconnected: requests go again
    link.check_send("d")
    assert link.to_fail(["d"], dropped=False) == []


def test_link_lost_raises_connection_lost_a_server_error():
    with pytest.raises(C.ServerError) as info:
        C._raise_on_error(C.LinkLost("r1", "gone"))
    assert isinstance(info.value, ConnectionLost) and info.value.request_id == "r1"


def test_routing_ids_are_random_and_never_zero_led():
    ids = {C.routing_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) == 16 and i[0] != 0 for i in ids)


def test_request_ids_the_server_cannot_echo_are_refused():
    C.check_request_id("x" * C.P.MAX_ID_LEN)
    for bad in ("", "x" * (C.P.MAX_ID_LEN + 1)):
        with pytest.raises(ValueError, match="request_id"):
            C.check_request_id(bad)


def failed(kind: int, value: int) -> list[bytes]:
    return [struct.pack("=hi", kind, value), b"tcp://127.0.0.1:1"]


@pytest.mark.parametrize(
    ("curve", "frames", "words"),
    [
        (False, failed(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                       zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH), "requires CURVE"),
        (True, failed(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                      zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH), "uses none"),
        (True, failed(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), "refused this client's CURVE key"),
        (True, failed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32), "curve_server_key"),
    ],
)  # fmt: skip
def test_a_failed_handshake_fails_at_once_and_refuses_until_one_succeeds(curve, frames, words):
    link = C.Link("tcp://x", curve=curve)
    assert link.on_event(frames)  # before any connection was up
    lost = link.to_fail(["a", "b"], dropped=True)
    assert [x.id for x in lost] == ["a", "b"]
    assert "authentication" in lost[0].message and words in lost[0].message
    assert link.on_event(frames) and link.to_fail(["a", "b"], dropped=True) == []  # once each
    with pytest.raises(ConnectionLost, match=words):
        link.check_send("c")
    assert not link.on_event(UP)
    link.check_send("c")


def test_a_handshake_without_detail_waits_for_the_next_without_keys():
    """Without keys, a server requiring CURVE may close before its greeting is read; the
    reconnect then reports the mechanism mismatch."""
    link = C.Link("tcp://x", curve=False)
    assert not link.on_event(failed(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32))
    assert link.to_fail(["a"], dropped=False) == []
    link.check_send("b")

"""How the router answers an admin call it sent to every live replica
(``Router._maybe_answer``): health and stats say what the replicas said, a replica
that answered with an error a row with it; the other calls fail as a whole on any
error; every call fails when no replica answered."""

from __future__ import annotations

from types import SimpleNamespace

from radixserve import protocol as P
from radixserve.router.server import Router, _Fanout
from radixserve.router.totals import CounterTotals


def _router(n: int = 2):
    """A router with ``n`` replicas, none of its sockets: what it sends is kept."""
    router = Router.__new__(Router)
    router.replicas = [
        SimpleNamespace(index=i, name=f"tcp://r{i}", prefill=False, up=True, routed=0,
                        failed=0, in_flight={}, mirror=None)
        for i in range(n)
    ]  # fmt: skip
    router.config = SimpleNamespace(prefill=None)
    router.endpoint, router.requests, router.totals = "tcp://router", {}, CounterTotals()
    router.fanouts, router.sent = {}, []
    router._send = lambda identity, msg: router.sent.append(msg)  # type: ignore[method-assign]
    router._send_error = lambda identity, rid, message: router.sent.append(  # type: ignore[method-assign]
        P.Error(rid, message)
    )
    return router


def _answer(kind: type, answers: dict[int, P.Message]) -> P.Message:
    router = _router()
    router.fanouts["1"] = _Fanout(b"c", "id", kind, set(), dict(answers))
    router._maybe_answer("1")
    (msg,) = router.sent
    return msg


STATS = {"running": 1, "waiting": 0, "pages_free": 10, "hit_tokens": 5, "query_tokens": 9}
DIED = P.Error("x", "tcp://r1: the server stopped: its worker process exited (code -9)")


def test_stats_with_one_replica_failing_say_what_the_other_said():
    msg = _answer(P.Stats, {0: P.Reply("x", STATS), 1: DIED})
    assert isinstance(msg, P.Reply) and msg.data["running"] == 1
    rows = msg.data["replicas"]
    assert rows[0]["stats"] == STATS and "error" not in rows[0]
    assert rows[1]["error"] == DIED.message and "stats" not in rows[1]


def test_stats_fail_when_every_replica_failed_or_none_answered():
    msg = _answer(P.Stats, {0: DIED, 1: DIED})
    assert isinstance(msg, P.Error) and "worker process exited" in msg.message
    msg = _answer(P.Stats, {})
    assert isinstance(msg, P.Error) and "no replica is up" in msg.message


def test_a_flush_fails_as_a_whole_on_one_error():
    msg = _answer(P.FlushCache, {0: P.Reply("x", {"freed_pages": 3}), 1: DIED})
    assert isinstance(msg, P.Error) and msg.message.startswith("tcp://r1: ")


def test_health_keeps_answering_with_the_error_in_its_row():
    msg = _answer(P.Health, {0: P.Reply("x", {"status": "ok"}), 1: DIED})
    assert isinstance(msg, P.Reply) and msg.data["status"] == "ok"
    assert msg.data["replicas"][1]["error"] == DIED.message

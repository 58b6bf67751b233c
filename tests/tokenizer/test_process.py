"""The tokenizer process's front door, run in this process against real ZeroMQ sockets:
message size, requests in flight per client, short error replies, what goes on to the
scheduler. The scheduler is a PULL socket here; its answers are handed in directly."""

from __future__ import annotations

import os
import shutil
import tempfile

import msgpack
import pytest
import zmq

from radixserve import protocol as P
from radixserve.config import EngineConfig, ModelInfo
from radixserve.models.tokenizer import load_tokenizer
from radixserve.server_config import SCHEDULER_IN, ServerConfig
from radixserve.tokenizer.process import TokenizerServer
from radixserve.utils.proc import Lifeline

INFO = ModelInfo(
    num_pages=256,
    page_size=1,
    max_context_len=64,
    vocab_size=512,
    eos_token_ids=(2,),
    model_name="tiny",
    backend_name="torch",
    dtype="float64",
    dtype_reason="as asked",
)
LIMITS = {"max_message_bytes": 4096, "max_requests_per_client": 2, "max_queued_replies": 500}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return load_tokenizer(str(tiny_llama_dir))


@pytest.fixture
def front(tokenizer, tiny_llama_dir):
    run_dir = tempfile.mkdtemp(prefix="rs-")
    engine = EngineConfig(model=str(tiny_llama_dir), **LIMITS)
    cfg = ServerConfig(engine=engine, port=0, run_dir=run_dir, model=INFO)
    ctx = zmq.Context()
    scheduler = ctx.socket(zmq.PULL)
    scheduler.bind(cfg.endpoint(SCHEDULER_IN))
    server = TokenizerServer(cfg, ctx, tokenizer, Lifeline(os.getppid()))
    clients = []

    def client():
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.connect(server.endpoint)
        clients.append(sock)
        return sock

    yield server, scheduler, client
    for sock in clients:
        sock.close(linger=0)
    server.gate.close()
    for sock in (scheduler, server.public.monitor, server.router, server.inbox,
                 server.to_scheduler):  # fmt: skip
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(run_dir, ignore_errors=True)


def pump(server, timeout_ms=2000) -> int:
    """Handle the client messages that arrive within ``timeout_ms``; how many there were."""
    poller = zmq.Poller()
    server.public.register(poller)
    n = 0
    for identity, frames in server.public.receive(dict(poller.poll(timeout_ms))):
        if frames is not None:  # None: a connection closed
            server.handle_client([identity, *frames])
            n += 1
    return n


def gen(rid, **fields):
    fields.setdefault("prompt", "hello")
    return msgpack.packb({"type": "generate", "v": 1, "id": rid, **fields})


def reply(sock):
    return msgpack.unpackb(sock.recv())


def test_a_message_over_the_size_limit_never_reaches_the_server(front):
    server, scheduler, client = front
    big = client()
    big.send(gen("big", prompt="x" * 8000))
    assert pump(server, 500) == 0, "an oversized message was read"
    small = client()
    small.send(gen("ok"))
    assert pump(server) == 1
    assert P.decode(scheduler.recv(), {"add_request": P.AddRequest}).rid.endswith("/1")


def test_requests_in_flight_are_limited_per_client(front):
    server, scheduler, client = front
    a, b = client(), client()
    for i in range(3):
        a.send(gen(f"a{i}"))
    while pump(server, 500):
        pass
    err = reply(a)
    assert err["type"] == "error" and err["id"] == "a2"
    assert err["message"].startswith(P.TOO_MANY_IN_FLIGHT)
    rids = [P.decode(scheduler.recv()).rid for _ in range(2)]
    b.send(gen("b0"))  # another client is not affected
    pump(server)
    assert P.decode(scheduler.recv()).rid
    # One of a's requests finishes: a may send again.
    item = P.OutputItem(rids[0], 0, [5], "length", 1, 1, 0)
    server.handle_internal(P.Outputs([item]))
    assert reply(a)["type"] == "result"
    a.send(gen("a3"))
    pump(server)
    assert P.decode(scheduler.recv()).rid


def test_stop_strings_stay_in_the_tokenizer(front):
    server, scheduler, client = front
    c = client()
    c.send(gen("s", sampling={"stop": ["zzz", "yy"], "stop_token_ids": [7], "n": 2}))
    pump(server)
    add = P.decode(scheduler.recv())
    assert add.sampling.stop == () and add.sampling.stop_token_ids == (7,)
    assert server.requests[add.rid].outputs[1].stop.stop == ("zzz", "yy")


def test_error_replies_do_not_echo_the_input(front):
    server, _, client = front
    c = client()
    c.send(msgpack.packb({"type": "x" * 3000, "v": 1, "id": "e1"}))
    c.send(gen("e2", **{"f" * 3000: 1}))
    c.send(gen("e3", sampling={"g" * 3000: 1}))
    c.send(gen("e4", sampling={"seed": 2**63 - 1, "n": 2}))
    while pump(server, 500):
        pass
    for rid in ("e1", "e2", "e3", "e4"):
        r = reply(c)
        assert (r["type"], r["id"]) == ("error", rid)
        assert len(r["message"]) < 200, r["message"]


def test_the_send_high_water_mark_is_the_limit(front):
    server, _, _ = front
    assert server.router.getsockopt(zmq.SNDHWM) == LIMITS["max_queued_replies"]
    assert server.router.getsockopt(zmq.MAXMSGSIZE) == LIMITS["max_message_bytes"]


def test_health_states_the_message_limit_clients_check_against(front):
    server, scheduler, client = front
    sock = client()
    sock.send(msgpack.packb({"type": "health", "v": 1, "id": "h"}))
    assert pump(server) == 1
    asked = P.decode(scheduler.recv(), {"get_stats": P.GetStats})
    server.on_admin_reply(P.AdminReply(asked.tag, {}))
    answer = P.decode(sock.recv(), P.PUBLIC_REPLIES)
    assert answer.data["status"] == "ok"
    assert answer.data["max_message_bytes"] == LIMITS["max_message_bytes"]

"""Tensor parallelism across nodes: two ``radixserve launch`` commands on this machine
(the head and node 1, one rank each, over loopback with CURVE on the step relay)
serve what one rank serves, and killing node 1 stops the head with errors to its
clients; the pieces in-process: the layout's refusals, the relay between a leader
and its followers (CURVE, a refused key, either side gone), the ranks' meeting
(settings that differ, a follower dead before it joins)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch
import zmq

from radixserve import Engine, SamplingParams
from radixserve import protocol as P
from radixserve.client import Client, ServerError
from radixserve.config import EngineConfig
from radixserve.curve import load_allowed_keys, load_secret_certificate, write_keys
from radixserve.nodes import check_nodes
from radixserve.server_config import ServerConfig
from radixserve.worker.relay import LeaderGone, StepFeed, StepRelay
from radixserve.worker.rendezvous import Rendezvous, meet, open_store
from tests.helpers.server import Server
from tests.helpers.tiny_models import make_tiny_model, use_char_tokenizer

PROMPTS = ["the common part of every prompt, then one", "something else"]


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    """8 query / 4 KV heads, a character tokenizer."""
    folder = make_tiny_model(
        tmp_path_factory.mktemp("mn-chars"), "llama", seed=4, tokenizer=False, vocab_size=128,
        num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    return use_char_tokenizer(folder)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Node key pairs: the head, node1 (allowed: in ``clients``) and a stranger (not)."""
    d = tmp_path_factory.mktemp("node-keys")
    write_keys(d, ["head", "node1"], server=False)
    write_keys(d / "other", ["stranger"], server=False)
    return d


def _free_port_pair() -> int:
    """A port whose successor is free too (the store and the relay)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def test_two_nodes_serve_like_one_rank_and_stop_together(char_dir, keys):
    want = Engine(str(char_dir), dtype="float64", warmup=False, num_pages=256)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in want.generate(PROMPTS, sp)]
    want.close()
    common = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{_free_port_pair()}",
              "--num-pages", "256", "--page-size", "4", "--no-warmup", "--threads", "1"]  # fmt: skip
    head = Server(char_dir, *common, "--node-rank", "0",
                  "--curve-node-key", str(keys / "head.key_secret"),
                  "--curve-allowed-nodes", str(keys / "clients"), wait=False)  # fmt: skip
    node1 = Server(char_dir, *common, "--node-rank", "1",
                   "--curve-node-key", str(keys / "node1.key_secret"),
                   "--curve-head-key", str(keys / "clients" / "head.key"), wait=False)  # fmt: skip
    try:
        head.wait_started()
        node1.wait_started()
        assert "tp=2 weights_mib=" in head.summary and set(head.pids) == {
            "worker", "scheduler", "tokenizer"}  # fmt: skip
        assert "node 1 of 2: worker ranks 1 joined" in node1.summary
        assert set(node1.pids) == {"worker1"}
        with Client(head.endpoint, timeout=120) as c:
            got = [c.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in PROMPTS]
            assert [r.token_ids for r in got] == expected
            stream = c.generate_stream(prompt="go on", max_tokens=400, ignore_eos=True)
            next(stream)
            node1.proc.kill()  # node 1's launcher: its rank follows it, the head stops
            with pytest.raises(ServerError, match="the server stopped"):
                for _ in stream:
                    pass
        assert head.wait() == 1
        assert node1.wait_orphans_gone() == [] and head.wait_orphans_gone() == []
    finally:
        for srv in (head, node1):
            if srv.proc.poll() is None:
                srv.proc.kill()
            srv.proc.wait()


def _config(**kw) -> ServerConfig:
    tp = kw.pop("tp", 2)
    return ServerConfig(engine=EngineConfig(tp=tp), **kw)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tp=3, nnodes=2, dist_init_addr="127.0.0.1:5000"), "--tp 3 cannot be spread"),
        (dict(nnodes=2), "needs --dist-init-addr"),
        (dict(nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:5000"), "--node-rank 2"),
        (dict(nnodes=2, dist_init_addr="127.0.0.1"), "expected HOST:PORT"),
        (dict(nnodes=2, dist_init_addr="10.1.2.3:5000"), "needs CURVE keys"),
        (dict(nnodes=2, node_rank=1, dist_init_addr="node0:5000"), "needs CURVE keys"),
        (dict(nnodes=2, dist_init_addr="10.1.2.3:5000", curve_node_key="k"), "--curve-allowed"),
    ],
)
def test_node_layouts_that_cannot_work_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        check_nodes(_config(**kw))


def test_loopback_nodes_need_no_keys_and_keys_are_checked(keys):
    check_nodes(_config(nnodes=2, dist_init_addr="127.0.0.1:5000"))
    check_nodes(_config(nnodes=2, node_rank=1, dist_init_addr="[::1]:5000"))
    remote = _config(nnodes=2, node_rank=1, dist_init_addr="10.1.2.3:5000",
                     curve_node_key=str(keys / "node1.key_secret"))  # fmt: skip
    check_nodes(replace(remote, curve_head_key=str(keys / "clients" / "head.key")))
    with pytest.raises(ValueError, match="no such certificate"):
        check_nodes(replace(remote, curve_head_key=str(keys / "missing.key")))


def test_relay_over_curve_and_either_side_gone(keys, tmp_path):
    head_pub, head_sec = load_secret_certificate(keys / "head.key_secret")
    allowed = load_allowed_keys(keys / "clients")
    ctx = zmq.Context()
    try:
        port = _free_port_pair()
        relay = StepRelay(ctx, f"ipc://{tmp_path}/relay", f"tcp://127.0.0.1:{port}",
                          (head_pub, head_sec, allowed))  # fmt: skip
        node1 = load_secret_certificate(keys / "node1.key_secret")
        feed = StepFeed(ctx, f"tcp://127.0.0.1:{port}", 1, (head_pub, *node1))
        local = StepFeed(ctx, f"ipc://{tmp_path}/relay", 2)
        stranger = load_secret_certificate(keys / "other" / "stranger.key_secret")
        refused = StepFeed(ctx, f"tcp://127.0.0.1:{port}", 3, (head_pub, *stranger))
        for rank, f in ((1, feed), (2, local)):
            f.hello(P.Ready(f"worker{rank}", {"rank": rank}))
        hellos = relay.wait_joined([1, 2], 30, lambda: None)
        assert [P.decode(h, {P.Ready.TYPE: P.Ready}).process for h in hellos] == [
            "worker1", "worker2"]  # fmt: skip
        with pytest.raises(LeaderGone, match="refused this node's CURVE handshake"):
            refused.wait_connected(30, lambda: None)
        feed.wait_connected(30, lambda: None)
        local.wait_connected(30, lambda: None)
        relay.ping()  # skipped by the followers
        relay.send(b"step bytes")
        for f in (feed, local):
            got = None
            while got is None:
                got = f.next(100)
            assert got == b"step bytes"
        local.sock.close()  # rank 2 is gone: the leader's next ping says so
        with pytest.raises(RuntimeError, match="rank 2 is gone"):
            while True:
                relay.ping()
                feed.next(50)
        relay.sock.close()  # the leader is gone: node 1's rank hears it
        with pytest.raises(LeaderGone, match="closed"):
            while True:
                feed.next(100)
    finally:
        ctx.destroy(linger=0)


def test_ranks_with_other_settings_do_not_form_a_group(tmp_path):
    rv = Rendezvous(2, str(tmp_path), timeout=60)
    errors: list[BaseException] = []

    def rank(r: int, settings: dict) -> None:
        try:
            meet(open_store(rv, r, lambda: None), rv, r, settings, lambda: None)
        except RuntimeError as e:
            errors.append(e)

    threads = [
        threading.Thread(target=rank, args=(r, {"dtype": "float64", "num_pages": 256 + r}))
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 2
    assert all("rank 1 was started with other settings" in str(e) for e in errors)
    assert "num_pages=257 (rank 0: 256)" in str(errors[0])


def test_engine_fails_at_once_when_a_follower_dies_before_joining(char_dir, monkeypatch):
    from radixserve.worker.tp import WorkerGroup

    def crashing(self, rank):
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    monkeypatch.setattr(WorkerGroup, "_spawn", crashing)
    threads = torch.get_num_threads()
    # Waiting for the dead rank would take the hour of dist_timeout (pytest-timeout ends
    # it first); the meeting's polls see the exit.
    config = EngineConfig(model=str(char_dir), dtype="float64", tp=2, dist_timeout=3600)
    with pytest.raises(RuntimeError, match=r"rank 1 exited \(code 3\)"):
        WorkerGroup(config)
    assert torch.get_num_threads() == threads

"""The router over two real replicas of a tiny model (small pools: eviction happens).

The router runs in this process (a thread), so the test reads its routing
decisions and mirrors; the replicas are real ``radixserve launch --kv-events``
servers. Proven here: greedy outputs equal the in-process Engine's; every
request goes where the mirror says its longest cached prefix is, and the
replica then reports exactly that many cached tokens (so the mirror knew every
insert and eviction); killing a replica fails only the requests in flight on
it, new ones go to the other, and a replica started again on the same port is
routed to again, its mirror rebuilt from a snapshot.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
import zmq

from radixserve.client import Client, ServerError
from radixserve.router.policy import PolicyConfig
from radixserve.router.server import Router, RouterConfig
from tests.helpers.server import Server, wait_idle

PAGE = 4
REPLICA_ARGS = ("--num-pages", "48", "--page-size", str(PAGE), "--chunked-prefill-size", "32",
                "--kv-events", "tcp://127.0.0.1:0")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RouterThread:
    def __init__(self, config: RouterConfig, tokenizer_dir) -> None:
        from radixserve.models.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(str(tokenizer_dir), None)
        self.config = config
        self.stop = threading.Event()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(30)

    def _run(self) -> None:
        ctx = zmq.Context()
        self.router = Router(self.config, ctx, self.tokenizer)
        self.started.set()
        try:
            self.router.serve(lambda: not self.stop.is_set())
        finally:
            self.router.close()
            ctx.destroy(linger=0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


def wait_until(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def mirrors_current(rt: RouterThread, direct: list[Client]) -> bool:
    """Every replica's mirror has applied every batch the replica published."""
    for r, c in zip(rt.router.replicas, direct):
        m = r.mirror
        if m is None or m.seq != c.stats()["kv_events_seq"]:
            return False
    return True


@pytest.fixture(scope="module")
def cluster(model_dir):
    ports = [free_port(), free_port()]
    servers = [Server(model_dir, *REPLICA_ARGS, "--port", str(p)) for p in ports]
    config = RouterConfig(
        replicas=tuple(s.endpoint for s in servers),
        port=0,
        # Any match routes by the cache (no cache threshold): the test checks every one.
        policy=PolicyConfig(
            "cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.0
        ),  # fmt: skip
        decisions=1000,
    )
    rt = RouterThread(config, model_dir)
    wait_until(lambda: all(r.mirror is not None for r in rt.router.replicas), what="replicas up")
    yield rt, servers, ports
    rt.close()
    for s in servers:
        s.stop()


def test_routes_by_the_mirror_and_matches_the_engine(cluster, engine):
    rt, servers, _ = cluster
    direct = [Client(s.endpoint, timeout=60) for s in servers]
    rng = np.random.default_rng(3)
    docs = [rng.integers(5, 500, 56).tolist() for _ in range(3)]
    prompts = []
    for _ in range(14):
        doc = docs[int(rng.integers(3))]
        prompts.append(doc[: int(rng.integers(20, 57))] + rng.integers(5, 500, 7).tolist())
    with Client(rt.router.endpoint, timeout=60) as c:
        for i, ids in enumerate(prompts):
            wait_until(lambda: mirrors_current(rt, direct), what="mirrors current")
            r = c.generate(input_ids=ids, max_tokens=6, temperature=0.0, request_id=f"p{i}")
            client_id, chosen, matches, decision = rt.router.decisions[-1]
            assert client_id == f"p{i}"
            # The replica computed exactly what the mirror said it caches, and no
            # other replica caches more (the load stays balanced: one at a time).
            assert decision.reason in ("cache", "miss", "balance")
            assert r.usage.cached_tokens == matches[chosen] == max(matches)
            want = engine.generate([ids], _greedy(6))[0]
            assert r.token_ids == want.token_ids
        hits = sum(d[2][d[1]] for d in rt.router.decisions[-len(prompts) :])
        assert hits > 0  # prefixes were shared, and found
        stats = c.stats()
        assert len(stats["replicas"]) == 2 and all(row["up"] for row in stats["replicas"])
        assert stats["query_tokens"] == sum(row["stats"]["query_tokens"]
                                            for row in stats["replicas"])  # fmt: skip
        assert all(row["routed"] > 0 for row in stats["replicas"])  # both were used
        ids = c.tokenize(prompt="hello there")  # the router answers both itself
        assert c.detokenize(ids, skip_special_tokens=True) == direct[0].detokenize(ids)
        wait_idle(c)
        assert c.check() == {"ok": True, "error": None}
    for d in direct:
        d.close()


def _greedy(n):
    from radixserve import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0)


def test_a_dead_replica_fails_only_its_requests_and_is_readded(cluster, model_dir):
    rt, servers, ports = cluster
    router = rt.router
    victim, victim_server = router.replicas[1], servers[1]
    results: dict[str, object] = {}

    def run(c: Client, i: int) -> None:
        ids = [7 + i] + list(range(10, 30))  # no shared first page: spread by load
        try:
            results[f"k{i}"] = c.generate(input_ids=ids, max_tokens=40, ignore_eos=True,
                                          temperature=0.0, request_id=f"k{i}")  # fmt: skip
        except ServerError as e:
            results[f"k{i}"] = e

    # The victim's worker stops computing, so its requests are surely in flight.
    os.kill(victim_server.pids["worker"], signal.SIGSTOP)
    with Client(router.endpoint, timeout=120) as c:
        before = len(router.decisions)
        threads = [threading.Thread(target=run, args=(c, i)) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: len(router.decisions) == before + 4, what="4 requests routed")
        on_victim = {d[0] for d in router.decisions[before:] if d[1] == 1}
        assert 0 < len(on_victim) < 4
        wait_until(lambda: len(victim.in_flight) == len(on_victim), what="victim busy")
        for pid in [victim_server.proc.pid, *victim_server.pids.values()]:
            os.kill(pid, signal.SIGKILL)  # the whole replica at once, no goodbyes
        for t in threads:
            t.join(120)
        failed = {k for k, v in results.items() if isinstance(v, ServerError)}
        assert failed == on_victim
        assert all("went away" in str(results[k]) for k in failed)
        for k, v in results.items():
            if k not in failed:
                assert len(v.token_ids) == 40  # type: ignore[union-attr]
        assert not victim.up
        r = c.generate(input_ids=[9, 9, 9, 9, 9], max_tokens=2, temperature=0.0)
        assert router.decisions[-1][1] == 0 and len(r.token_ids) == 2
        # The same port again: the router notices, probes, rebuilds the mirror.
        victim_server.wait_orphans_gone()
        servers[1] = Server(model_dir, *REPLICA_ARGS, "--port", str(ports[1]))
        wait_until(lambda: victim.up and victim.mirror is not None, what="the replica back")
        routed = victim.routed
        for i in range(4):
            c.generate(input_ids=[100 + i, 1, 2, 3, 4, 5], max_tokens=2, temperature=0.0)
        assert victim.routed > routed
        assert router.totals.restarts == {1: 1}  # seen by the probe, a new epoch
        wait_idle(c)

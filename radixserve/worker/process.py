"""The worker process: one ``Step`` message in, one ``StepResult`` out, lockstep.

It loads the model (``compose.build_worker``), reports ``Ready`` with the
model's facts (``ModelInfo``: page count, context length, vocabulary, EOS ids) to the
launcher, then serves steps until the launcher stops it (SIGTERM) or dies
(``utils.proc``: it is checked between steps). It decides nothing:
an exception here is a bug or a broken model, so the process exits non-zero and
the launcher stops the server.

With ``--tp N`` the launcher starts a process per rank of its node,
``python -m radixserve.worker.process CONFIG RANK`` (docs/parallel.md). They meet
(``worker/rendezvous.py``) and form the group (``worker/tp.py``). Rank 0 is the
worker above: before it reports ``Ready`` it waits for every other rank's hello
on its step relay (``worker/relay.py``) and forwards those ``Ready`` messages to
its launcher; it relays each step's bytes before running it, and pings the
other ranks while idle (a rank whose connection is gone makes it exit). A rank
above 0 connects to the relay, loads its shard, says hello (on a node other
than the head, also ``Ready`` to its own launcher) and runs the steps it is
relayed until the relay's connection closes.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from typing import Any

import zmq

from radixserve import protocol as P
from radixserve.compose import build_worker
from radixserve.config import worker_config
from radixserve.nodes import parse_addr, relay_client_keys, relay_endpoint, relay_server_keys
from radixserve.server_config import (
    CONTROL,
    RELAY,
    SCHEDULER_FROM_WORKER,
    WORKER_IN,
    ServerConfig,
)
from radixserve.utils.proc import POLL_MS, Lifeline, child_main, freeze_heap, socket
from radixserve.worker.relay import StepFeed, StepRelay
from radixserve.worker.rendezvous import Rendezvous

log = logging.getLogger("radixserve.worker")


def run(config: ServerConfig, ctx: zmq.Context, life: Lifeline) -> None:
    rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    if config.engine.tp == 1:
        return _serve(config, ctx, life, build_worker(config.engine), None)
    from radixserve.worker import tp as TP

    def check() -> None:
        if not life.alive():
            raise RuntimeError(f"stopped while the ranks met: {life.why_stopped()}")

    wc = worker_config(config.engine)
    rv = Rendezvous(
        config.engine.tp,
        config.run_dir,
        parse_addr(config.dist_init_addr) if config.dist_init_addr else None,
        config.engine.dist_timeout,
    )
    local = config.local_ranks
    if rank not in local:
        raise ValueError(f"rank {rank} does not run on node {config.node_rank}")
    relay = None
    if rank == 0:  # bound before the others look for it
        remote = config.nnodes > 1
        relay = StepRelay(ctx, config.endpoint(RELAY), relay_endpoint(config, bind=True) if remote else None,
                          relay_server_keys(config) if remote else None)  # fmt: skip
    comm = TP.init_group(wc, rank, rv, check, rank - local.start, len(local))
    if rank > 0:
        return _follow(config, ctx, life, rank, comm)
    assert relay is not None
    runner = build_worker(config.engine, comm=comm)
    control = socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    hellos = relay.wait_joined(range(1, config.engine.tp), rv.timeout, check)
    TP.check_agree(runner, [P.decode(h, {P.Ready.TYPE: P.Ready}).info for h in hellos])
    for hello in hellos:
        control.send(hello)  # the launcher hears of every rank, of every node
    _serve(config, ctx, life, runner, relay, control)


def _serve(
    config: ServerConfig,
    ctx: zmq.Context,
    life: Lifeline,
    runner: Any,
    relay: StepRelay | None,
    control: zmq.Socket | None = None,
) -> None:
    """Rank 0 (or the only rank): report ready, then serve steps until stopped."""
    steps = socket(ctx, zmq.PULL, config.endpoint(WORKER_IN), bind=True)
    results = socket(ctx, zmq.PUSH, config.endpoint(SCHEDULER_FROM_WORKER), bind=False)
    control = control or socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    info = asdict(runner.info())
    run_step = runner.step
    if config.disaggregation != "none":  # prefill/decode: peers write into the pool
        from radixserve.worker.kv_transfer import KVTransferAgent

        agent = KVTransferAgent(
            runner.pool.layers,
            config.kv_transfer_host,
            config.kv_transfer_protocol,
            config.kv_transfer_device,
            runner.pool.key_tag,
        )
        info["kv_transfer"] = agent.descriptor(runner.info())

        def run_step(step: P.Step) -> P.StepResult:
            return agent.step(runner.step, step)

    freeze_heap()  # after the warm-up
    control.send(P.Ready("worker", info).encode())
    log.info("ready: %s", info)
    try:
        while life.alive():
            if not steps.poll(POLL_MS):
                if relay is not None:
                    relay.ping()
                continue
            raw = steps.recv()
            if relay is not None:
                relay.send(raw)
            step = P.decode(raw, {P.Step.TYPE: P.Step})
            results.send(run_step(step).encode())
    finally:
        runner.close()  # the cache tiers' copies queued are finished (files written)


def _follow(config: ServerConfig, ctx: zmq.Context, life: Lifeline, rank: int, comm) -> None:
    from radixserve.worker import tp as TP

    if config.node_rank == 0:
        feed = StepFeed(ctx, config.endpoint(RELAY), rank)
    else:
        feed = StepFeed(ctx, relay_endpoint(config), rank, relay_client_keys(config))

    def check() -> None:
        if not life.alive():
            raise RuntimeError(f"stopped while connecting to rank 0: {life.why_stopped()}")

    feed.wait_connected(config.engine.dist_timeout, check)  # a refused key fails here
    runner = build_worker(config.engine, comm=comm)
    ready = P.Ready(f"worker{rank}", TP.rank_info(runner, rank))
    freeze_heap()
    feed.hello(ready)
    if config.node_rank > 0:  # the head's launcher hears of it through rank 0
        socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False).send(ready.encode())
    log.info("rank %d ready: %s", rank, ready.info)
    TP.follow(runner, feed, life.alive)


def main() -> None:
    child_main("worker", run)


if __name__ == "__main__":
    main()

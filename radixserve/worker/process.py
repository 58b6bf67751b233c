"""The worker process: one ``Step`` message in, one ``StepResult`` out, lockstep.

It loads the model (``config.build_worker``), reports ``Ready`` with the
model's facts (``ModelInfo``: page count, context length, vocabulary, EOS ids) to the
launcher, then serves steps until the launcher stops it (SIGTERM) or dies
(``utils.proc``: it is checked between steps). It decides nothing:
an exception here is a bug or a broken model, so the process exits non-zero and
the launcher stops the server.

With ``--tp N`` the launcher starts N of these, ``python -m radixserve.worker.process
CONFIG RANK``: rank 0 is the worker above and relays each step's bytes to the
others; a rank above 0 joins the group, reports ``Ready`` as ``worker<rank>`` and
runs the steps it is relayed (``worker/tp.py``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict

import zmq

from radixserve import protocol as P
from radixserve.config import build_worker, worker_config
from radixserve.server_config import CONTROL, SCHEDULER_FROM_WORKER, WORKER_IN, ServerConfig
from radixserve.utils.proc import POLL_MS, Lifeline, child_main, socket

log = logging.getLogger("radixserve.worker")


def run(config: ServerConfig, ctx: zmq.Context, life: Lifeline) -> None:
    rank = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    tp = config.engine.tp
    comm, relay = None, None
    if tp > 1:
        from radixserve.worker import tp as TP

        comm = TP.init_group(worker_config(config.engine), rank, config.run_dir)
        if rank > 0:
            return _follow(config, ctx, life, rank, comm)
        endpoints = [config.endpoint(TP.follower_socket(r)) for r in range(1, tp)]
        relay = TP.StepRelay(ctx, endpoints)
    runner = build_worker(config.engine, comm=comm)
    steps = socket(ctx, zmq.PULL, config.endpoint(WORKER_IN), bind=True)
    results = socket(ctx, zmq.PUSH, config.endpoint(SCHEDULER_FROM_WORKER), bind=False)
    control = socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    info = asdict(runner.info())
    control.send(P.Ready("worker", info).encode())
    log.info("ready: %s", info)
    while life.alive():
        if not steps.poll(POLL_MS):
            continue
        raw = steps.recv()
        if relay is not None:
            relay.send(raw)
        step = P.decode(raw, {P.Step.TYPE: P.Step})
        results.send(runner.step(step).encode())


def _follow(config: ServerConfig, ctx: zmq.Context, life: Lifeline, rank: int, comm) -> None:
    from radixserve.worker import tp as TP

    # Bound before the model loads: the leader's first step may come right after its own.
    steps = socket(ctx, zmq.PULL, config.endpoint(TP.follower_socket(rank)), bind=True)
    runner = build_worker(config.engine, comm=comm)
    control = socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    info = TP.rank_info(runner, rank)
    control.send(P.Ready(f"worker{rank}", info).encode())
    log.info("rank %d ready: %s", rank, info)
    TP.follow(runner, steps, life.alive)


def main() -> None:
    child_main("worker", run)


if __name__ == "__main__":
    main()

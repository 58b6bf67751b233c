"""The worker process: one ``Step`` message in, one ``StepResult`` out, lockstep.

It loads the model (``config.build_worker``), reports ``Ready`` with the
model's facts (``ModelInfo``: page count, context length, vocabulary, EOS ids) to the
launcher, then serves steps until the launcher stops it (SIGTERM) or dies
(``utils.proc``: it is checked between steps). It decides nothing:
an exception here is a bug or a broken model, so the process exits non-zero and
the launcher stops the server.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import zmq

from radixserve import protocol as P
from radixserve.config import build_worker
from radixserve.server_config import CONTROL, SCHEDULER_FROM_WORKER, WORKER_IN, ServerConfig
from radixserve.utils.proc import POLL_MS, Lifeline, child_main, socket

log = logging.getLogger("radixserve.worker")


def run(config: ServerConfig, ctx: zmq.Context, life: Lifeline) -> None:
    runner = build_worker(config.engine)
    steps = socket(ctx, zmq.PULL, config.endpoint(WORKER_IN), bind=True)
    results = socket(ctx, zmq.PUSH, config.endpoint(SCHEDULER_FROM_WORKER), bind=False)
    control = socket(ctx, zmq.PUSH, config.endpoint(CONTROL), bind=False)
    info = asdict(runner.info())
    control.send(P.Ready("worker", info).encode())
    log.info("ready: %s", info)
    while life.alive():
        if not steps.poll(POLL_MS):
            continue
        step = P.decode(steps.recv(), {P.Step.TYPE: P.Step})
        results.send(runner.step(step).encode())


def main() -> None:
    child_main("worker", run)


if __name__ == "__main__":
    main()

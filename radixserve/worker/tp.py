"""Tensor parallelism across processes: the group, the step relay, the followers' loop.

N ranks, one process each, form one ``torch.distributed`` process group (gloo on
the CPU, NCCL on CUDA with rank ``r`` on ``cuda:r``), meeting through a
``FileStore`` in the private run dir. Rank 0, the *leader*, is the worker the
scheduler knows: it receives each ``Step`` (msgpack bytes), forwards the same
bytes to every *follower* over ipc (``StepRelay``: no pickle, no re-encoding),
then runs the step itself; only it samples and answers. Followers run every
step's forward pass (their collectives meet the leader's) and answer nothing.
Steps travel over ZeroMQ, not the process group, so an idle server holds no
collective open: ``dist_timeout`` bounds a step's collectives only.

Who starts the ranks:
- ``radixserve launch --tp N`` starts every rank as its own child
  (``worker/process.py``), so the death of any rank stops the server;
- the in-process ``Engine`` holds rank 0 in its own process and starts the
  followers as children (``WorkerGroup``), with the same follower code.

On the CPU each rank runs ``cores // N`` threads (at least one), so N ranks do
not oversubscribe the machine's cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import zmq

from radixserve import protocol as P
from radixserve.config import EngineConfig, ModelInfo, worker_config
from radixserve.layers.parallel import TorchComm
from radixserve.protocol import Step, StepResult
from radixserve.worker.config import WorkerConfig

log = logging.getLogger("radixserve.worker")

#: The file the ranks meet through, inside the run dir.
STORE_FILE = "tp-store"
POLL_MS = 500  # how often an idle follower checks that it should go on
STOP_GRACE_S = 5.0  # how long a follower may take to exit before it is killed
LOOPBACK_IFNAME = "lo"  # Linux's loopback interface


def follower_socket(rank: int) -> str:
    """The ipc name (in the run dir) follower ``rank`` binds for its steps."""
    return f"worker{rank}"


def threads_per_rank(size: int) -> int:
    """CPU threads for each of ``size`` ranks sharing this machine's cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // size)


def init_group(config: WorkerConfig, rank: int, run_dir: str, timed: bool = False) -> TorchComm:
    """Join the ``config.tp``-rank group as ``rank``; blocks until every rank has joined
    (or ``dist_timeout`` passes: RuntimeError)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group")
    # All ranks are on this machine: keep the collectives' sockets on loopback rather
    # than on whatever address the hostname resolves to (they are not authenticated).
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    if torch.device(config.device).type == "cuda":
        backend = "nccl"
        torch.cuda.set_device(rank)
    else:
        backend = "gloo"
        torch.set_num_threads(config.threads or threads_per_rank(config.tp))
    dist.init_process_group(
        backend,
        init_method="file://" + os.path.join(run_dir, STORE_FILE),
        rank=rank,
        world_size=config.tp,
        timeout=timedelta(seconds=config.dist_timeout),
    )
    log.info("rank %d of %d joined (%s, %d threads)", rank, config.tp, backend,
             torch.get_num_threads())  # fmt: skip
    return TorchComm(rank, config.tp, timed=timed)


def close_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class StepRelay:
    """The leader's side: each step's bytes, as received, to every follower."""

    def __init__(self, ctx: zmq.Context, endpoints: list[str]) -> None:
        self.sockets = []
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self.sockets.append(sock)

    def send(self, raw: bytes) -> None:
        for sock in self.sockets:
            sock.send(raw, copy=False)


def follow(runner: Any, steps: zmq.Socket, alive: Callable[[], bool]) -> None:
    """A follower's loop: run every step the leader relays, until ``alive()`` is false.
    A failed collective raises (the leader or another follower is gone)."""
    while alive():
        if steps.poll(POLL_MS):
            runner.step(P.decode(steps.recv(), {P.Step.TYPE: P.Step}))


def rank_info(runner: Any, rank: int) -> dict[str, Any]:
    """What a follower reports when ready (the launcher prints it)."""
    return {"rank": rank, "weight_bytes": runner.weight_bytes, "kv_bytes": runner.kv_bytes}


class WorkerGroup:
    """The Engine's worker when ``tp > 1``: rank 0 here, the followers as child processes
    (``python -m radixserve.worker.process CONFIG RANK``, as ``radixserve launch``
    starts them). Its ``step``, ``forward_logits`` and ``info`` are the
    ``ModelRunner``'s; ``close`` stops the followers and leaves the group.

    This process joins the group, so it runs ``cores // tp`` torch threads until
    ``close`` (which restores its count), and holds one group at a time.
    """

    def __init__(self, config: EngineConfig, tokenizer: Any = None, timed: bool = False) -> None:
        """``timed``: rank 0 times its collectives (``comm.stats``; benchmarks)."""
        from radixserve.server_config import CONTROL, ServerConfig
        from radixserve.worker.model_runner import ModelRunner

        self.run_dir = tempfile.mkdtemp(prefix="rs-")
        self.server = ServerConfig(engine=config, run_dir=self.run_dir, launcher_pid=os.getpid())
        self.ctx = zmq.Context()
        self.procs: list[subprocess.Popen] = []
        self.follower_info: list[dict[str, Any]] = []
        self._joined = False
        self._threads = torch.get_num_threads()  # init_group sets this process's share
        try:
            self.control = self.ctx.socket(zmq.PULL)
            self.control.setsockopt(zmq.LINGER, 0)
            self.control.bind(self.server.endpoint(CONTROL))
            self.procs = [self._spawn(r) for r in range(1, config.tp)]
            wc = worker_config(config)
            comm = init_group(wc, 0, self.run_dir, timed)
            self._joined = True
            self.runner = ModelRunner(wc, tokenizer, comm)
            self._wait_ready(config.tp - 1, config.dist_timeout)
            endpoints = [self.server.endpoint(follower_socket(r)) for r in range(1, config.tp)]
            self.relay = StepRelay(self.ctx, endpoints)
        except BaseException:
            self.close()
            raise

    def _spawn(self, rank: int) -> subprocess.Popen:
        import radixserve

        root = os.path.dirname(os.path.dirname(os.path.abspath(radixserve.__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "radixserve.worker.process", self.server.to_json(), str(rank)]
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    def _wait_ready(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.follower_info) < count:
            self.check_followers()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel followers not ready in {timeout:.0f} s")
            if self.control.poll(200):
                msg = P.decode(self.control.recv(), {P.Ready.TYPE: P.Ready})
                self.follower_info.append(msg.info)

    def check_followers(self) -> None:
        """RuntimeError if a follower process has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode})")

    def step(self, batch: Step) -> StepResult:
        self.relay.send(batch.encode())
        try:
            return self.runner.step(batch)
        except RuntimeError:
            self.check_followers()  # say which rank is gone, if one is
            raise

    def forward_logits(self, batch: Step) -> torch.Tensor:
        self.relay.send(batch.encode())
        return self.runner.forward_logits(batch)

    def info(self) -> ModelInfo:
        return self.runner.info()

    def __getattr__(self, name: str) -> Any:
        # The runner's read-only attributes (num_pages, page_size, model_config, ...).
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def close(self) -> None:
        """Stop the followers (SIGTERM, then SIGKILL), leave the group, remove the run dir."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        if self._joined:
            close_group()
            self._joined = False
            torch.set_num_threads(self._threads)
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown
            self.close()

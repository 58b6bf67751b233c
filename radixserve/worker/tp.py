"""Tensor parallelism across processes: the group, the step relay, the followers' loop.

N ranks, one process each, form one ``torch.distributed`` process group (gloo on
the CPU, NCCL on CUDA with each rank on ``cuda:<its rank on its machine>``), after
meeting through a store (``rendezvous.py``: a ``FileStore`` in the private run
dir, or with several nodes a ``TCPStore`` on the head). Rank 0, the *leader*, is
the worker the scheduler knows: it receives each ``Step`` (msgpack bytes),
forwards the same bytes to every *follower* (``relay.py``), then runs the step
itself; only it samples and answers. Followers run every step's forward pass
(their collectives meet the leader's) and answer nothing. Steps travel over
ZeroMQ, not the process group, so an idle server holds no collective open:
``dist_timeout`` bounds a step's collectives only.

Who starts the ranks:
- ``radixserve launch --tp N`` starts every rank of its node as its own child
  (``worker/process.py``), so the death of any rank stops the server; with
  ``--nnodes``, each node's launch starts that node's ranks (``nodes.py``);
- the in-process ``Engine`` holds rank 0 in its own process and starts the
  followers as children (``WorkerGroup``), with the same follower code.

On the CPU each rank runs ``cores // (ranks on this machine)`` threads (at least
one), so the ranks of one machine do not oversubscribe its cores.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import zmq

from radixserve import protocol as P
from radixserve.config import EngineConfig, ModelInfo, worker_config
from radixserve.curve import is_loopback
from radixserve.layers.parallel import TorchComm
from radixserve.protocol import Step, StepResult
from radixserve.utils.paths import SOURCE_ROOT
from radixserve.worker.config import WorkerConfig
from radixserve.worker.relay import StepFeed, StepRelay
from radixserve.worker.rendezvous import Rendezvous, meet, open_store

log = logging.getLogger("radixserve.worker")

#: WorkerConfig fields that may differ between the ranks' machines.
PER_MACHINE = ("model", "cache_dir", "threads", "device")
POLL_MS = 500  # how often an idle follower checks that it should go on
STOP_GRACE_S = 5.0  # how long a follower may take to exit before it is killed
LOOPBACK_IFNAME = "lo"  # Linux's loopback interface


def threads_per_rank(size: int) -> int:
    """CPU threads for each of ``size`` ranks sharing this machine's cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // size)


def rank_settings(config: WorkerConfig) -> dict[str, Any]:
    """What every rank must share (``rendezvous.meet`` compares them): the worker's
    settings but the paths and the thread count, which may differ between machines."""
    settings = {k: v for k, v in asdict(config).items() if k not in PER_MACHINE}
    settings["device"] = torch.device(config.device).type
    return settings


def init_group(
    config: WorkerConfig,
    rank: int,
    rv: Rendezvous,
    check: Callable[[], None],
    local_rank: int | None = None,
    local_size: int | None = None,
    timed: bool = False,
) -> TorchComm:
    """Join the ``config.tp``-rank group as ``rank``, ``local_rank`` of the
    ``local_size`` ranks on this machine (default: every rank is here). Blocks until
    every rank has joined; RuntimeError when ``check()`` raises meanwhile, when
    ``dist_timeout`` passes, or when the ranks' settings differ."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process is already in a torch.distributed group")
    local_rank = rank if local_rank is None else local_rank
    local_size = config.tp if local_size is None else local_size
    # With every rank on this machine, keep the collectives' sockets on loopback
    # rather than on whatever address the hostname resolves to (they are not
    # authenticated); across nodes the environment names the interface.
    if sys.platform.startswith("linux") and (rv.addr is None or is_loopback(rv.addr[0])):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    if torch.device(config.device).type == "cuda":
        backend = "nccl"
        torch.cuda.set_device(local_rank)
    else:
        backend = "gloo"
        torch.set_num_threads(config.threads or threads_per_rank(local_size))
    store = open_store(rv, rank, check)
    meet(store, rv, rank, rank_settings(config), check)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=config.tp,
        timeout=timedelta(seconds=config.dist_timeout),
    )
    log.info("rank %d of %d joined (%s, %d threads)", rank, config.tp, backend,
             torch.get_num_threads())  # fmt: skip
    return TorchComm(rank, config.tp, timed=timed, local_rank=local_rank)


def close_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def follow(runner: Any, feed: StepFeed, alive: Callable[[], bool]) -> None:
    """A follower's loop: run every step the leader relays, until ``alive()`` is false.
    A failed collective raises (the leader or another follower is gone), and so
    does the relay's connection closing (``LeaderGone``)."""
    while alive():
        raw = feed.next(POLL_MS)
        if raw is not None:
            runner.step(P.decode(raw, {P.Step.TYPE: P.Step}))


def rank_info(runner: Any, rank: int) -> dict[str, Any]:
    """What a follower reports when ready (the launcher prints the bytes; rank 0 checks
    the rest with ``check_agree``)."""
    return {
        "rank": rank,
        "weight_bytes": runner.weight_bytes,
        "kv_bytes": runner.kv_bytes,
        "num_pages": runner.num_pages,
        "dtype": runner.dtype_name,
    }


def check_agree(runner: Any, infos: list[dict[str, Any]]) -> None:
    """RuntimeError unless every follower resolved the KV pool's page count and the
    dtype as rank 0 did (``--dtype auto`` resolves per machine: docs/parallel.md)."""
    for info in infos:
        for key, mine in (("num_pages", runner.num_pages), ("dtype", runner.dtype_name)):
            if info.get(key) != mine:
                raise RuntimeError(
                    f"tensor-parallel rank {info.get('rank')} has {key}={info.get(key)!r}, "
                    f"rank 0 {mine!r}: give every node the same --{key.replace('_', '-')}"
                )


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
        from radixserve.server_config import RELAY, ServerConfig
        from radixserve.worker.build import build_runner
        from radixserve.worker.model_runner import ModelRunner

        self.run_dir = tempfile.mkdtemp(prefix="rs-")
        self.server = ServerConfig(engine=config, run_dir=self.run_dir, launcher_pid=os.getpid())
        self.ctx = zmq.Context()
        self.procs: list[subprocess.Popen] = []
        self.follower_info: list[dict[str, Any]] = []  # the followers' Ready info
        self._joined = False
        self._threads = torch.get_num_threads()  # init_group sets this process's share
        self.runner: ModelRunner | None = None
        try:
            self.relay = StepRelay(self.ctx, self.server.endpoint(RELAY))
            self.procs = [self._spawn(r) for r in range(1, config.tp)]
            wc = worker_config(config)
            rv = Rendezvous(config.tp, self.run_dir, timeout=config.dist_timeout)
            comm = init_group(wc, 0, rv, self.check_followers, timed=timed)
            self._joined = True
            self.runner = build_runner(wc, tokenizer, comm)
            ranks = range(1, config.tp)
            hellos = self.relay.wait_joined(ranks, config.dist_timeout, self.check_followers)
            self.follower_info = [P.decode(h, {P.Ready.TYPE: P.Ready}).info for h in hellos]
            check_agree(self.runner, self.follower_info)
        except BaseException:
            self.close()
            raise

    def _spawn(self, rank: int) -> subprocess.Popen:
        root = SOURCE_ROOT
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "radixserve.worker.process", self.server.to_json(), str(rank)]
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

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
        if self.runner is not None:
            self.runner.close()  # the cache tiers' copies queued are finished
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
        torch.set_num_threads(self._threads)  # set on joining, even if the group never formed
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter teardown
            self.close()

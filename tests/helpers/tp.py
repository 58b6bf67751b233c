"""Tensor-parallel ranks simulated in one process: one thread per rank, the
collectives done through shared memory behind ``layers.parallel.Comm``.

``run_ranks(size, fn)`` calls ``fn(comm)`` on ``size`` threads at once (each with
its own ``ThreadComm``) and returns their results in rank order; an exception
on any rank breaks the barrier of the others and is raised. Sums run in rank
order on every rank, so all ranks hold bit-identical results, as after a real
all-reduce.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Shared:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=120)
        self.slots: list[Any] = [None] * size


class ThreadComm:
    """One rank's view of a ``_Shared`` group (``layers.parallel.Comm``)."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self.shared, self.rank, self.size = shared, rank, shared.size
        self.local_rank = rank
        self.calls = 0

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.calls += 1
        sh = self.shared
        sh.slots[self.rank] = t.contiguous().clone()
        sh.barrier.wait()
        parts = list(sh.slots)
        sh.barrier.wait()  # everyone has read before anyone writes again
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        t = t.contiguous()
        t.copy_(total)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        parts = self._exchange(t)
        return parts if self.rank == 0 else None


def run_ranks(size: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    """``fn(comm)`` on ``size`` simulated ranks at once; their results in rank order."""
    shared = _Shared(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(ThreadComm(shared, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results

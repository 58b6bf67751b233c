"""The two collectives a tensor-parallel forward pass makes, behind one small interface.

A model built for ``size`` ranks (``models/sharding.py`` says which slice of each
weight a rank holds) needs only:
- ``all_reduce(t)``: sum a row-parallel product's partial results (``o_proj``,
  ``down_proj``, the experts) and the vocab-parallel embedding's rows, in place;
- ``gather(t)``: the LM head's vocabulary slices, concatenated on rank 0 (the only
  rank that samples); other ranks get ``None``.

``SINGLE`` is the one-rank case (no communication; the layers then compute exactly
what they computed before tensor parallelism existed). ``TorchComm`` runs the
collectives over a ``torch.distributed`` process group (gloo on the CPU, NCCL on
CUDA: ``worker/tp.py`` builds it). Tests simulate ranks with threads through the
same interface (``tests/helpers/tp.py``).

The sharded layers (``RowParallelLinear``, ``VocabParallelEmbedding``,
``ParallelLMHead``) sit below; a column-parallel layer needs no class of its own
(a plain ``Linear`` over the rank's output rows).

Every collective is timed when ``timed`` is set (``bench/worker.py --tp``): on CUDA
the clock waits for the stream, so only benchmarks turn it on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.layers.linear import linear


class Comm(Protocol):
    rank: int
    size: int
    local_rank: int  # the rank among those on this machine (its device index on CUDA)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t`` (contiguous)."""
        ...

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``t`` (same shape everywhere), in rank order, on rank 0; None elsewhere."""
        ...


class SingleComm:
    """One rank: nothing to communicate."""

    rank = 0
    size = 1
    local_rank = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        return [t]


SINGLE = SingleComm()


class CommStats:
    """Seconds and calls spent in collectives (filled only when timing is on)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


class TorchComm:
    """Collectives over an initialised ``torch.distributed`` process group."""

    def __init__(
        self,
        rank: int,
        size: int,
        group: object = None,
        timed: bool = False,
        local_rank: int | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.local_rank = rank if local_rank is None else local_rank
        self.group = group
        self.timed = timed
        self.stats = CommStats()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.contiguous()
        start = self._clock()
        dist.all_reduce(t, group=self.group)
        self._record(start)
        return t

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        import torch.distributed as dist

        t = t.contiguous()
        start = self._clock()
        out = [torch.empty_like(t) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(t, out, dst=0, group=self.group)
        self._record(start)
        return out

    def _clock(self) -> float:
        if not self.timed:
            return 0.0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _record(self, start: float) -> None:
        if self.timed:
            self.stats.seconds += self._clock() - start
            self.stats.calls += 1


# ------------------------------------------------------------------ layers
# The sharded layers (models/sharding.py says which slice each rank holds). With
# one rank each computes exactly what its plain counterpart does.


class RowParallelLinear(nn.Linear):
    """A linear layer whose input features are split over the ranks: each rank's
    partial product is summed by one all-reduce, then the (whole) bias is added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Comm) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm

    def forward(
        self,
        x: torch.Tensor,
        extra: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``extra(y, x)``, when given, adds to this rank's partial product ``y`` before
        the all-reduce (a LoRA term whose input features are split like ``x``'s)."""
        if self.comm.size == 1:
            y = linear(x, self.weight, self.bias)
            return y if extra is None else extra(y, x)
        y = linear(x, self.weight)
        if extra is not None:
            y = extra(y, x)
        y = self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """``weight`` [rows, hidden]: token ids ``[start, start + rows)`` of the vocabulary.
    Other ids embed to zeros on this rank; the all-reduce adds the rank that holds them."""

    def __init__(self, rows: int, hidden: int, start: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        rows = self.weight.shape[0]
        local = ids - self.start
        outside = (local < 0) | (local >= rows)
        h = F.embedding(local.clamp(0, rows - 1), self.weight)
        h.masked_fill_(outside[:, None], 0)
        return self.comm.all_reduce(h)


class ParallelLMHead(nn.Linear):
    """The LM head over this rank's vocabulary block; rank 0 gets the whole rows
    (``vocab_size`` columns, the padding dropped), the other ranks ``None``."""

    def __init__(self, hidden: int, rows: int, vocab_size: int, comm: Comm) -> None:
        super().__init__(hidden, rows, bias=False)
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        y = linear(x, self.weight)
        if self.comm.size == 1:
            return y
        parts = self.comm.gather(y) if x.shape[0] else [y] * self.comm.size
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

"""The state pool: a hybrid model's recurrent states, beside the KV pool.

Per recurrent layer two tensors of ``entries`` rows, shaped by
``ModelConfig.state_shapes``: conv states ``[entries, conv_dim, kernel - 1]`` (the
model dtype: they are inputs of the convolution) and recurrent states (gated
delta-net: ``[entries, v_heads, k_head_dim, v_head_dim]``; Mamba-2: ``[entries,
heads, head_dim, state_size]``), float32 for half dtypes, else the model dtype
(``compute_dtype``). Entry ``s``
for ``s < num_slots`` is the working state of request slot ``s``: a step's
recurrent layers read and update it in place, so a chunked prefill and the
decode steps after it carry the state from one step to the next. The entries
after them hold snapshots (``snapshot_entry``): copies of a working state at a
point of a cached sequence, which the prefix cache keeps.

Like the KV pool it holds no bookkeeping: which snapshot belongs to whom is the
scheduler's business. ``StepStates`` is one step's view of the pool for the
model (``layers/recurrent.LayerStates``).
"""

from __future__ import annotations

import math

import torch

from radixserve.layers.recurrent import StateSegment
from radixserve.models.blocks import compute_dtype
from radixserve.models.config import ModelConfig


class StatePool:
    """Zero-initialised states of every recurrent layer: one working entry per request
    slot, then ``num_snapshots`` snapshot entries."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        num_snapshots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if not cfg.recurrent_layers:
            raise ValueError("a state pool needs a model with recurrent layers")
        if num_slots < 1 or num_snapshots < 0:
            raise ValueError(f"bad state pool size: {num_slots} slots, {num_snapshots} snapshots")
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        entries = num_slots + num_snapshots
        conv_shape, rec_shape = cfg.state_shapes
        conv, rec = (entries, *conv_shape), (entries, *rec_shape)
        n = len(cfg.recurrent_layers)
        self.conv = [torch.zeros(conv, dtype=dtype, device=device) for _ in range(n)]
        self.rec = [torch.zeros(rec, dtype=compute_dtype(dtype), device=device) for _ in range(n)]

    @staticmethod
    def bytes_per_entry(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """One request's state over all recurrent layers, in bytes."""
        if not cfg.recurrent_layers:
            return 0
        (channels, width), rec_shape = cfg.state_shapes
        conv = channels * width * torch.empty((), dtype=dtype).element_size()
        wide = torch.empty((), dtype=compute_dtype(dtype)).element_size()
        rec = math.prod(rec_shape) * wide
        return len(cfg.recurrent_layers) * (conv + rec)

    def snapshot_entry(self, snapshot: int) -> int:
        """The pool entry of snapshot id ``snapshot`` (ValueError when out of range)."""
        if not 0 <= snapshot < self.num_snapshots:
            raise ValueError(f"state snapshot {snapshot} out of range [0, {self.num_snapshots})")
        return self.num_slots + snapshot

    def zero(self, entry: int) -> None:
        """A sequence's start: no input before it, an empty memory."""
        for conv, rec in zip(self.conv, self.rec, strict=True):
            conv[entry].zero_()
            rec[entry].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Entry ``dst`` becomes a copy of entry ``src`` (every layer)."""
        for conv, rec in zip(self.conv, self.rec, strict=True):
            conv[dst] = conv[src]
            rec[dst] = rec[src]


class StepStates:
    """One step's ``LayerStates``: the requests' row segments over a ``StatePool``."""

    def __init__(self, pool: StatePool, segments: list[StateSegment]) -> None:
        self.pool = pool
        self.segments = segments

    def conv_state(self, layer: int) -> torch.Tensor:
        return self.pool.conv[layer]

    def recurrent_state(self, layer: int) -> torch.Tensor:
        return self.pool.rec[layer]

"""What a recurrent model layer needs of its state: ``LayerStates``, and
``run_segments``, the walk over a step's requests every recurrent layer does.

A hybrid model's recurrent layers (gated delta-net linear attention, Mamba-2)
carry, per request, a conv state (the last ``kernel - 1`` inputs of the causal
convolution) and a recurrent state (the delta rule's ``[heads, key_dim,
value_dim]`` matrix; Mamba-2's ``[heads, head_dim, state_size]``) from one step
to the next, instead of per-token K/V. The worker keeps them in a
state pool (``worker/state_pool.py``) and, for each step, hands the model an
object of this protocol: which rows of the flat batch are which request's, the
pool entry each request reads and updates, and where a copy of the state is to
be saved on the way (a snapshot the prefix cache keeps). The model code depends
only on this protocol, so ``models/`` imports nothing from ``worker/``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StateSegment:
    """One request's rows ``[lo, hi)`` of the flat batch and its state entry.

    ``saves`` are ``(rows, save_entry)`` pairs, at most two, ``rows`` ascending in
    ``[1, hi - lo]``: after that many of this segment's rows the layer copies the
    entry's state into ``save_entry``. The state then covers the tokens up to that
    row, so a snapshot may fall in the middle of a chunk, and the layer computes the
    rows in pieces around the saves.
    """

    lo: int
    hi: int
    entry: int
    saves: tuple[tuple[int, int], ...] = ()


class LayerStates(Protocol):
    """The states of one step's requests, for every recurrent layer."""

    segments: list[StateSegment]

    def conv_state(self, layer: int) -> torch.Tensor:
        """Recurrent layer ``layer``'s conv states ``[entries, channels, kernel - 1]``,
        updated in place by the layer."""
        ...

    def recurrent_state(self, layer: int) -> torch.Tensor:
        """Recurrent layer ``layer``'s recurrent states ``[entries, ...]`` (the
        model's ``ModelConfig.state_shapes``), updated in place by the layer."""
        ...


def run_segments(
    segments: list[StateSegment],
    states: Sequence[torch.Tensor],
    prefill: Callable[[int, int, int], None],
    decode: Callable[[torch.Tensor], None],
) -> None:
    """Compute a recurrent layer's step over its requests' rows.

    A decode step (one row per request, row i being ``segments[i]``'s) is one call
    ``decode(entries)`` for all of them (the entries as a tensor, in row order).
    Otherwise each request's rows ``[lo, hi)`` are one ``prefill(lo, hi, entry)``,
    or one per piece between its saves. Either way, where a segment asks for a
    snapshot, every tensor of ``states`` (the layer's ``[entries, ...]`` state
    tensors) has its ``save_entry`` row set to the ``entry`` row once the state
    covers the rows up to that save's. Both callbacks update the entries' states
    in place."""
    if all(s.hi - s.lo == 1 for s in segments):
        decode(torch.tensor([s.entry for s in segments], device=states[0].device))
        for s in segments:
            for _, save_entry in s.saves:
                for t in states:
                    t[save_entry] = t[s.entry]
        return
    for s in segments:
        pos = s.lo
        for rows, save_entry in s.saves:
            prefill(pos, s.lo + rows, s.entry)
            pos = s.lo + rows
            for t in states:
                t[save_entry] = t[s.entry]
        if pos < s.hi:
            prefill(pos, s.hi, s.entry)

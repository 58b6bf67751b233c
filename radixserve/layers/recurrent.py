"""What a recurrent model layer needs of its state: ``LayerStates``.

A hybrid model's recurrent layers (gated delta-net linear attention) carry, per
request, a conv state (the last ``kernel - 1`` inputs of the causal convolution)
and a recurrent state (the delta rule's ``[heads, key_dim, value_dim]`` matrix)
from one step to the next, instead of per-token K/V. The worker keeps them in a
state pool (``worker/state_pool.py``) and, for each step, hands the model an
object of this protocol: which rows of the flat batch are which request's, the
pool entry each request reads and updates, and where a copy of the state is to
be saved on the way (a snapshot the prefix cache keeps). The model code depends
only on this protocol, so ``models/`` imports nothing from ``worker/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StateSegment:
    """One request's rows ``[lo, hi)`` of the flat batch and its state entry.

    ``save_at`` (0: none) is the number of this segment's rows after which the
    layer copies the entry's state into ``save_entry`` (``1 <= save_at <= hi - lo``):
    the state then covers the tokens up to that row, so a snapshot may fall in the
    middle of a chunk, and the layer computes the rows in two pieces around it.
    """

    lo: int
    hi: int
    entry: int
    save_at: int = 0
    save_entry: int = -1


class LayerStates(Protocol):
    """The states of one step's requests, for every recurrent layer."""

    segments: list[StateSegment]

    def conv_state(self, layer: int) -> torch.Tensor:
        """Recurrent layer ``layer``'s conv states ``[entries, channels, kernel - 1]``,
        updated in place by the layer."""
        ...

    def recurrent_state(self, layer: int) -> torch.Tensor:
        """Recurrent layer ``layer``'s delta-rule states ``[entries, heads, key_dim,
        value_dim]``, updated in place by the layer."""
        ...

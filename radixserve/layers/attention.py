"""What a model layer needs of attention: one call per layer, ``forward(layer, q, k, v)``.

The worker's backends (``worker/attention/``) implement it, with the full contract
(KV pages, masks, planning once per step) in ``worker/attention/base.py``. The model
code depends only on this protocol, so ``models/`` imports nothing from ``worker/``.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerAttention(Protocol):
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d] (rotary applied) -> [T, heads, d]."""
        ...

"""Attention over two pools: the full layers' and the sliding layers' (window pool).

A model whose layers mix full and sliding attention may keep the sliding layers'
K/V in a pool of window pages (docs/models.md, "Sliding windows and the cache"):
each request then has two page tables, one per pool, and the window table maps the
pages no query of the request can see any more to a dummy page. ``SplitAttention``
is one backend per pool behind the one-call-per-layer interface: ``begin_split``
plans each with its own page table, ``forward(layer, ...)`` hands the layer to the
backend of its pool under its index there.

Every path of the wrapped torch backends is sound with the dummy page: a sliding
layer's mask hides every key before ``kv_len - qo_len - window + 1`` (decode bias,
prefill mask, the native kernel's ``kv_begin``), and the dummy page holds finite
values, so the keys read from it get weight zero. The paths that would mix the
pools are off for such models already: cascade decode and flash shared prefixes
(sliding windows turn them off), the one-call decode step (``decode_step.takes``
refuses sliding layers), deterministic mode (refuses sliding windows).
"""

from __future__ import annotations

import torch

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch


class SplitAttention:
    """Routes each layer to the backend of its pool (module docstring)."""

    def __init__(
        self,
        full: AttentionBackend | None,
        window: AttentionBackend,
        window_layers: tuple[int, ...],
        num_layers: int,
    ) -> None:
        self.full, self.window = full, window
        self.name = window.name
        self.choice_reason = window.choice_reason
        in_window = set(window_layers)
        route: list[tuple[AttentionBackend, int]] = []
        nf = nw = 0
        for layer in range(num_layers):
            if layer in in_window:
                route.append((window, nw))
                nw += 1
            else:
                assert full is not None, "a full-attention layer without a full pool"
                route.append((full, nf))
                nf += 1
        self._route = route

    def begin_split(self, full: AttentionBatch, window: AttentionBatch) -> None:
        """Plan the step: ``full`` with the full pool's page tables, ``window`` with
        the window tables (the same rows and lengths)."""
        if self.full is not None:
            self.full.begin_batch(full)
        self.window.begin_batch(window)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        backend, index = self._route[layer]
        return backend.forward(index, q, k, v)

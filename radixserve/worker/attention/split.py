"""Attention over two pools: the full layers' and the sliding layers' (window pool).

A model whose layers mix full and sliding attention may keep the sliding layers'
K/V in a pool of window pages (docs/models.md, "Sliding windows and the cache"):
each request then has two page tables, one per pool, and the window table maps the
pages no query of the request can see any more to a dummy page. ``SplitAttention``
is an ``AttentionBackend`` made of one backend per pool: ``begin_batch`` plans each
with its own page tables (``AttentionBatch.page_indices`` for the full pool,
``window_page_indices`` for the window pool), ``forward(layer, ...)`` hands the layer
to the backend of its pool under its index there. It declares no capability: the
one-call decode step and CUDA graphs take one page table (``NO_GRAPHS`` is the reason
the worker logs when graphs are off for it; decode steps then run eagerly).

Every path of the wrapped torch backends is sound with the dummy page: a sliding
layer's mask hides every key before ``kv_len - qo_len - window + 1`` (decode bias,
prefill mask, the native kernel's ``kv_begin``), and the dummy page holds finite
values, so the keys read from it get weight zero. The paths that would mix the
pools are off for such models already: cascade decode and flash shared prefixes
(sliding windows turn them off), the one-call decode step (``decode_step.takes``
refuses sliding layers), deterministic mode (refuses sliding windows).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch


class SplitAttention(AttentionBackend):
    """Routes each layer to the backend of its pool (module docstring)."""

    #: Why a worker over a window pool captures no CUDA graphs.
    NO_GRAPHS = (
        "attention over a window pool has two page tables per request and the decode "
        "graphs capture one; decode steps run eagerly"
    )

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

    def begin_batch(self, batch: AttentionBatch) -> None:
        """Plan the step on both pools: the full pool's with ``batch.page_indices``, the
        window pool's with ``batch.window_page_indices`` (the same rows and lengths)."""
        if batch.window_page_indices is None:
            raise ValueError("a step over a window pool needs the window page tables")
        if self.full is not None:
            self.full.begin_batch(replace(batch, window_page_indices=None))
        self.window.begin_batch(
            replace(batch, page_indices=batch.window_page_indices, window_page_indices=None)
        )

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        backend, index = self._route[layer]
        return backend.forward(index, q, k, v)

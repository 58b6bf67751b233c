"""LoRA products over a mixed batch: the rows of each adapter, grouped.

A step's flat batch holds rows (tokens) of several adapters and of the base model.
``LoraBatch`` is built once per step from each adapter's row indices; at every
adapted module a layer hands it the module's output ``y`` and input ``x``, and for
each adapter with rows in the step (and weights for that module) it gathers those
rows, computes ``(x_rows a) b`` (two small products: ``a`` [in, R], ``b`` [R, out],
the scaling folded into ``b``: ``models/lora.py``) and adds the result into those
rows of ``y`` in place. Rows of the base model are never touched, so their values are
the base model's bits.

Grouping is by adapter, not by row: an adapter's rows may be anywhere in the batch
(decode rows, prefill chunks), and its products run once over all of them. A batch
whose rows all belong to one adapter skips the gather and the scatter.

The sums go into ``y`` where it lies. ``Linear``'s skinny form returns ``y`` as the
transposed view of a ``[out, T]`` product, and an element-wise add of a ``[T, out]``
term into it walks memory across the grain (on a 2048-row prefill, 12x the time of
the add below, docs/lora.md): a whole-batch term is accumulated by BLAS itself
(``addmm_``, which writes either layout), and a large group's term is computed as
``[out, n]`` and scattered along the columns of ``y``'s ``[out, T]`` storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: From this many rows of one adapter, its term goes into a transposed ``y`` column by
#: column of ``y``'s storage (a prefill); fewer (decode) scatter rows of ``y`` as they are.
SCATTER_COLUMNS = 64

#: One adapter's weights as a layer reads them: ``layers[i][module] -> (a, b)``.
AdapterLayers = Sequence[dict[str, tuple[torch.Tensor, torch.Tensor]]]


class LoraBatch:
    """The adapters of one step: ``groups`` of (row indices [n] int64, or None for
    every row of the batch; that adapter's per-layer weights)."""

    def __init__(self, groups: list[tuple[torch.Tensor | None, AdapterLayers]]) -> None:
        self.groups = groups

    def at(self, layer: int) -> LoraLayer | None:
        """The view one decoder layer uses (None when no adapter touches it)."""
        mods = [(rows, weights[layer]) for rows, weights in self.groups if weights[layer]]
        return LoraLayer(mods) if mods else None


class LoraLayer:
    """One layer's adapters in this step (``LoraBatch.at``)."""

    def __init__(self, groups: list[tuple[torch.Tensor | None, dict[str, Any]]]) -> None:
        self.groups = groups

    def add(self, y: torch.Tensor, x: torch.Tensor, module: str) -> torch.Tensor:
        """``y`` [T, out] (any strides) plus each adapter's term on its rows, in place;
        returns ``y``. ``x`` [T, in] is the module's input."""
        for rows, mods in self.groups:
            ab = mods.get(module)
            if ab is None:
                continue
            a, b = ab
            if rows is None:
                y.addmm_(torch.mm(x, a), b)
            elif y.stride(0) == 1 and len(rows) >= SCATTER_COLUMNS:
                xa = torch.mm(x.index_select(0, rows), a)  # [n, R]
                y.t().index_add_(1, rows, torch.mm(b.t(), xa.t()))  # y's [out, T] storage
            else:
                y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a), b))
        return y

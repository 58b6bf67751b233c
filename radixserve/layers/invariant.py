"""Batch-invariant computation (``--deterministic``): a row's result depends only on
that row, never on how many rows share the call or which.

Products are where batches leak into rows: a BLAS picks its kernel, its blocking
and its split of the reduction by the shape of the whole call, so the same row
sums its terms in another order in a batch of 1 than in one of 9. Worse, within
one call of a fixed shape a row's place can decide its order: MKL's float64
product on AMD Zen 4 sums the columns past the 24th of a 32-column block in
another order than the first 24 (a vendor's choice, not a property of the shape).
So no BLAS call on several rows is trusted here:

- float32 and bfloat16 on the CPU go through the native kernel's invariant form
  (``linear.invariant_linear``: one accumulator chain per output along K, at every
  instruction-set level, whatever the row count and place);
- other CPU products (float64) run one row per call (``rowwise``): every call has
  the same shape and a freshly allocated (so equally aligned) row, so a row's bits
  are a function of that row and the weight alone, on any BLAS;
- elsewhere (CUDA) ``blocked``: blocks of exactly ``ROWS`` rows, each through the
  kernel ``linear.linear`` picks for that shape.

Checked for every kernel and ISA level in tests/layers/test_invariant.py. The result
is row-major, so the norms after a product take their per-row path too.

The mode is a context (``batch_invariant``), entered by the model runner around a
step of a worker built with ``deterministic=True``; attention has its own switch
(the torch backend's ``deterministic``: keys cut at fixed positions, no cascade).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

#: Rows of every product in batch-invariant mode: decode batches up to this size cost
#: one call per weight (a decode step reads the weights once, as it does anyway).
ROWS = 32

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "radixserve_batch_invariant", default=False
)


def enabled() -> bool:
    """Whether the current step runs in batch-invariant mode."""
    return _ON.get()


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Run the body in batch-invariant mode (``on``) or in the default one."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def blocked(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
) -> torch.Tensor:
    """``product(x, weight, bias)`` computed ``ROWS`` rows at a time (the last block
    padded with zero rows), as a contiguous ``[rows, out]`` tensor."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    out = torch.empty(m, weight.shape[0], dtype=x.dtype, device=x.device)
    pad = None
    for i in range(0, m, ROWS):
        block = rows[i : i + ROWS]
        n = block.shape[0]
        if n < ROWS:
            if pad is None:
                pad = rows.new_zeros(ROWS, rows.shape[1])
            pad[:n] = block
            pad[n:] = 0
            block = pad
        out[i : i + n] = product(block, weight, bias)[:n]
    return out.view(*lead, weight.shape[0])


def rowwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T (+ b)`` one row per call (``torch.mv`` on a fresh copy of the row), as a
    contiguous ``[rows, out]`` tensor: no row shares a product call with another, and
    every call has the same shape and alignment. For products no native kernel takes
    (float64 on the CPU); it reads the weight once per row."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    for i in range(rows.shape[0]):
        out[i] = torch.mv(weight, rows[i].clone())
    if bias is not None:
        out += bias
    return out.view(*lead, weight.shape[0])

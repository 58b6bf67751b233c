"""Rotated keys of quantized KV pools.

A quantized pool (``KVPool.rotated``) stores every key row k as ``k R``, R the
normalized Hadamard matrix of order head_dim, and attention rotates each query alike:
R is orthogonal, so ``(q R) . (k R) = q . k`` and the scores are those of the
unrotated keys. What changes is the rounding: a key row's few large channels (the
ones rotary embedding and the projections concentrate energy in) are spread over all
head_dim values of ``k R``, so the row's scale fits its values and fewer of them
round to coarse codes. Values are stored as they are (attention's output is a sum of
value rows; rotating them would need a rotation back).

Both are rotated in float32 (float64 for a float64 model) by the fast Walsh-Hadamard
transform (log2(block) butterfly stages of one add or subtract each, then
the factor 1 / sqrt(block), ``fwht``); the queries are rounded back to the model's dtype (the
backends attend in it), the keys quantized from the rotated float32 rows. The native
one-call decode layers (``csrc/decode_layers.cpp``, ``hadamard_row``) run the same
operations in the same order, so both paths give the same bits. For head_dim a power
of 2, R is Sylvester's Hadamard matrix divided by sqrt(head_dim); otherwise it is
block-diagonal, made of that matrix of the largest power of 2 dividing head_dim (any
orthogonal R keeps the scores; the blocks spread outliers within each block only).

An fp8 pool's rotated keys also lose a constant per layer and kv head, ``m R``
(``key_shift.py``: softmax cannot see it), which ``KeyRotation.rotate`` subtracts from
the rotated float32 rows; the native layers subtract the same values the same way.
"""

from __future__ import annotations

import functools
import math

import torch


def key_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype queries and keys are rotated in for a model of ``dtype``: float32, or
    float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] (float32 or float64) times R (module docstring), by butterflies:
    for h = 1, 2, 4, ... below the block, each pair (x[j], x[j + h]) of every aligned run
    of 2h values becomes (x[j] + x[j + h], x[j] - x[j + h]); then every value is
    multiplied by 1 / sqrt(block) rounded to x's dtype. Works on any device."""
    d = x.shape[-1]
    block = d & -d  # the largest power of 2 dividing head_dim
    y = x.reshape(-1, d)
    h = 1
    while h < block:
        pairs = y.view(y.shape[0], d // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), 2)
        y = y.view(-1, d)
        h *= 2
    norm = torch.tensor(1.0 / math.sqrt(block), dtype=x.dtype, device=x.device)
    return (y * norm).view(x.shape)


@functools.cache
def hadamard(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """R [head_dim, head_dim] itself, of ``dtype`` on ``device``, kept (for tests and
    studies; the backends rotate with ``fwht``): orthogonal, every nonzero entry
    +-1/sqrt(block)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    return fwht(torch.eye(head_dim, dtype=torch.float64)).to(dtype=dtype, device=device)


class KeyRotation:
    """The rotation of a pool's queries and keys (``rotate``); ``for_pool`` gives None
    for a pool that stores its keys as they are. ``shift``: the pool's
    ``key_shift`` (``key_shift.py``), taken off the rotated keys, or None."""

    def __init__(self, dtype: torch.dtype, shift: torch.Tensor | None = None) -> None:
        self.dtype = key_dtype(dtype)
        self.shift = shift

    @classmethod
    def for_pool(cls, pool) -> KeyRotation | None:
        return cls(pool.dtype, pool.key_shift) if pool.rotated else None

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., head_dim] rotated and rounded back to its dtype, k [T, kv_heads,
        head_dim] rotated in float32 (or float64), less pool layer ``layer``'s shift
        where the pool has one: ``(q R, k R - m R)``."""
        kr = fwht(k.to(self.dtype))
        if self.shift is not None:
            kr = kr - self.shift[layer]
        return fwht(q.to(self.dtype)).to(q.dtype), kr

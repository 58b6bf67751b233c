"""Rotated keys of quantized KV pools.

A quantized pool (``KVPool.rotated``) stores every key row k as ``k R``, R the
normalized Hadamard matrix of order head_dim, and attention rotates each query alike:
R is orthogonal, so ``(q R) . (k R) = q . k`` and the scores are those of the
unrotated keys. What changes is the rounding: a key row's few large channels (the
ones rotary embedding and the projections concentrate energy in) are spread over all
head_dim values of ``k R``, so the row's scale fits its values and fewer of them
round to coarse codes. Values are stored as they are (attention's output is a sum of
value rows; rotating them would need a rotation back).

Queries are rotated in the model's dtype (the backends attend in it), keys in float32
(float64 for a float64 model) before they are quantized. For head_dim a power of 2, R
is Sylvester's Hadamard matrix divided by sqrt(head_dim); otherwise it is
block-diagonal, made of that matrix of the largest power of 2 dividing head_dim (any
orthogonal R keeps the scores; the blocks spread outliers within each block only).
"""

from __future__ import annotations

import functools

import torch


def key_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype keys are rotated in for a model of ``dtype``: float32, or float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def hadamard(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """R [head_dim, head_dim] of ``dtype`` on ``device`` (module docstring), built there
    (no host copy) and kept: orthogonal, every nonzero entry +-1/sqrt(block)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    block = head_dim & -head_dim  # the largest power of 2 dividing head_dim
    h = torch.ones(1, 1, dtype=torch.float64, device=device)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    h = h / block**0.5
    if block < head_dim:
        h = torch.block_diag(*[h] * (head_dim // block))
    return h.to(dtype)


class KeyRotation:
    """The rotation of a pool's queries and keys (``rotate``); ``for_pool`` gives None
    for a pool that stores its keys as they are."""

    def __init__(self, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.queries = hadamard(head_dim, dtype, torch.device(device))
        self.keys = hadamard(head_dim, key_dtype(dtype), torch.device(device))

    @classmethod
    def for_pool(cls, pool) -> KeyRotation | None:
        if not pool.rotated:
            return None
        device = pool.layers[0].device if pool.layers else torch.device("cpu")
        return cls(pool.head_dim, pool.dtype, device)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [..., head_dim] rotated in its own dtype, k [..., head_dim] in float32 (or
        float64): ``(q R, k R)``."""
        return q @ self.queries.to(q.dtype), k.to(self.keys.dtype) @ self.keys

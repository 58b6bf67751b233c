"""Attention with soft-capped scores (Gemma 2), for the torch backend.

``scaled_dot_product_attention`` has no hook between the scores and the softmax, so
with a cap the torch backend computes attention here: scores ``scale * q.k``, capped
at ``cap * tanh(score / cap)``, then masked, softmax (in float32 or wider), times V.
"""

from __future__ import annotations

import torch


def cap_(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(scores / cap)`` in place (cap 0: unchanged)."""
    return scores.div_(cap).tanh_().mul_(cap) if cap > 0 else scores


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    cap: float,
) -> torch.Tensor:
    """SDPA with the scores soft-capped before the mask (``TorchAttention._attention``'s
    arguments); GQA by grouping the query heads of each kv head, softmax in >= float32."""
    b, h, lq, d = q.shape
    kvh, lk = k.shape[1], k.shape[2]
    ct = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(b, kvh, h // kvh, lq, d).to(ct)
    s = cap_(torch.matmul(qg, k.to(ct).unsqueeze(2).transpose(-1, -2)).mul_(scale), cap)
    if mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril_()
    if mask.dtype == torch.bool:
        s.masked_fill_(~mask, float("-inf"))
    else:
        s.add_(mask.to(ct).unsqueeze(1))  # [B, 1, 1, Lk] -> [B, 1, 1, 1, Lk]
    o = torch.matmul(torch.softmax(s, dim=-1), v.to(ct).unsqueeze(2))  # [B, kvh, g, Lq, d]
    return o.reshape(b, h, lq, d).to(q.dtype)

"""The Mamba-2 selective state space recurrence (SSD), in torch.

Per head the state ``S`` is a ``[head_dim, state_size]`` matrix; each token (input
``x`` [head_dim], time step ``dt > 0``, input and output projections ``B`` and
``C`` [state_size], shared by the heads of a group; per-head ``A < 0``) does

    S <- exp(dt A) S + dt x B^T
    y  = S C                      (the layer adds its ``D x`` skip itself)

``recurrent_step`` does exactly that for one token of every request of a decode
step. ``chunked`` computes a prefill chunk by chunk with the same result: within
a chunk of L tokens with cumulative log-decays ``G`` (``G_i = a_1 + ... + a_i``,
``a_i = dt_i A``) and the state ``S0`` at its start,

    y_i = exp(G_i) S0 C_i + sum_{j<=i} exp(G_i - G_j) (C_i . B_j) dt_j x_j
    S_L = exp(G_L) S0 + sum_j exp(G_L - G_j) dt_j x_j B_j^T

(the state space duality: a masked, decayed attention within the chunk and a
state passed between chunks). Every exponent taken is <= 0, so nothing overflows.
"""

from __future__ import annotations

import torch

#: Tokens per chunk of the chunked form (the within-chunk scores are L x L per head).
CHUNK = 64


def recurrent_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests: ``x`` [R, H, P], ``dt`` [R, H], ``A`` [H], ``B``
    / ``C`` [R, H, N] (each head's group's), ``state`` [R, H, P, N] -> output [R, H, P],
    new state."""
    decay = (dt * A).exp()[..., None, None]
    s = state * decay + (dt[..., None] * x)[..., :, None] * B[..., None, :]
    return (s @ C[..., None])[..., 0], s


def chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of one request: ``x`` [n, H, P], ``dt`` [n, H], ``A`` [H], ``B`` / ``C``
    [n, H, N], ``state`` [H, P, N] (the state before the first row) -> output [n, H, P],
    the state after the last row (see the module docstring)."""
    n = x.shape[0]
    x, B, C = (t.transpose(0, 1) for t in (x, B, C))  # [H, n, *]
    a = (dt * A).t()  # [H, n]
    dtx = x * dt.t()[..., None]
    out = torch.empty_like(x)
    s = state
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        xc, bc, cc = dtx[:, lo:hi], B[:, lo:hi], C[:, lo:hi]
        cum = a[:, lo:hi].cumsum(-1)  # G [H, L]
        size = hi - lo
        lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        scores = (cc @ bc.transpose(-1, -2)) * decay  # exp(G_i - G_j) (C_i . B_j), j <= i
        out[:, lo:hi] = cum.exp()[..., None] * (cc @ s.transpose(-1, -2)) + scores @ xc
        tail = (cum[:, -1:] - cum).exp()[..., None]  # exp(G_L - G_j)
        s = cum[:, -1].exp()[:, None, None] * s + (xc * tail).transpose(-1, -2) @ bc
    return out.transpose(0, 1), s

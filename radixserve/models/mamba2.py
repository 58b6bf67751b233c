"""The Mamba-2 selective state space recurrence (SSD), in torch.

Per head the state ``S`` is a ``[head_dim, state_size]`` matrix; each token (input
``x`` [head_dim], time step ``dt > 0``, input and output projections ``B`` and
``C`` [state_size], shared by the heads of a group; per-head ``A < 0``) does

    S <- exp(dt A) S + dt x B^T
    y  = S C                      (the layer adds its ``D x`` skip itself)

``recurrent_step`` does exactly that for one token of every request of a decode
step (in the layer, the native kernel ``csrc/mamba2_step.cpp`` does it instead where
it takes the states, in place in the state pool: ``NATIVE``). ``chunked`` computes a
prefill chunk by chunk with the same result: within a chunk of L tokens with cumulative
log-decays ``G`` (``G_i = a_1 + ... + a_i``, ``a_i = dt_i A``) and the state ``S0`` at its
start,

    y_i = exp(G_i) S0 C_i + sum_{j<=i} exp(G_i - G_j) (C_i . B_j) dt_j x_j
    S_L = exp(G_L) S0 + sum_j exp(G_L - G_j) dt_j x_j B_j^T

(the state space duality: a masked, decayed attention within the chunk and a
state passed between chunks). Every exponent taken is <= 0, so nothing overflows;
factors below 1e-19 (float32) are taken as 0 (``gated_delta.flush_exp``: the same to
rounding, without x86's slow subnormal arithmetic in the products).
"""

from __future__ import annotations

import os

import torch

from radixserve.models.gated_delta import flush_exp

#: Whether a decode step's scan runs in the native kernel where it takes the states
#: (``layers.cpu_kernels.mamba2_step``: in place in the state pool, the same operations
#: as ``recurrent_step``); False keeps the torch form.
NATIVE = os.environ.get("RADIXSERVE_NATIVE_SCAN", "1") != "0"

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
    / ``C`` [R, G, N] (G groups of H / G consecutive heads), ``state`` [R, H, P, N] ->
    output [R, H, P], new state."""
    r, h, p = x.shape
    g, n = B.shape[1:]
    decay = flush_exp(dt * A)[..., None, None]
    dtx = (dt[..., None] * x).view(r, g, h // g, p, 1)
    s = state * decay + (dtx * B[:, :, None, None, :]).view(r, h, p, n)
    y = s.view(r, g, h // g, p, n) @ C[:, :, None, :, None]
    return y.view(r, h, p), s


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
    [n, G, N] (G groups of H / G consecutive heads), ``state`` [H, P, N] (the state
    before the first row) -> output [n, H, P], the state after the last row (see the
    module docstring). ``C B^T`` is taken once per group, not per head."""
    n, h, p = x.shape
    g, size_n = B.shape[1:]
    rep = h // g
    # Heads as [G, rep]: a group's B and C broadcast over its heads.
    B, C = B.transpose(0, 1)[:, None], C.transpose(0, 1)[:, None]  # [G, 1, n, N]
    a = (dt * A).t().reshape(g, rep, n)
    dtx = (x * dt[..., None]).permute(1, 0, 2).reshape(g, rep, n, p)
    out = torch.empty(g, rep, n, p, dtype=x.dtype, device=x.device)
    s = state.view(g, rep, p, size_n)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        xc, bc, cc = dtx[:, :, lo:hi], B[:, :, lo:hi], C[:, :, lo:hi]
        cum = a[:, :, lo:hi].cumsum(-1)  # G [G, rep, L]
        size = hi - lo
        lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
        decay = flush_exp(
            (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf"))
        )
        scores = (cc @ bc.transpose(-1, -2)) * decay  # exp(G_i - G_j) (C_i . B_j), j <= i
        out[:, :, lo:hi] = flush_exp(cum)[..., None] * (cc @ s.transpose(-1, -2)) + scores @ xc
        tail = flush_exp(cum[..., -1:] - cum)[..., None]  # exp(G_L - G_j)
        s = flush_exp(cum[..., -1])[..., None, None] * s + (xc * tail).transpose(-1, -2) @ bc
    return out.reshape(h, n, p).transpose(0, 1), s.reshape(h, p, size_n)

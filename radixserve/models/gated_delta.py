"""The gated delta rule, in torch (the causal convolution in front of it is
``causal_conv.py``).

Per head the state ``S`` is a ``[key_dim, value_dim]`` matrix; each token
(query ``q``, key ``k``, both L2-normalised, ``q`` also scaled by
``key_dim ** -0.5``; value ``v``; decay ``g <= 0`` in log space; write strength
``beta`` in (0, 1)) does

    S <- exp(g) S
    S <- S + k (beta (v - k^T S))^T      (the delta rule: write only the correction)
    o  = q^T S

``recurrent_step`` does exactly that for one token of every request of a decode
step (in the layer, the native kernel ``csrc/gated_delta.cpp`` does it instead where
it takes the states, in place in the state pool: ``NATIVE``). ``chunked`` computes a prefill chunk by chunk with the same result: within
a chunk of L tokens with cumulative log-decays ``G`` (``G_i = g_1 + ... + g_i``)
and the state ``S0`` at its start, the corrections ``u_j = beta_j (v_j - k_j^T
exp(g_j) S_{j-1})`` satisfy the unit lower-triangular system

    u_j + beta_j sum_{m<j} exp(G_j - G_m) (k_j . k_m) u_m = beta_j (v_j - exp(G_j) k_j^T S0)

which one triangular solve answers for the whole chunk; then

    o_i = exp(G_i) q_i^T S0 + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j
    S_L = exp(G_L) S0 + sum_j exp(G_L - G_j) k_j u_j^T.

Every exponent is <= 0 (the masked ones are never taken), so nothing overflows.
Factors below 1e-19 (float32; 1e-154 in float64) are taken as 0 (``flush_exp``): with
strong decays a chunk's ``exp(G_i - G_j)`` is full of factors that underflow, to
subnormal numbers or, multiplied once more, into them, and every product touching a
subnormal runs several times slower on x86 CPUs, for terms far below the rounding of
the rest.
"""

from __future__ import annotations

import math
import os

import torch

#: Whether a decode step's delta rule runs in the native kernel where it takes the
#: states (``layers.cpu_kernels.gated_delta_step``: in place in the state pool, the
#: same operations as ``recurrent_step``); False keeps the torch form.
NATIVE = os.environ.get("RADIXSERVE_NATIVE_DELTA", "1") != "0"

#: Tokens per chunk of the chunked form (the triangular solve is L x L per head).
CHUNK = 64


def flush_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)``, 0 where it is below the square root of the dtype's smallest normal
    number (1e-19 in float32, 1e-154 in float64), so that a product of two such factors
    is never subnormal: the same to within that, without the slow subnormal arithmetic
    in the products that use it."""
    floor = 0.5 * math.log(torch.finfo(x.dtype).tiny)
    return x.masked_fill(x < floor, float("-inf")).exp()


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the normalisation the
    gated delta-net checkpoints were trained with)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B requests: ``q``/``k`` [B, H, Dk] (normalised, ``q``
    scaled), ``v`` [B, H, Dv], ``g``/``beta`` [B, H], ``state`` [B, H, Dk, Dv]
    -> output [B, H, Dv], new state."""
    s = state * flush_exp(g)[..., None, None]
    read = torch.einsum("bhk,bhkv->bhv", k, s)
    s = s + k[..., :, None] * (beta[..., None] * (v - read))[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of one request: ``q``/``k`` [n, H, Dk], ``v`` [n, H, Dv], ``g``/``beta``
    [n, H], ``state`` [H, Dk, Dv] (the state before the first row) -> output
    [n, H, Dv], the state after the last row (see the module docstring)."""
    n = q.shape[0]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, n, D]
    g, beta = g.t(), beta.t()  # [H, n]
    out = torch.empty_like(v)
    s = state
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        qc, kc, vc, bc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi]
        cum = g[:, lo:hi].cumsum(-1)  # G [H, L]
        size = hi - lo
        lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        diff = (cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf"))
        decay = flush_exp(diff)  # exp(G_i - G_j) for j <= i, else 0
        head = flush_exp(cum)[..., None]  # exp(G_i)
        rhs = bc[..., None] * (vc - head * (kc @ s))
        # Strictly lower part only: solve_triangular takes the unit diagonal as given.
        system = (bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay).tril(-1)
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, lo:hi] = head * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        tail = flush_exp(cum[:, -1:] - cum)[..., None]  # exp(G_L - G_j)
        s = flush_exp(cum[:, -1])[:, None, None] * s + (kc * tail).transpose(-1, -2) @ u
    return out.transpose(0, 1), s

"""The dense building blocks every family shares: RMSNorm, attention, the gated MLP
(SwiGLU, or GeGLU for Gemma), soft-capping.

Tensors are flat batches: [T, features], T the new tokens of every request in
the step. Attention (KV writes into pages, masks, which keys each query sees)
is delegated to an attention backend that has already been told the batch's
layout (``begin_batch``); a block only calls ``backend.forward(layer, q, k, v)``.
q/k/v and gate/up are one matrix each (fused at load time, or already fused in
the checkpoint) for fewer, larger matmuls.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.layers import cpu_kernels, invariant
from radixserve.layers.attention import LayerAttention
from radixserve.layers.linear import Linear
from radixserve.layers.lora import LoraLayer
from radixserve.layers.parallel import SINGLE, Comm, RowParallelLinear
from radixserve.models.config import ModelConfig
from radixserve.models.rope import apply_rotary
from radixserve.models.sharding import Shard, head_shard


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and router softmax run in float32 for half types (like transformers), else in
    the model dtype (so a float64 model is a true float64 forward)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class RMSNorm(nn.Module):
    """RMSNorm over the last dim (hidden size, or head_dim for q/k norms).

    ``unit_offset`` (Gemma): the scale is ``1 + weight``, applied before the cast back
    to the input dtype, as transformers' Gemma norms do (Llama's casts first)."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.rms_norm_ok(x, self.weight):  # bfloat16 on the CPU: one native pass
            return cpu_kernels.rms_norm(x, self.weight, self.eps, self.unit_offset)
        return self.reference(x)

    def add_norm(self, x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + a`` (a residual add) and this norm of ``s``: one native pass on the
        CPU for float32 and bfloat16 (both results then in ``a``'s layout where ``a`` is
        ``Linear``'s transposed view), else the two torch steps (same roundings)."""
        if cpu_kernels.fused_ok(x, a) and self.weight.dtype == x.dtype:
            return cpu_kernels.add_rms_norm(x, a, self.weight, self.eps, self.unit_offset)
        s = x + a
        return s, self(s)

    def layer_input(
        self, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's entry: the residual stream ``residual + h`` (``h`` alone for
        None, the first layer) and this norm of it, the add fused with the norm."""
        if residual is None:
            return h, self(h)
        return self.add_norm(residual, h)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch form (what the native bfloat16 kernel reproduces)."""
        dtype = x.dtype
        h = x.to(compute_dtype(dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.to(h.dtype))).to(dtype)
        return self.weight * h.to(dtype)


def rms_norm(cfg: ModelConfig, size: int) -> RMSNorm:
    """The family's RMSNorm over ``size`` features."""
    return RMSNorm(size, cfg.rms_norm_eps, cfg.norm_unit_offset)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)`` (Gemma 2's logit soft-capping); ``x`` itself for cap 0."""
    return torch.tanh(x / cap) * cap if cap > 0 else x


class Attention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k RMSNorm (Qwen3), rotary, paged
    attention, output projection.

    Over several ranks (``comm``) this rank computes its heads only
    (``sharding.head_shard``) and ``o_proj`` sums the ranks' outputs."""

    def __init__(self, cfg: ModelConfig, layer: int, comm: Comm = SINGLE) -> None:
        super().__init__()
        self.layer = layer
        heads = head_shard(cfg, Shard(comm.rank, comm.size))
        self.num_heads, self.num_kv_heads = heads.q_heads, heads.kv_heads
        self.head_dim = cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.o_bias, comm)
        # Qwen3 and Gemma 3 normalise each q and k head over head_dim before rotary.
        self.q_norm = rms_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = rms_norm(cfg, cfg.head_dim) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LayerAttention,
        lora: LoraLayer | None = None,
    ) -> torch.Tensor:
        """``lora``: this step's adapters of this layer (``layers/lora.py``), added to
        the q/k/v and output products of their rows."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        o_extra = None
        if lora is not None:
            qkv = lora.add(qkv, x, "qkv")
            o_extra = functools.partial(lora.add, module="o")
        if self.q_norm is None and cpu_kernels.fused_ok(qkv, cos):
            # One native pass reads the product where it lies and writes q, k
            # (rotated) and v as the contiguous rows attention reads.
            q, k, v = cpu_kernels.rotary_qkv(
                qkv, cos.view(t, -1), sin.view(t, -1), self.num_heads, self.num_kv_heads,
                self.head_dim,
            )  # fmt: skip
            return self.o_proj(backend.forward(self.layer, q, k, v).reshape(t, -1), o_extra)
        # Rows contiguous again (a skinny product is a transposed view): attention
        # reads q/k/v per token.
        qkv = qkv.contiguous()
        q_and_k, v = qkv.split((self.sizes[0] + self.sizes[1], self.sizes[2]), dim=-1)
        qk = q_and_k.view(t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # One rotary pass over the q and k heads together (same positions).
        q, k = apply_rotary(qk, cos, sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, -1), o_extra)


#: ``ModelConfig.activation`` -> the gate's activation.
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))``, or GeGLU (tanh-approximated GELU), with
    gate and up as one matrix; over several ranks each holds a block of the
    intermediate features and ``down_proj`` sums the ranks' outputs."""

    NATIVE_DECODE = True  # decode_step.py computes exactly this class (see DecoderLayer)

    def __init__(self, cfg: ModelConfig, comm: Comm = SINGLE) -> None:
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.intermediate = cfg.intermediate_size // comm.size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(self.intermediate, cfg.hidden_size, cfg.mlp_bias, comm)

    def forward(self, x: torch.Tensor, lora: LoraLayer | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is None:
            native = self.act is F.silu and cpu_kernels.silu_mul_ok(gate_up)
            if native and (invariant.enabled() or gate_up.dtype == torch.bfloat16):
                # The one-call decode layers' SiLU (their exp) in one pass: in batch-
                # invariant mode so that a row gets the same bits whichever path computes
                # it; in bfloat16 because it is faster than torch's two passes and rounds
                # as they do (an exp within 2 ulp before the bfloat16 rounding).
                return self.down_proj(cpu_kernels.silu_mul(gate_up))
            gate, up = gate_up.split(self.intermediate, dim=-1)
            return self.down_proj(self.act(gate) * up)
        gate, up = lora.add(gate_up, x, "gate_up").split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up, functools.partial(lora.add, module="down"))

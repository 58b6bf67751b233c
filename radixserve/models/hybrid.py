"""The layers of hybrid models: gated delta-net linear attention beside gated full
attention (Qwen3.5; Qwen3-Next and Qwen3.5-MoE, the same layers with a sparse MoE MLP).

A hybrid model's layer is ``DecoderLayer``'s pre-norm pair with one of two token
mixers, by ``ModelConfig.layer_types``:

- ``full_attention``: ``GatedAttention``, the paged attention of ``blocks.py``
  whose output is multiplied by ``sigmoid(gate)``, the gate being a second half of
  each q head's projection (``q_proj`` rows are ``[q, gate]`` per head). Its K/V
  go to the KV pool like any attention layer's; the pool holds the attention
  layers only (``ModelConfig.kv_layer``).
- ``linear_attention``: ``GatedDeltaNet``: q/k/v through a depthwise causal
  convolution (SiLU), L2-normalised q and k, the gated delta rule
  (``gated_delta.py``, after ``causal_conv.py``) with a per-head decay ``g = -exp(A_log) softplus(a + dt_bias)``
  and write strength ``beta = sigmoid(b)``, then an RMSNorm of each head's output
  gated by ``silu(z)``. Its state lives in the worker's state pool, reached
  through ``LayerStates`` (``layers/recurrent.py``).

The recurrent part (decay, delta rule, state) runs in float32 for half dtypes
and in the model dtype otherwise, like the norms (``compute_dtype``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.attention import LayerAttention
from radixserve.layers.linear import Linear
from radixserve.layers.recurrent import LayerStates, run_segments
from radixserve.models import gated_delta
from radixserve.models.blocks import MLP, Attention, compute_dtype, rms_norm
from radixserve.models.causal_conv import causal_conv, conv_step
from radixserve.models.config import ModelConfig
from radixserve.models.moe import SparseMoeBlock
from radixserve.models.rope import apply_rotary


class GatedAttention(Attention):
    """``Attention`` with an output gate: ``o_proj(attn(q, k, v) * sigmoid(gate))``.

    ``qkv_proj`` is the checkpoint's ``q_proj`` (each head's q then its gate), ``k_proj``
    and ``v_proj`` stacked; q/k norms as the family says (Qwen3.5: (1 + w))."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        q_size, kv_size, _ = self.sizes
        self.qkv_proj = Linear(cfg.hidden_size, 2 * q_size + 2 * kv_size, bias=cfg.qkv_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: LayerAttention
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q_size, kv_size, _ = self.sizes
        qkv = self.qkv_proj(x).contiguous()
        q_gate, k, v = qkv.split((2 * q_size, kv_size, kv_size), dim=-1)
        q_gate = q_gate.view(t, self.num_heads, 2, d)
        q, gate = q_gate[:, :, 0], q_gate[:, :, 1].reshape(t, q_size)
        k = k.view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(torch.cat((q, k), dim=1), cos, sin).split(
            (self.num_heads, self.num_kv_heads), dim=1
        )
        out = backend.forward(self.layer, q, k, v.view(t, self.num_kv_heads, d))
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate))


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's ``value_dim`` features, scaled by ``weight`` (no unit
    offset), then multiplied by ``silu(z)``; the norm and the gate in
    ``compute_dtype``, the scale in the input dtype (as the checkpoints' reference)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype, wide = x.dtype, compute_dtype(x.dtype)
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.to(wide))).to(dtype)


def grouped_rows(k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> torch.Tensor:
    """Row index taking Qwen3-Next's ``[in_proj_qkvz; in_proj_ba]`` (per key head: q, k,
    then v and z of its ``v_heads // k_heads`` value heads; then per key head its b, a)
    to ``[q; k; v; z; b; a]``, each over all heads in order."""
    r = v_heads // k_heads
    group = 2 * k_dim + 2 * r * v_dim
    heads = torch.arange(k_heads)[:, None]

    def per_head(base: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return (base + start + torch.arange(n)).flatten()

    qkvz = heads * group
    ba = k_heads * group + heads * 2 * r
    return torch.cat((
        per_head(qkvz, 0, k_dim), per_head(qkvz, k_dim, k_dim),
        per_head(qkvz, 2 * k_dim, r * v_dim), per_head(qkvz, 2 * k_dim + r * v_dim, r * v_dim),
        per_head(ba, 0, r), per_head(ba, r, r),
    ))  # fmt: skip


class GatedDeltaNet(nn.Module):
    """Gated delta-net linear attention (see the module docstring); ``index`` is the
    layer's place among the model's recurrent layers (its state pool slice)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None
        self.index = index
        self.k_heads, self.v_heads = lin.num_k_heads, lin.num_v_heads
        self.k_dim, self.v_dim = lin.k_head_dim, lin.v_head_dim
        key, value = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.conv_dim = 2 * key + value
        self.splits = (self.conv_dim, value, self.v_heads, self.v_heads)  # qkv, z, b, a
        # The checkpoint's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as one product.
        self.in_proj = Linear(cfg.hidden_size, sum(self.splits), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, lin.conv_kernel))  # as stored
        self.A_log = nn.Parameter(torch.empty(self.v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = Linear(value, cfg.hidden_size, bias=False)
        self.grouped_layout = cfg.family == "qwen3_next"

    def checkpoint_loaded(self) -> None:
        """Qwen3-Next's checkpoint holds ``in_proj_qkvz`` then ``in_proj_ba``, each
        interleaved per key head (``[q, k, v, z]`` of the head's value heads, then
        ``[b, a]``); ``in_proj`` is loaded as that concatenation and its rows put once
        into Qwen3.5's order (q, k, v of every head, then z, b, a)."""
        if self.grouped_layout:
            with torch.no_grad():
                w = self.in_proj.weight
                w.copy_(w[grouped_rows(self.k_heads, self.v_heads, self.k_dim, self.v_dim)])

    def forward(self, x: torch.Tensor, states: LayerStates) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = self.in_proj(x).contiguous().split(self.splits, dim=-1)
        wide = compute_dtype(x.dtype)
        beta = torch.sigmoid(b.to(wide))
        g = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias.to(wide))
        conv = states.conv_state(self.index)
        rec = states.recurrent_state(self.index)
        out = torch.empty(t, self.v_heads, self.v_dim, dtype=wide, device=x.device)

        def prefill(lo: int, hi: int, entry: int) -> None:
            self._prefill(qkv[lo:hi], g[lo:hi], beta[lo:hi], entry, conv, rec, out[lo:hi])

        def decode(entries: torch.Tensor) -> None:
            self._decode(qkv, g, beta, entries, conv, rec, out)

        run_segments(states.segments, (conv, rec), prefill, decode)
        o = self.norm(out.to(x.dtype), z.reshape(t, self.v_heads, self.v_dim))
        return self.out_proj(o.reshape(t, -1))

    def _qkv(self, mixed: torch.Tensor, wide: torch.dtype):
        """Split the convolved rows [n, conv_dim] into normalised, scaled q, k and v
        per value head ([n, v_heads, dim], in ``wide``)."""
        n = mixed.shape[0]
        key = self.k_heads * self.k_dim
        # A prefill's convolved rows are the transposed view of [conv_dim, n]: made rows
        # once here (in the narrower dtype), not by each strided reshape below.
        q, k, v = mixed.contiguous().to(wide).split((key, key, self.v_heads * self.v_dim), dim=-1)
        q = gated_delta.l2_normalize(q.reshape(n, self.k_heads, self.k_dim)) * self.k_dim**-0.5
        k = gated_delta.l2_normalize(k.reshape(n, self.k_heads, self.k_dim))
        if self.v_heads != self.k_heads:  # each key head serves consecutive value heads
            rep = self.v_heads // self.k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        return q, k, v.reshape(n, self.v_heads, self.v_dim)

    def _prefill(self, qkv, g, beta, entry, conv, rec, out) -> None:
        mixed, conv[entry] = causal_conv(qkv, conv[entry], self.conv_weight[:, 0])
        q, k, v = self._qkv(mixed, out.dtype)
        out[:], rec[entry] = gated_delta.chunked(q, k, v, g, beta, rec[entry])

    def _decode(self, qkv, g, beta, entries: torch.Tensor, conv, rec, out) -> None:
        """One row per request: the states stepped in place in the pool by the native
        kernel (``cpu_kernels.gated_delta_step``) where it takes them, else gathered,
        stepped together in torch, put back."""
        mixed, conv_new = conv_step(qkv, conv[entries], self.conv_weight[:, 0])
        conv.index_copy_(0, entries, conv_new.to(conv.dtype))
        q, k, v = self._qkv(mixed, out.dtype)
        if gated_delta.NATIVE and cpu_kernels.recurrent_ok(q, rec):
            out[:] = cpu_kernels.gated_delta_step(q, k, v, g, beta, rec, entries)
            return
        out[:], rec_new = gated_delta.recurrent_step(q, k, v, g, beta, rec[entries])
        rec.index_copy_(0, entries, rec_new)


class HybridDecoderLayer(nn.Module):
    """``DecoderLayer``'s pre-norm residual pair with a gated attention or a gated
    delta-net token mixer (``ModelConfig.layer_types``) and a dense gated MLP or, where
    ``ModelConfig.moe`` makes the layer sparse (Qwen3-Next, Qwen3.5-MoE), the MoE block."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.recurrent = cfg.layer_types[layer] == "linear_attention"
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(cfg, cfg.recurrent_index(layer))
        else:
            self.self_attn = GatedAttention(cfg, cfg.kv_layer(layer))
        self.post_attention_layernorm = rms_norm(cfg, cfg.hidden_size)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer]
        self.mlp: nn.Module = SparseMoeBlock(cfg) if sparse else MLP(cfg)

    def step(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LayerAttention,
        states: LayerStates | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DecoderLayer.step``'s contract; a recurrent layer needs ``states``."""
        residual, x = self.input_layernorm.layer_input(h, residual)
        if self.recurrent:
            if states is None:
                raise ValueError("a recurrent layer needs the step's states (LayerStates)")
            a = self.linear_attn(x, states)
        else:
            a = self.self_attn(x, cos, sin, backend)
        residual, x = self.post_attention_layernorm.add_norm(residual, a)
        return self.mlp(x), residual

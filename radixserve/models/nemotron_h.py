"""The layers of Nemotron-H: Mamba-2 mixers beside attention and MLP layers.

Each layer is one pre-norm residual block, ``x + mixer(norm(x))``, whose mixer is
one of (``ModelConfig.layer_types``):

- ``mamba``: ``Mamba2Mixer``. ``in_proj`` gives the gate ``z``, the convolution's
  input (x, B, C) and the raw time step; x, B and C go through the depthwise
  causal convolution (``causal_conv.py``, SiLU), then the selective scan
  (``mamba2.py``) with ``dt = clamp(softplus(dt + dt_bias), dt_limit)``,
  ``A = -exp(A_log)``, B and C shared by each group of heads, plus the ``D x``
  skip; the result times ``silu(z)`` is RMS-normalised per group (``n_groups``
  norms over ``inner / n_groups`` channels) and scaled, then ``out_proj``. Its
  state lives in the worker's state pool, reached through ``LayerStates``
  (``layers/recurrent.py``).
- ``full_attention``: ``NoRopeAttention``, the paged attention of ``blocks.py``
  without rotary embeddings (Nemotron-H's attention has no positional encoding:
  order comes from the Mamba layers). Its K/V go to the KV pool, which holds the
  attention layers only (``ModelConfig.kv_layer``).
- ``mlp``: ``SquaredReluMLP``, ``down(relu(up(x))^2)`` (no gate).
- ``moe``: ``NemotronHMoE``, squared-ReLU experts chosen by ``moe.py``'s grouped
  sigmoid router, plus a shared expert.

The recurrent part (time step, decay, scan, gated norm) runs in float32 for half
dtypes and in the model dtype otherwise (``compute_dtype``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.layers import cpu_kernels
from radixserve.layers.attention import LayerAttention
from radixserve.layers.linear import Linear
from radixserve.layers.recurrent import LayerStates, run_segments
from radixserve.models import mamba2
from radixserve.models.blocks import Attention, compute_dtype, rms_norm
from radixserve.models.causal_conv import causal_conv, conv_step
from radixserve.models.config import ModelConfig
from radixserve.models.moe import Experts, GroupedSigmoidRouter


class NoRopeAttention(Attention):
    """``Attention`` without rotary embeddings (nor q/k norms, nor biases)."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: LayerAttention
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).contiguous().split(self.sizes, dim=-1)
        out = backend.forward(
            self.layer, q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d),
            v.view(t, self.num_kv_heads, d),
        )  # fmt: skip
        return self.o_proj(out.reshape(t, -1))


class SquaredReluMLP(nn.Module):
    """``down_proj(relu(up_proj(x)) ** 2)``, of ``intermediate`` features (default the
    model's ``intermediate_size``)."""

    def __init__(self, cfg: ModelConfig, intermediate: int = 0) -> None:
        super().__init__()
        inner = intermediate or cfg.intermediate_size
        self.up_proj = Linear(cfg.hidden_size, inner, bias=cfg.mlp_bias)
        self.down_proj = Linear(inner, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHMoE(nn.Module):
    """Routed squared-ReLU experts (``moe.py``: grouped sigmoid routing) plus a shared
    expert every token goes through."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.router = GroupedSigmoidRouter(cfg.moe, cfg.hidden_size)
        self.experts = Experts(cfg.moe, cfg.hidden_size, gated=False)
        self.shared = SquaredReluMLP(cfg, cfg.moe.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.router(x)) + self.shared(x)


class GroupGatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))``, the RMS taken over each of ``groups`` equal
    blocks of channels; all in ``compute_dtype`` of ``z``, the result in ``z``'s dtype."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype, wide = z.dtype, compute_dtype(z.dtype)
        h = y.to(wide) * F.silu(z.to(wide))
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(wide) * g.view(h.shape)).to(dtype)


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer (see the module docstring); ``index`` is the layer's place among
    the model's recurrent layers (its state pool slice)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        m = cfg.mamba
        assert m is not None
        self.index = index
        self.heads, self.head_dim, self.groups = m.num_heads, m.head_dim, m.n_groups
        self.state_size, self.dt_limit = m.state_size, m.dt_limit
        self.splits = (m.inner_size, m.conv_dim, m.num_heads)  # z, xBC, dt
        self.in_proj = Linear(cfg.hidden_size, sum(self.splits), bias=m.bias)
        self.conv_weight = nn.Parameter(torch.empty(m.conv_dim, 1, m.conv_kernel))  # as stored
        self.conv_bias = nn.Parameter(torch.empty(m.conv_dim)) if m.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GroupGatedRMSNorm(m.inner_size, m.n_groups, m.norm_eps)
        self.out_proj = Linear(m.inner_size, cfg.hidden_size, bias=m.bias)

    def forward(self, x: torch.Tensor, states: LayerStates) -> torch.Tensor:
        t = x.shape[0]
        z, xbc, dt = self.in_proj(x).contiguous().split(self.splits, dim=-1)
        wide = compute_dtype(x.dtype)
        dt = F.softplus(dt.to(wide) + self.dt_bias.to(wide)).clamp(*self.dt_limit)
        A = -self.A_log.to(wide).exp()
        conv = states.conv_state(self.index)
        rec = states.recurrent_state(self.index)
        out = torch.empty(t, self.heads, self.head_dim, dtype=wide, device=x.device)
        weight, bias = self.conv_weight[:, 0], self.conv_bias

        def prefill(lo: int, hi: int, entry: int) -> None:
            mixed, conv[entry] = causal_conv(xbc[lo:hi], conv[entry], weight, bias)
            xs, B, C = self._split(mixed, wide)
            y, rec[entry] = mamba2.chunked(xs, dt[lo:hi], A, B, C, rec[entry])
            out[lo:hi] = y + self.D.to(wide)[:, None] * xs

        def decode(entries: torch.Tensor) -> None:
            mixed, conv_new = conv_step(xbc, conv[entries], weight, bias)
            conv.index_copy_(0, entries, conv_new.to(conv.dtype))
            xs, B, C = self._split(mixed, wide)
            if mamba2.NATIVE and cpu_kernels.recurrent_ok(xs, rec):  # in place in the pool
                y = cpu_kernels.mamba2_step(xs, dt, A, B, C, rec, entries)
            else:
                y, rec_new = mamba2.recurrent_step(xs, dt, A, B, C, rec[entries])
                rec.index_copy_(0, entries, rec_new)
            out[:] = y + self.D.to(wide)[:, None] * xs

        run_segments(states.segments, (conv, rec), prefill, decode)
        o = self.norm(out.reshape(t, -1), z)
        return self.out_proj(o)

    def _split(self, mixed: torch.Tensor, wide: torch.dtype):
        """The convolved rows [n, conv_dim] as x [n, heads, head_dim] and the groups'
        B and C [n, n_groups, state_size], in ``wide``."""
        n = mixed.shape[0]
        gs = self.groups * self.state_size
        xs, B, C = mixed.to(wide).split((self.heads * self.head_dim, gs, gs), dim=-1)
        shape = (n, self.groups, self.state_size)
        return xs.reshape(n, self.heads, self.head_dim), B.reshape(shape), C.reshape(shape)


class NemotronHLayer(nn.Module):
    """``x + mixer(norm(x))`` with a Mamba-2, attention, MLP or MoE mixer
    (``ModelConfig.layer_types``)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.norm = rms_norm(cfg, cfg.hidden_size)
        self.kind = cfg.layer_types[layer]
        self.mixer: nn.Module
        if self.kind == "mamba":
            self.mixer = Mamba2Mixer(cfg, cfg.recurrent_index(layer))
        elif self.kind == "full_attention":
            self.mixer = NoRopeAttention(cfg, cfg.kv_layer(layer))
        elif self.kind == "moe":
            self.mixer = NemotronHMoE(cfg)
        else:
            self.mixer = SquaredReluMLP(cfg)

    def step(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LayerAttention,
        states: LayerStates | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``DecoderLayer.step``'s contract; a Mamba-2 layer needs ``states``."""
        residual, x = self.norm.layer_input(h, residual)
        if self.kind == "mamba":
            if states is None:
                raise ValueError("a recurrent layer needs the step's states (LayerStates)")
            return self.mixer(x, states), residual
        if self.kind == "full_attention":
            return self.mixer(x, cos, sin, backend), residual
        return self.mixer(x), residual

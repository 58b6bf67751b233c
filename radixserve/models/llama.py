"""Our forward pass for the Llama family (Llama, Mistral, Qwen2, SmolLM).

The model works on a flat batch: the new tokens of every request in the step,
concatenated, with their absolute positions. Attention (KV writes into pages,
masks, which keys each query sees) is delegated to an attention backend that
has already been told the batch's layout (``begin_batch``); the model only
calls ``backend.forward(layer, q, k, v)``.

Weights use transformers' parameter names at load time (``load_weights``);
q/k/v and gate/up are fused into one matrix each for fewer, larger matmuls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.layers.linear import Linear
from radixserve.models.config import ModelConfig
from radixserve.models.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:  # the worker passes its backend in; models/ does not import worker/
    from radixserve.worker.attention.base import AttentionBackend


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """RMSNorm runs in float32 for half types (like transformers), else in the model dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(_compute_dtype(dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        # Rows contiguous again (a skinny product is a transposed view): attention
        # reads q/k/v per token.
        qkv = self.qkv_proj(x).contiguous()
        q_and_k, v = qkv.split((self.sizes[0] + self.sizes[1], self.sizes[2]), dim=-1)
        # One rotary pass over the q and k heads together (same positions).
        qk = apply_rotary(q_and_k.view(t, -1, self.head_dim), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(self.layer, q, k, v)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Llama-family causal LM over a flat, paged batch.

    Parameters are allocated uninitialised (no random init: it would cost more
    than loading); call ``load_weights`` before ``forward``.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.to_empty(device=device)
        self.to(dtype=dtype)
        self.rotary = RotaryEmbedding(cfg, dtype, device)
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        max_position: int,
        backend: AttentionBackend,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [len(logits_index), vocab] for the selected rows of the flat batch.

        ``input_ids`` and ``positions`` are [T]; ``backend.begin_batch`` must
        already describe this batch. Only the selected rows go through the final
        norm and the LM head.
        """
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, max_position)
        for layer in self.layers:
            h = layer(h, cos, sin, backend)
        return self.lm_head(self.norm(h[logits_index]))

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy weights given under transformers' names (``model.layers.0.self_attn.q_proj.weight``).

        Raises KeyError naming every missing tensor, and ValueError on a shape mismatch.
        """
        cfg = self.cfg
        expected = _hf_names(cfg)
        missing = [n for n in expected if n not in weights]
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            missing = [n for n in missing if n != "lm_head.weight"]
            if not cfg.tie_word_embeddings and "lm_head.weight" not in weights:
                missing.append("lm_head.weight")
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:8]}")

        def put(param: torch.Tensor, *names: str) -> None:
            src = (
                torch.cat([weights[n] for n in names], dim=0)
                if len(names) > 1
                else weights[names[0]]
            )
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(
                    f"shape mismatch for {names}: {tuple(src.shape)} vs {tuple(param.shape)}"
                )
            param.copy_(src.to(param.dtype))

        with torch.no_grad():
            put(self.embed_tokens.weight, "model.embed_tokens.weight")
            put(self.norm.weight, "model.norm.weight")
            if cfg.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight  # shared, not copied
            else:
                put(self.lm_head.weight, "lm_head.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                put(layer.input_layernorm.weight, p + "input_layernorm.weight")
                put(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
                qkv = [a + f"{x}_proj.weight" for x in "qkv"]
                put(layer.self_attn.qkv_proj.weight, *qkv)
                put(layer.self_attn.o_proj.weight, a + "o_proj.weight")
                if cfg.qkv_bias:
                    put(layer.self_attn.qkv_proj.bias, *[a + f"{x}_proj.bias" for x in "qkv"])
                if cfg.o_bias:
                    put(layer.self_attn.o_proj.bias, a + "o_proj.bias")
                m = p + "mlp."
                put(layer.mlp.gate_up_proj.weight, m + "gate_proj.weight", m + "up_proj.weight")
                put(layer.mlp.down_proj.weight, m + "down_proj.weight")
                if cfg.mlp_bias:
                    put(layer.mlp.gate_up_proj.bias, m + "gate_proj.bias", m + "up_proj.bias")
                    put(layer.mlp.down_proj.bias, m + "down_proj.bias")


def _hf_names(cfg: ModelConfig) -> list[str]:
    """Tensor names a complete checkpoint of this config holds (lm_head only when untied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if cfg.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.o_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.mlp_bias:
            names += [p + f"mlp.{x}_proj.bias" for x in ("gate", "up", "down")]
    return names

"""The decoder-only causal LM every supported family is: embeddings, pre-norm layers
(attention, then a dense or mixture-of-experts MLP), final norm, LM head.

A family differs in its config (``ModelConfig``: q/k norms, biases, rotary,
sliding windows, ``moe``) and in how its checkpoint names and splits the weights
(``checkpoint.py``); the forward pass is this one.

The model works on a flat batch: the new tokens of every request in the step,
concatenated, with their absolute positions (``blocks.py`` says how attention
reaches the KV pages).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from radixserve.layers.attention import LayerAttention
from radixserve.layers.linear import Linear
from radixserve.models.blocks import MLP, Attention, RMSNorm
from radixserve.models.checkpoint import checkpoint_sources
from radixserve.models.config import ModelConfig
from radixserve.models.moe import SparseMoeBlock
from radixserve.models.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer]
        self.mlp: nn.Module = SparseMoeBlock(cfg) if sparse else MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: LayerAttention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """A decoder-only causal LM over a flat, paged batch.

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
        backend: LayerAttention,
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
        tied = cfg.tie_word_embeddings
        sources = checkpoint_sources(cfg)
        if tied:
            del sources["lm_head.weight"]
        needed = [n for src in sources.values() for group in src for n in group]
        missing = [n for n in needed if n not in weights]
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:8]}")
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, groups in sources.items():
                param = params[name]
                parts = [torch.cat([weights[n] for n in g]) for g in groups]
                # One group per parameter, except stacked experts: one group per expert.
                src = parts[0] if parts[0].dim() == param.dim() else torch.stack(parts)
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(
                        f"shape mismatch for {groups[0]}: {tuple(src.shape)} vs {tuple(param.shape)}"
                    )
                param.copy_(src.to(param.dtype))
            if tied:
                self.lm_head.weight = self.embed_tokens.weight  # shared, not copied

"""The decoder-only causal LM every supported family is: embeddings, pre-norm layers
(attention, then a dense or mixture-of-experts MLP), final norm, LM head.

A family differs in its config (``ModelConfig``: q/k norms, biases, rotary,
sliding windows, ``moe``, Gemma's norms, scales and soft-caps) and in how its
checkpoint names and splits the weights (``checkpoint.py``); the forward pass is
this one. Gemma 2/3 layers (``SandwichDecoderLayer``) also normalise each
sublayer's output, and Gemma 3's sliding-window layers rotate with their own
rope base (``rope_local_theta``). Hybrid models have layers of their own with
recurrent state (Qwen3.5, Qwen3-Next, Qwen3.5-MoE: ``hybrid.py``; Nemotron-H: ``nemotron_h.py``).

The model works on a flat batch: the new tokens of every request in the step,
concatenated, with their absolute positions (``blocks.py`` says how attention
reaches the KV pages).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import nn

from radixserve.layers.attention import LayerAttention
from radixserve.layers.lora import LoraBatch, LoraLayer
from radixserve.layers.parallel import SINGLE, Comm, ParallelLMHead, VocabParallelEmbedding
from radixserve.layers.recurrent import LayerStates
from radixserve.models import decode_step
from radixserve.models.blocks import MLP, Attention, compute_dtype, rms_norm, softcap
from radixserve.models.checkpoint import checkpoint_sources
from radixserve.models.config import ModelConfig
from radixserve.models.hybrid import HybridDecoderLayer
from radixserve.models.moe import SparseMoeBlock
from radixserve.models.nemotron_h import NemotronHLayer
from radixserve.models.rope import RotaryEmbedding
from radixserve.models.sharding import Shard, check_tp, shard_sources, vocab_shard
from radixserve.models.weights import WeightReader, as_reader


class DecoderLayer(nn.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (transformers' names: the second
    norm is ``post_attention_layernorm``)."""

    # decode_step.py computes exactly this class: declared in its own body, so a
    # subclass (another family's layer) does not inherit the claim.
    NATIVE_DECODE = True

    def __init__(self, cfg: ModelConfig, layer: int, comm: Comm = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer, comm)
        self.post_attention_layernorm = rms_norm(cfg, cfg.hidden_size)
        sparse = cfg.moe is not None and cfg.moe.sparse_layers[layer]
        self.mlp: nn.Module = SparseMoeBlock(cfg, comm) if sparse else MLP(cfg, comm)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: LayerAttention
    ) -> torch.Tensor:
        h, residual = self.step(x, None, cos, sin, backend)
        return residual + h

    def step(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LayerAttention,
        lora: LoraLayer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on the hidden state ``residual + h`` (``h`` alone for None), given
        apart so that each residual add is fused with the norm after it
        (``RMSNorm.add_norm``); returns the same kind of pair (the MLP's output, the
        residual stream before it). ``lora``: this step's adapters of this layer
        (a mixture-of-experts MLP has none: ``models/lora.py`` refuses them)."""
        residual, x = self.input_layernorm.layer_input(h, residual)
        a = self.self_attn(x, cos, sin, backend, lora)
        residual, x = self.post_attention_layernorm.add_norm(residual, a)
        return (self.mlp(x, lora) if isinstance(self.mlp, MLP) else self.mlp(x)), residual


class SandwichDecoderLayer(nn.Module):
    """Gemma 2/3: each sublayer's output is normalised before the residual add,
    ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
    ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``."""

    def __init__(self, cfg: ModelConfig, layer: int, comm: Comm = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer, comm)
        self.post_attention_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.pre_feedforward_layernorm = rms_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg, comm)
        self.post_feedforward_layernorm = rms_norm(cfg, cfg.hidden_size)

    def step(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LayerAttention,
        lora: LoraLayer | None = None,
    ) -> tuple[torch.Tensor, None]:
        """``DecoderLayer.step``'s contract; the hidden state is summed first."""
        return self(h if residual is None else residual + h, cos, sin, backend, lora), None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: LayerAttention,
        lora: LoraLayer | None = None,
    ) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), cos, sin, backend, lora)
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(x), lora)
        )


class CausalLM(nn.Module):
    """A decoder-only causal LM over a flat, paged batch.

    Parameters are allocated uninitialised (no random init: it would cost more
    than loading); call ``load_weights`` before ``forward``.

    With ``comm`` of several ranks the model is this rank's shard
    (``sharding.py``): its parameters hold only this rank's slices, and
    ``forward`` returns the logits on rank 0 only (``None`` elsewhere).
    """

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, comm: Comm = SINGLE
    ) -> None:
        super().__init__()
        check_tp(cfg, comm.size)
        self.cfg = cfg
        self.shard = Shard(comm.rank, comm.size)
        start, rows = vocab_shard(cfg.vocab_size, self.shard)
        with torch.device("meta"):
            self.embed_tokens = VocabParallelEmbedding(rows, cfg.hidden_size, start, comm)
            if cfg.family == "nemotron_h":
                layers = [NemotronHLayer(cfg, i) for i in range(cfg.num_layers)]
            elif cfg.hybrid:
                layers = [HybridDecoderLayer(cfg, i) for i in range(cfg.num_layers)]
            else:
                layer_type = SandwichDecoderLayer if cfg.sandwich_norms else DecoderLayer
                layers = [layer_type(cfg, i, comm) for i in range(cfg.num_layers)]
            self.layers = nn.ModuleList(layers)
            self.norm = rms_norm(cfg, cfg.hidden_size)
            self.lm_head = ParallelLMHead(cfg.hidden_size, rows, cfg.vocab_size, comm)
        self.to_empty(device=device)
        self.to(dtype=dtype)
        for module in self.modules():  # e.g. routers transformers keeps in float32
            if getattr(module, "KEEP_WIDE", False):
                module.to(dtype=compute_dtype(dtype))
        # Gemma scales embeddings by sqrt(hidden) rounded to the model dtype, as transformers.
        self.embed_scale = (
            torch.tensor(cfg.embed_scale, dtype=dtype, device=device)
            if cfg.embed_scale != 1.0
            else None
        )
        self.rotary = RotaryEmbedding(cfg, dtype, device)
        # Gemma 3: sliding-window layers rotate with their own base and no scaling.
        self.local_rotary = self.rotary
        if cfg.rope_local_theta:
            local = replace(cfg, rope_theta=cfg.rope_local_theta, rope_type="default")
            self.local_rotary = RotaryEmbedding(local, dtype, device)
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        max_position: int,
        backend: LayerAttention,
        logits_index: torch.Tensor,
        lora: LoraBatch | None = None,
        states: LayerStates | None = None,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Logits [len(logits_index), vocab] for the selected rows of the flat batch
        (``None`` on a tensor-parallel rank other than 0).

        ``input_ids`` and ``positions`` are [T]; ``backend.begin_batch`` must
        already describe this batch. Only the selected rows go through the final
        norm and the LM head. ``lora``: the step's LoRA adapters and their rows
        (``layers/lora.py``); a step with adapter rows runs the layers one by one
        (the one-call native decode step computes base rows only). A hybrid model's
        recurrent layers read and update their per-request states through
        ``states`` (``layers/recurrent.py``); they take no LoRA adapter.
        A multimodal model's ``positions`` may be M-RoPE's rows [3, T] (``rope.py``),
        and ``embeds = (rows, features)`` replaces those rows' token embeddings by
        image features (an image's placeholder tokens, docs/multimodal.md).
        """
        h = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if embeds is not None:
            rows, features = embeds
            h[rows] = features.to(h.dtype)
        full = self.rotary.cos_sin(positions, max_position)
        local = full
        if self.local_rotary is not self.rotary:
            local = self.local_rotary.cos_sin(positions, max_position)
        residual = None
        # A decode step the native kernels compute whole takes one call for every
        # layer (decode_step.py); otherwise the layers run one by one.
        stepped = None
        if self.local_rotary is self.rotary and lora is None and not self.cfg.hybrid:
            stepped = decode_step.run(self, h, *full, backend)
        if stepped is not None:
            h, residual = stepped
        elif self.cfg.hybrid:
            for layer in self.layers:
                h, residual = layer.step(h, residual, *full, backend, states)
        else:
            for i, (layer, window) in enumerate(
                zip(self.layers, self.cfg.sliding_windows, strict=True)
            ):
                cos, sin = local if window > 0 else full
                adapters = None if lora is None else lora.at(i)
                h, residual = layer.step(h, residual, cos, sin, backend, adapters)
        rows = None if residual is None else residual[logits_index]
        _, x = self.norm.layer_input(h[logits_index], rows)
        logits = self.lm_head(x)
        return None if logits is None else softcap(logits, self.cfg.final_softcap)

    def weight_bytes(self) -> int:
        """Bytes of this rank's parameters (a tied LM head counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def load_weights(self, weights: Mapping[str, torch.Tensor] | WeightReader) -> None:
        """Copy weights given under transformers' names (``model.layers.0.self_attn.q_proj.weight``):
        a mapping of tensors, or a reader (``weights.py``) from which only this
        rank's slices are read.

        Raises KeyError naming every missing tensor, and ValueError on a shape mismatch.
        """
        cfg = self.cfg
        reader = as_reader(weights)
        tied = cfg.tie_word_embeddings
        sources = checkpoint_sources(cfg)
        if tied:
            del sources["lm_head.weight"]
        names = set(reader.names())
        needed = [n for src in sources.values() for group in src for n in group]
        missing = [n for n in needed if n not in names]
        if missing:
            raise KeyError(f"checkpoint is missing {len(missing)} tensor(s): {missing[:8]}")
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, groups in shard_sources(cfg, self.shard, sources).items():
                param = params[name]
                parts = [torch.cat([reader.read(p) for p in g]) for g in groups]
                # One group per parameter, except stacked experts: one group per expert.
                src = parts[0] if parts[0].dim() == param.dim() else torch.stack(parts)
                if src.shape[0] < param.shape[0] and name.endswith(
                    ("embed_tokens.weight", "lm_head.weight")
                ):
                    param[src.shape[0] :].zero_()  # the last rank's vocabulary padding
                    param = param[: src.shape[0]]
                if tuple(src.shape) != tuple(param.shape):
                    raise ValueError(
                        f"shape mismatch for {groups[0]}: {tuple(src.shape)} vs {tuple(param.shape)}"
                    )
                param.copy_(src.to(param.dtype))
            for module in self.modules():  # layouts fixed up once loaded (Qwen3-Next)
                if hasattr(module, "checkpoint_loaded"):
                    module.checkpoint_loaded()
            if tied:
                self.lm_head.weight = self.embed_tokens.weight  # shared, not copied

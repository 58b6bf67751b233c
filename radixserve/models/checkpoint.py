"""Where each of our parameters comes from in a family's transformers checkpoint.

``checkpoint_sources(cfg)`` maps every parameter name of ``CausalLM`` to the
checkpoint tensors it is built from: a list of groups, each group's tensors
concatenated along dim 0 (q, k, v -> ``qkv_proj``; gate, up -> ``gate_up_proj``),
and for stacked experts one group per expert. What differs per family:

- Llama, Mistral, Qwen2, Qwen3: separate ``q_proj``/``k_proj``/``v_proj`` and
  ``gate_proj``/``up_proj``; Qwen3 adds ``q_norm``/``k_norm`` per layer.
- Phi-3: ``qkv_proj`` and ``gate_up_proj`` already fused, in our order.
- Mixtral: ``block_sparse_moe.gate`` (router) and ``experts.{e}.w1/w3/w2``
  (gate/up/down) per expert.
- Qwen3-MoE: ``mlp.gate`` (router) and ``mlp.experts.{e}.gate_proj/up_proj/down_proj``;
  layers listed in ``mlp_only_layers`` (or off ``decoder_sparse_step``) have a dense ``mlp``.
- Qwen3.5 (hybrid): full-attention layers as Qwen3 (``q_proj`` holds each head's q
  and its output gate); linear-attention layers under ``linear_attn.``:
  ``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a`` (one ``in_proj``),
  ``conv1d.weight``, ``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj``.
- Qwen3-Next (hybrid): Qwen3.5's names, except the delta-net's ``in_proj_qkvz`` and
  ``in_proj_ba`` (interleaved per key head, one ``in_proj`` reordered once loaded), and
  sparse layers as Qwen3-MoE's plus ``mlp.shared_expert.gate_proj/up_proj/down_proj``
  and ``mlp.shared_expert_gate``.
- Qwen3.5-MoE (hybrid): Qwen3.5's names with Qwen3-Next's sparse MLP on every layer
  (``save_pretrained`` writes the experts per expert, as Qwen3-MoE's).
- Nemotron-H (hybrid), under ``backbone.`` (what the Hub checkpoints and
  ``save_pretrained`` write; a ``model.`` layout is renamed): ``embeddings``,
  ``norm_f``; per layer ``norm`` and
  one ``mixer``: Mamba-2 (``in_proj``, ``conv1d.weight``/``bias``, ``A_log``, ``D``,
  ``dt_bias``, ``norm.weight``, ``out_proj``), attention (``q/k/v/o_proj``), MLP
  (``up_proj``, ``down_proj``) or MoE (``gate.weight``, ``gate.e_score_correction_bias``,
  ``experts.{e}.up_proj/down_proj``, ``shared_experts.up_proj/down_proj``).
- Gemma 2/3: Llama's names plus ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` per layer (``post_attention_layernorm`` is the norm of
  the attention output there); Gemma 3 adds ``q_norm``/``k_norm``. Multimodal Gemma 3
  checkpoints keep the text model under ``language_model`` (``text_weights``).

These are the names ``save_pretrained`` writes and the Hub checkpoints use.
"""

from __future__ import annotations

from torch import Tensor

from radixserve.models.config import ModelConfig

Sources = dict[str, list[tuple[str, ...]]]

#: family -> (router name, expert tensor names for gate, up, down) under the MoE prefix.
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "gate", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_next": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_5_moe": ("mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
}


def checkpoint_sources(cfg: ModelConfig) -> Sources:
    """Our parameter name -> checkpoint tensor groups (see the module docstring)."""
    if cfg.family == "nemotron_h":
        return _nemotron_h(cfg)
    out: Sources = {
        "embed_tokens.weight": [("model.embed_tokens.weight",)],
        "norm.weight": [("model.norm.weight",)],
        "lm_head.weight": [("lm_head.weight",)],
    }
    fused = cfg.family == "phi3"
    norms = ("input_layernorm", "post_attention_layernorm")
    if cfg.sandwich_norms:
        norms += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for norm in norms:
            out[ours + norm + ".weight"] = [(hf + norm + ".weight",)]
        if cfg.layer_types and cfg.layer_types[i] == "linear_attention":
            out.update(_linear_attention(cfg, ours + "linear_attn.", hf + "linear_attn."))
        else:
            out.update(_attention(cfg, ours + "self_attn.", hf + "self_attn.", fused))
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            out.update(_experts(cfg, ours + "mlp.", hf))
        else:
            out.update(_dense_mlp(cfg, ours + "mlp.", hf + "mlp.", fused))
    return out


def _attention(cfg: ModelConfig, ours: str, hf: str, fused: bool) -> Sources:
    qkv = ("qkv",) if fused else tuple("qkv")
    out: Sources = {
        ours + "qkv_proj.weight": [tuple(f"{hf}{x}_proj.weight" for x in qkv)],
        ours + "o_proj.weight": [(hf + "o_proj.weight",)],
    }
    if cfg.qkv_bias:
        out[ours + "qkv_proj.bias"] = [tuple(f"{hf}{x}_proj.bias" for x in qkv)]
    if cfg.o_bias:
        out[ours + "o_proj.bias"] = [(hf + "o_proj.bias",)]
    if cfg.qk_norm:
        out[ours + "q_norm.weight"] = [(hf + "q_norm.weight",)]
        out[ours + "k_norm.weight"] = [(hf + "k_norm.weight",)]
    return out


def _linear_attention(cfg: ModelConfig, ours: str, hf: str) -> Sources:
    # Qwen3-Next: two projections interleaved per key head, reordered once loaded
    # (``GatedDeltaNet.checkpoint_loaded``).
    parts = ("qkvz", "ba") if cfg.family == "qwen3_next" else ("qkv", "z", "b", "a")
    projections = tuple(f"{hf}in_proj_{x}.weight" for x in parts)
    return {
        ours + "in_proj.weight": [projections],
        ours + "conv_weight": [(hf + "conv1d.weight",)],
        ours + "A_log": [(hf + "A_log",)],
        ours + "dt_bias": [(hf + "dt_bias",)],
        ours + "norm.weight": [(hf + "norm.weight",)],
        ours + "out_proj.weight": [(hf + "out_proj.weight",)],
    }


def _nemotron_h(cfg: ModelConfig) -> Sources:
    """Nemotron-H: ``embeddings``, ``norm_f``, and per layer ``norm`` and ``mixer``,
    under ``backbone.`` (``text_weights`` renames a ``model.`` layout)."""
    out: Sources = {
        "embed_tokens.weight": [("backbone.embeddings.weight",)],
        "norm.weight": [("backbone.norm_f.weight",)],
        "lm_head.weight": [("lm_head.weight",)],
    }
    m = cfg.mamba
    assert m is not None
    for i, kind in enumerate(cfg.layer_types):
        ours, hf = f"layers.{i}.", f"backbone.layers.{i}."
        out[ours + "norm.weight"] = [(hf + "norm.weight",)]
        ours, hf = ours + "mixer.", hf + "mixer."
        if kind == "full_attention":
            out.update(_attention(cfg, ours, hf, False))
            continue
        if kind == "mamba":
            names = {"in_proj.weight": "in_proj.weight", "conv_weight": "conv1d.weight",
                     "A_log": "A_log", "D": "D", "dt_bias": "dt_bias",
                     "norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight"}  # fmt: skip
            if m.conv_bias:
                names["conv_bias"] = "conv1d.bias"
            biases = ("in_proj", "out_proj") if m.bias else ()
        elif kind == "moe":
            assert cfg.moe is not None
            experts = [f"{hf}experts.{e}." for e in range(cfg.moe.num_experts)]
            out[ours + "experts.gate_up"] = [(e + "up_proj.weight",) for e in experts]
            out[ours + "experts.down"] = [(e + "down_proj.weight",) for e in experts]
            names = {"router.weight": "gate.weight",
                     "router.bias": "gate.e_score_correction_bias",
                     "shared.up_proj.weight": "shared_experts.up_proj.weight",
                     "shared.down_proj.weight": "shared_experts.down_proj.weight"}  # fmt: skip
            biases = ()
            if cfg.mlp_bias:
                names.update({f"shared.{b}.bias": f"shared_experts.{b}.bias"
                              for b in ("up_proj", "down_proj")})  # fmt: skip
        else:  # mlp
            names = {"up_proj.weight": "up_proj.weight", "down_proj.weight": "down_proj.weight"}
            biases = ("up_proj", "down_proj") if cfg.mlp_bias else ()
        names.update({f"{b}.bias": f"{b}.bias" for b in biases})
        out.update({ours + k: [(hf + v,)] for k, v in names.items()})
    return out


def _dense_mlp(cfg: ModelConfig, ours: str, hf: str, fused: bool) -> Sources:
    gate_up = ("gate_up",) if fused else ("gate", "up")
    out: Sources = {
        ours + "gate_up_proj.weight": [tuple(f"{hf}{x}_proj.weight" for x in gate_up)],
        ours + "down_proj.weight": [(hf + "down_proj.weight",)],
    }
    if cfg.mlp_bias:
        out[ours + "gate_up_proj.bias"] = [tuple(f"{hf}{x}_proj.bias" for x in gate_up)]
        out[ours + "down_proj.bias"] = [(hf + "down_proj.bias",)]
    return out


def _experts(cfg: ModelConfig, ours: str, hf_layer: str) -> Sources:
    assert cfg.moe is not None
    prefix, router, (gate, up, down) = _EXPERT_NAMES[cfg.family]
    hf = f"{hf_layer}{prefix}."
    experts = [f"{hf}experts.{e}." for e in range(cfg.moe.num_experts)]
    out: Sources = {
        ours + "router.weight": [(f"{hf}{router}.weight",)],
        ours + "experts.gate_up": [(e + gate + ".weight", e + up + ".weight") for e in experts],
        ours + "experts.down": [(e + down + ".weight",) for e in experts],
    }
    if cfg.moe.shared_gate:  # Qwen3-Next, Qwen3.5-MoE
        shared = f"{hf}shared_expert."
        out[ours + "shared.gate_up_proj"] = [
            (shared + "gate_proj.weight", shared + "up_proj.weight")
        ]
        out[ours + "shared.down_proj"] = [(shared + "down_proj.weight",)]
        out[ours + "shared.gate"] = [(f"{hf}shared_expert_gate.weight",)]
    return out


#: Where multimodal Gemma 3 checkpoints keep the text model: transformers 5's
#: ``save_pretrained`` (``model.language_model.``) and the original Hub layout
#: (``language_model.model.``, ``language_model.lm_head``).
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
#: Multimodal checkpoints whose text model is renamed: architecture -> its prefixes.
_TEXT_MODEL_PREFIXES = {
    "Gemma3ForConditionalGeneration": _TEXT_PREFIXES,
    "Idefics3ForConditionalGeneration": {"model.text_model.": "model."},
}


def text_weights(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's tensors under text-model names: a multimodal Gemma 3's or
    Idefics3's text model renamed (its vision tower and projector are left out); a
    Nemotron-H saved under ``model.`` renamed to ``backbone.``; others unchanged."""
    if cfg.family == "nemotron_h":
        return {
            ("backbone." + name.removeprefix("model.") if name.startswith("model.") else name): t
            for name, t in weights.items()
        }
    prefixes = _TEXT_MODEL_PREFIXES.get(cfg.architecture)
    if prefixes is None:
        return weights
    out = {}
    for name, t in weights.items():
        for prefix, ours in prefixes.items():
            if name.startswith(prefix):
                out[ours + name.removeprefix(prefix)] = t
        if name == "lm_head.weight":
            out[name] = t
    return out

"""The shape of a Llama-family model, read from a transformers config.

transformers supplies the config (``AutoConfig``); this module turns it into
one small frozen dataclass holding exactly what our forward pass needs, and
refuses, with a message naming the field, anything the forward pass does not
implement (unknown architectures, unknown rope scaling types, other
activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: HF architecture name -> family flavour. SmolLM checkpoints are LlamaForCausalLM.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}

#: Rope scaling types our rotary embedding implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model.

    ``sliding_windows[i]`` is layer i's sliding window in tokens (a query at
    position p sees keys in (p - window, p]), or -1 for full attention.
    """

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_positions: int
    max_context_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_windows: tuple[int, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig``; raise ValueError if unsupported."""
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = getattr(hf, "model_type", None)
            by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
            by_type["qwen2"] = "Qwen2ForCausalLM"
            if not archs and model_type in by_type:
                arch = by_type[model_type]
            else:
                raise ValueError(
                    f"unsupported model architecture {archs or model_type!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        family = SUPPORTED_ARCHITECTURES[arch]
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only 'silu' / SwiGLU)")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope = _rope_parameters(hf)
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        max_pos = int(getattr(hf, "max_position_embeddings", 2048))
        if family == "llama":
            qkv_bias = o_bias = bool(getattr(hf, "attention_bias", False))
        elif family == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = False
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_positions=int(rope.get("original_max_position_embeddings", max_pos)),
            max_context_len=max_pos,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_windows=_windows(hf, family),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


def _rope_parameters(hf: Any) -> dict[str, Any]:
    """transformers 5 keeps rope settings in ``rope_parameters``; 4.x in rope_theta/rope_scaling."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and params:
        if "rope_theta" in params or "rope_type" in params:
            return dict(params)
        raise ValueError("per-layer-type rope parameters are not supported")
    out: dict[str, Any] = dict(getattr(hf, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return out


def _windows(hf: Any, family: str) -> tuple[int, ...]:
    """Per-layer sliding window (-1 = full attention), following transformers' semantics."""
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if family == "llama" or window is None:
        return (-1,) * n
    if family == "qwen2":
        if not getattr(hf, "use_sliding_window", False):
            return (-1,) * n
        types = getattr(hf, "layer_types", None) or ["full_attention"] * n
        return tuple(int(window) if t == "sliding_attention" else -1 for t in types)
    # Mistral: every layer uses the window when one is configured.
    return (int(window),) * n

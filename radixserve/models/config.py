"""The shape of a model, read from a transformers config.

transformers supplies the config (``AutoConfig``); this module turns it into
one small frozen dataclass holding exactly what our forward pass needs, and
refuses, with a message naming the field, anything the forward pass does not
implement (unknown architectures, unknown rope scaling types, other
activations). docs/models.md lists what each family needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: HF architecture name -> family. SmolLM checkpoints are LlamaForCausalLM.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3's multimodal checkpoints: the text model only (its config's ``text_config``).
    "Gemma3ForConditionalGeneration": "gemma3",
    # Qwen2.5-VL: a Qwen2 text model with multimodal rotary positions, beside the vision
    # tower of ``qwen2_5_vision.py`` (its config's ``text_config`` / ``vision_config``).
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    # Idefics3 (SmolVLM): a Llama text model (SmolLM2) beside a SigLIP vision tower
    # (``idefics3_vision.py``).
    "Idefics3ForConditionalGeneration": "llama",
    # Hybrid: gated delta-net linear attention beside gated full attention.
    "Qwen3_5ForCausalLM": "qwen3_5",
    # Qwen3.5's layers with a sparse MoE MLP (and a sigmoid-gated shared expert);
    # Qwen3-Next's delta-net projections interleave q/k/v/z and b/a per key head.
    "Qwen3NextForCausalLM": "qwen3_next",
    # Qwen3.5's layers with Qwen3-Next's MoE MLP on every layer (text model only).
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    # Hybrid: Mamba-2 layers beside attention and MLP layers, one mixer per layer.
    "NemotronHForCausalLM": "nemotron_h",
}
#: Architectures with a vision tower: their prompts may hold images (docs/multimodal.md).
VISION_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Idefics3ForConditionalGeneration")

#: A config without ``architectures`` is matched by its ``model_type`` (= family name,
#: except Gemma 3: ``gemma3`` is the multimodal config, ``gemma3_text`` the text-only one,
#: which GGUF files give; and the vision-language models, whose model types are their own).
_BY_MODEL_TYPE = {
    **{
        family: arch
        for arch, family in SUPPORTED_ARCHITECTURES.items()
        if arch not in VISION_ARCHITECTURES
    },
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
#: Hybrid families: some layers are recurrent (``layer_types``), the rest attention (and,
#: for Nemotron-H, MLP-only layers).
HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "nemotron_h")
#: Families built from Qwen3.5's layers (``hybrid.py``).
GATED_DELTA_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
#: Families whose MoE blocks add a sigmoid-gated SwiGLU shared expert.
GATED_SHARED_EXPERT_FAMILIES = ("qwen3_next", "qwen3_5_moe")
#: ``layer_types`` entries whose layers carry a recurrent state instead of K/V.
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba")
#: Families whose layers are Gemma's: (1 + w) RMSNorms around both sublayers, GeGLU,
#: embeddings scaled by sqrt(hidden), attention scaled by ``query_pre_attn_scalar``.
GEMMA_FAMILIES = ("gemma2", "gemma3")
#: The activation of each family's gated MLP (transformers' ``hidden_act`` /
#: ``hidden_activation`` name -> ours).
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


#: Rope scaling types our rotary embedding implements (``su`` is LongRoPE's old name).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class MoEConfig:
    """A sparse mixture-of-experts MLP: each token goes to ``top_k`` of ``num_experts``.

    ``renormalize``: the chosen experts' softmax probabilities are divided by their
    sum (Mixtral always; Qwen3-MoE when ``norm_topk_prob``). ``sparse_layers[i]``
    says whether layer i has the MoE block (else a dense MLP of the model's
    ``intermediate_size``).

    Nemotron-H's (``n_group`` > 0): sigmoid scores, experts chosen by score plus a
    per-expert correction bias among the ``topk_group`` best of ``n_group`` groups
    (a group's worth: its two best), weights the chosen scores (renormalised when
    ``renormalize``) times ``scaling``; squared-ReLU experts without a gate, plus a
    shared expert of ``shared_intermediate_size``.

    Qwen3-Next's: Qwen3-MoE's routing plus a SwiGLU shared expert of
    ``shared_intermediate_size`` whose output is scaled by ``sigmoid(shared_expert_gate(x))``
    (``shared_gate``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]
    n_group: int = 0
    topk_group: int = 0
    scaling: float = 1.0
    shared_intermediate_size: int = 0
    shared_gate: bool = False


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A gated delta-net layer's shape: ``num_k_heads`` query/key heads of
    ``k_head_dim``, ``num_v_heads`` value heads of ``v_head_dim`` (a multiple of the
    key heads: each key head serves consecutive value heads), and the causal
    convolution's kernel length."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution (q, k and v of every head)."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-2 mixer's shape: ``num_heads`` heads of ``head_dim`` channels whose
    B and C (``state_size`` each) are shared by ``n_groups`` groups of consecutive
    heads; the causal convolution (kernel ``conv_kernel``, bias or not) over x, B and
    C; ``dt_limit`` clamps the time step after its softplus; ``bias``: in/out
    projections with biases; ``norm_eps`` the gated RMSNorm's (one norm per group)."""

    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    conv_bias: bool
    bias: bool
    dt_limit: tuple[float, float]
    norm_eps: float

    @property
    def inner_size(self) -> int:
        """x's channels (every head's)."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.inner_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model.

    ``sliding_windows[i]`` is layer i's sliding window in tokens (a query at
    position p sees keys in (p - window, p]), or -1 for full attention.
    ``rotary_dim`` <= ``head_dim``: only the first ``rotary_dim`` features of
    each head are rotated (partial rotary). ``rope_short_factor`` /
    ``rope_long_factor`` are LongRoPE's per-frequency divisors (empty otherwise),
    ``rope_attention_factor`` its scale on cos and sin.

    Gemma's: ``activation`` ``gelu_tanh`` (GeGLU; else ``silu``, SwiGLU);
    ``norm_unit_offset``: every RMSNorm scales by (1 + w); ``sandwich_norms``: each
    sublayer's output is normalised too (post-attention, pre/post-feedforward norms);
    ``embed_scale`` multiplies the embeddings; ``attn_scale`` (0: head_dim ** -0.5)
    scales the scores; ``attn_softcap`` / ``final_softcap`` (0: none) cap attention
    scores / logits at ``cap * tanh(x / cap)``; ``rope_local_theta`` (0: none) is the
    rope base of the sliding-window layers, which then rotate without scaling.
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
    qk_norm: bool = False
    rotary_dim: int = 0  # 0: head_dim
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0
    moe: MoEConfig | None = None
    activation: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    rope_local_theta: float = 0.0
    # Hybrids, per layer: "full_attention" | "linear_attention" (Qwen3.5), "full_attention"
    # | "mamba" | "mlp" | "moe" (Nemotron-H: one mixer per layer; "mlp" and "moe" layers have
    # no token mixer).
    layer_types: tuple[str, ...] = ()
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    mamba: MambaConfig | None = None
    # Multimodal rotary (Qwen2.5-VL): the rotary frequencies split in three sections
    # turned by the time, height and width position rows (empty: one position row).
    mrope_section: tuple[int, ...] = ()

    @property
    def hybrid(self) -> bool:
        """Whether some layers are recurrent (their state is not per-token KV)."""
        return any(t in RECURRENT_LAYER_TYPES for t in self.layer_types)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers with K/V in the pool (the attention layers), in order."""
        return tuple(
            i
            for i in range(self.num_layers)
            if not self.layer_types or self.layer_types[i] == "full_attention"
        )

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The recurrent layers, in order (their states live in the state pool)."""
        return tuple(i for i in range(self.num_layers) if self._recurrent(i))

    def kv_layer(self, layer: int) -> int:
        """Layer ``layer``'s index in the KV pool."""
        return self.kv_layers.index(layer)

    def recurrent_index(self, layer: int) -> int:
        """Layer ``layer``'s index among the recurrent layers (the state pool's)."""
        return self.recurrent_layers.index(layer)

    def _recurrent(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] in RECURRENT_LAYER_TYPES

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One request's state in one recurrent layer: the conv state ``(channels,
        kernel - 1)`` and the recurrent state (gated delta-net: ``(v_heads, k_head_dim,
        v_head_dim)``; Mamba-2: ``(heads, head_dim, state_size)``)."""
        if self.mamba is not None:
            m = self.mamba
            return (m.conv_dim, m.conv_kernel - 1), (m.num_heads, m.head_dim, m.state_size)
        if self.linear is not None:
            lin = self.linear
            return (lin.conv_dim, lin.conv_kernel - 1), (
                lin.num_v_heads, lin.k_head_dim, lin.v_head_dim
            )  # fmt: skip
        raise ValueError(f"{self.architecture} has no recurrent layers")

    @property
    def kv_sliding_windows(self) -> tuple[int, ...]:
        """``sliding_windows`` of the KV pool's layers."""
        return tuple(self.sliding_windows[i] for i in self.kv_layers)

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q.k by."""
        return self.attn_scale or self.head_dim**-0.5

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers ``PretrainedConfig``; raise ValueError if unsupported."""
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            model_type = getattr(hf, "model_type", None)
            if not archs and model_type in _BY_MODEL_TYPE:
                arch = _BY_MODEL_TYPE[model_type]
            else:
                raise ValueError(
                    f"unsupported model architecture {archs or model_type!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        family = SUPPORTED_ARCHITECTURES[arch]
        if arch in ("Gemma3ForConditionalGeneration", *VISION_ARCHITECTURES):
            hf = hf.text_config
        gemma = family in GEMMA_FAMILIES
        act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
        # Nemotron-H names its MLP activation otherwise (``_nemotron_h`` checks it).
        if family != "nemotron_h" and _ACTIVATIONS.get(act) != ("gelu_tanh" if gemma else "silu"):
            want = "gelu_pytorch_tanh" if gemma else "silu"
            raise ValueError(f"unsupported activation {act!r} for {family} (only {want!r})")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (causal LMs only)")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        max_pos = int(getattr(hf, "max_position_embeddings", 2048))
        rope, local_theta = _rope_parameters(hf, family)
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        rope_type = "longrope" if rope_type == "su" else rope_type
        # Qwen2.5-VL's older configs name its sectioned default rotary "mrope".
        rope_type = "default" if rope_type == "mrope" else rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope scaling type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        partial = float(
            rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
        )
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {partial} gives an odd or empty rotary dim")
        original_max = int(
            rope.get("original_max_position_embeddings")
            or getattr(hf, "original_max_position_embeddings", None)
            or max_pos
        )
        qkv_bias, o_bias, mlp_bias = _biases(hf, family)
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
            rms_norm_eps=float(getattr(hf, "rms_norm_eps", None) or hf.layer_norm_epsilon),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
            rope_type=rope_type,
            rope_factor=float(rope.get("factor") or 1.0),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_positions=original_max,
            max_context_len=max_pos,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_windows=_windows(hf, family),
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", *GATED_DELTA_FAMILIES),
            rotary_dim=rotary_dim,
            **_longrope(rope, rope_type, rotary_dim, max_pos, original_max),
            moe=_moe(hf, family),
            **(_gemma(hf, family, head_dim, local_theta) if gemma else {}),
            **(_hybrid(hf, family) if family in GATED_DELTA_FAMILIES else {}),
            **(_nemotron_h(hf) if family == "nemotron_h" else {}),
            mrope_section=_mrope_section(rope, arch, rotary_dim),
        )


def _mrope_section(rope: dict[str, Any], arch: str, rotary_dim: int) -> tuple[int, ...]:
    """Qwen2.5-VL's rotary sections (time, height, width), which must cover the rotary
    frequencies; () for a model with one position row."""
    if arch != "Qwen2_5_VLForConditionalGeneration":
        return ()
    section = tuple(int(s) for s in rope.get("mrope_section") or ())
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {section} does not split {rotary_dim // 2} frequencies")
    return section


def _rope_parameters(hf: Any, family: str) -> tuple[dict[str, Any], float]:
    """(rope settings of the global layers, rope base of the sliding layers or 0).

    transformers 5 keeps rope settings in ``rope_parameters`` (Gemma 3: one dict per
    layer type); 4.x in rope_theta / rope_scaling (Gemma 3: and rope_local_base_freq).
    """
    params = getattr(hf, "rope_parameters", None)
    local = 0.0
    if isinstance(params, dict) and "full_attention" in params and family == "gemma3":
        local_params = params.get("sliding_attention") or {}
        if local_params.get("rope_type", "default") != "default":
            raise ValueError("Gemma 3's sliding layers support the default rope type only")
        local = float(local_params.get("rope_theta", 10000.0))
        params = params["full_attention"]
    elif family == "gemma3":
        local = float(getattr(hf, "rope_local_base_freq", 10000.0))
    if isinstance(params, dict) and params:
        if "rope_theta" in params or "rope_type" in params:
            return dict(params), local
        raise ValueError("per-layer-type rope parameters are not supported")
    out: dict[str, Any] = dict(getattr(hf, "rope_scaling", None) or {})
    out.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    return out, local


def _gemma(hf: Any, family: str, head_dim: int, local_theta: float) -> dict[str, Any]:
    """Gemma 2/3's fields. transformers' Gemma 3 attention has no soft-capping, whatever
    its config's ``attn_logit_softcapping`` says."""
    scalar = getattr(hf, "query_pre_attn_scalar", None) or head_dim
    attn_cap = getattr(hf, "attn_logit_softcapping", None) if family == "gemma2" else None
    return dict(
        activation="gelu_tanh",
        norm_unit_offset=True,
        sandwich_norms=True,
        embed_scale=float(hf.hidden_size) ** 0.5,
        attn_scale=float(scalar) ** -0.5,
        attn_softcap=float(attn_cap or 0.0),
        final_softcap=float(getattr(hf, "final_logit_softcapping", None) or 0.0),
        rope_local_theta=local_theta,
    )


def _hybrid(hf: Any, family: str) -> dict[str, Any]:
    """Qwen3.5's and Qwen3-Next's fields: layer types, the gated delta-net shape, (1 + w) norms, the
    attention output gate."""
    types = tuple(hf.layer_types)
    if len(types) != hf.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {hf.num_hidden_layers} layers")
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"unsupported layer types {unknown} for {family}")
    lin = LinearAttentionConfig(
        num_k_heads=int(hf.linear_num_key_heads),
        num_v_heads=int(hf.linear_num_value_heads),
        k_head_dim=int(hf.linear_key_head_dim),
        v_head_dim=int(hf.linear_value_head_dim),
        conv_kernel=int(hf.linear_conv_kernel_dim),
    )
    if lin.num_v_heads % lin.num_k_heads:
        raise ValueError(
            f"linear_num_value_heads {lin.num_v_heads} is not a multiple of "
            f"linear_num_key_heads {lin.num_k_heads}"
        )
    if lin.conv_kernel < 2:
        raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {lin.conv_kernel}")
    if "full_attention" not in types:
        raise ValueError(f"{family} without a full-attention layer is not supported")
    return dict(layer_types=types, linear=lin, norm_unit_offset=True, attn_output_gate=True)


#: Nemotron-H's layer types (transformers 5's ``layers_block_type`` names; older configs
#: spell them as ``hybrid_override_pattern`` characters M, *, -, E) -> ours.
_NEMOTRON_H_LAYERS = {"linear_attention": "mamba", "full_attention": "full_attention",
                      "mlp": "mlp", "moe": "moe", "M": "mamba", "*": "full_attention",
                      "-": "mlp", "E": "moe"}  # fmt: skip


def _nemotron_h(hf: Any) -> dict[str, Any]:
    """Nemotron-H's fields: one mixer per layer (Mamba-2, attention without rotary, a
    squared-ReLU MLP or mixture of experts), the Mamba-2 shape, the experts'. Latent
    expert projections, sliding windows and other activations are refused."""
    types = _nemotron_h_types(hf)
    if "full_attention" not in types:
        raise ValueError("nemotron_h without an attention layer is not supported")
    for field, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if getattr(hf, field, want) != want:
            raise ValueError(f"unsupported {field} {getattr(hf, field)!r} (only {want!r})")
    if getattr(hf, "sliding_window", None) is not None:
        raise ValueError("Nemotron-H with sliding_window is not supported")
    lo, hi = (float(x) for x in getattr(hf, "time_step_limit", (0.0, float("inf"))))
    mamba = MambaConfig(
        num_heads=int(hf.mamba_num_heads),
        head_dim=int(hf.mamba_head_dim),
        n_groups=int(hf.n_groups),
        state_size=int(hf.ssm_state_size),
        conv_kernel=int(hf.conv_kernel),
        conv_bias=bool(hf.use_conv_bias),
        bias=bool(getattr(hf, "use_bias", False)),
        dt_limit=(lo, hi),
        norm_eps=float(hf.layer_norm_epsilon),
    )
    if mamba.num_heads % mamba.n_groups:
        raise ValueError(
            f"mamba_num_heads {mamba.num_heads} is not a multiple of n_groups {mamba.n_groups}"
        )
    if mamba.conv_kernel < 2:
        raise ValueError(f"conv_kernel must be >= 2, got {mamba.conv_kernel}")
    if not 0.0 <= lo <= hi:
        raise ValueError(f"bad time_step_limit {(lo, hi)}")
    return dict(layer_types=types, mamba=mamba, activation="relu2")


def _nemotron_h_types(hf: Any) -> tuple[str, ...]:
    """Nemotron-H's layer types, ours (``_NEMOTRON_H_LAYERS``)."""
    blocks = getattr(hf, "layers_block_type", None) or list(hf.hybrid_override_pattern)
    unknown = sorted(set(blocks) - set(_NEMOTRON_H_LAYERS))
    if unknown:
        raise ValueError(f"unsupported Nemotron-H layer types {unknown}")
    return tuple(_NEMOTRON_H_LAYERS[b] for b in blocks)


def _nemotron_h_moe(hf: Any) -> MoEConfig | None:
    """Nemotron-H's experts (``MoEConfig``'s docstring), None without MoE layers."""
    types = _nemotron_h_types(hf)
    if "moe" not in types:
        return None
    if getattr(hf, "moe_latent_size", None) is not None:
        raise ValueError("Nemotron-H latent expert projections (moe_latent_size) are not supported")
    moe = MoEConfig(
        num_experts=int(hf.n_routed_experts),
        top_k=int(hf.num_experts_per_tok),
        intermediate_size=int(hf.moe_intermediate_size),
        renormalize=bool(hf.norm_topk_prob),
        sparse_layers=tuple(t == "moe" for t in types),
        n_group=int(hf.n_group),
        topk_group=int(hf.topk_group),
        scaling=float(hf.routed_scaling_factor),
        shared_intermediate_size=int(hf.moe_shared_expert_intermediate_size),
    )
    if moe.n_group < 1 or moe.num_experts % moe.n_group or moe.num_experts // moe.n_group < 2:
        raise ValueError(
            f"n_routed_experts {moe.num_experts} must be n_group {moe.n_group} groups of >= 2"
        )
    if not 0 < moe.topk_group <= moe.n_group or not 0 < moe.top_k <= moe.num_experts:
        raise ValueError(f"bad expert choice: top {moe.top_k} in {moe.topk_group} groups")
    return moe


def _longrope(
    rope: dict[str, Any], rope_type: str, rotary_dim: int, max_pos: int, original_max: int
) -> dict[str, Any]:
    """LongRoPE's factor lists and attention factor, with transformers' defaults."""
    if rope_type != "longrope":
        return {}
    short, long = tuple(rope.get("short_factor") or ()), tuple(rope.get("long_factor") or ())
    if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
        raise ValueError(f"longrope short_factor/long_factor need {rotary_dim // 2} entries each")
    # Without an explicit factor, the context extension ratio stands in for it.
    factor = rope.get("factor") or max_pos / original_max
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_max))
    return dict(
        rope_short_factor=tuple(float(x) for x in short),
        rope_long_factor=tuple(float(x) for x in long),
        rope_attention_factor=float(attention),
    )


def _biases(hf: Any, family: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o bias, MLP bias) as each family's transformers code builds them."""
    if family == "llama":
        attention = bool(getattr(hf, "attention_bias", False))
        return attention, attention, bool(getattr(hf, "mlp_bias", False))
    if family == "qwen2":
        return True, False, False
    if family in ("qwen3", "qwen3_moe", "gemma2", "gemma3", *GATED_DELTA_FAMILIES):
        attention = bool(getattr(hf, "attention_bias", False))
        return attention, attention, False
    if family == "nemotron_h":  # transformers builds its attention without biases
        return False, False, bool(getattr(hf, "mlp_bias", False))
    return False, False, False  # mistral, mixtral, phi3


def _moe(hf: Any, family: str) -> MoEConfig | None:
    if family == "nemotron_h":
        return _nemotron_h_moe(hf)
    n = hf.num_hidden_layers
    if family == "mixtral":
        num = int(hf.num_local_experts)
        return MoEConfig(num, int(hf.num_experts_per_tok), int(hf.intermediate_size), True,
                         (True,) * n)  # fmt: skip
    if family not in ("qwen3_moe", *GATED_SHARED_EXPERT_FAMILIES):
        return None
    num, step = int(hf.num_experts), int(getattr(hf, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    sparse = tuple(i not in dense and num > 0 and (i + 1) % step == 0 for i in range(n))
    if family == "qwen3_moe":
        return MoEConfig(num, int(hf.num_experts_per_tok), int(hf.moe_intermediate_size),
                         bool(getattr(hf, "norm_topk_prob", False)), sparse)  # fmt: skip
    # Qwen3-Next, Qwen3.5-MoE: a SwiGLU shared expert beside the routed ones, scaled per
    # token by sigmoid(shared_expert_gate(x)). Qwen3.5-MoE's router always renormalises
    # (its config has no norm_topk_prob) and every layer is sparse.
    shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
    if shared <= 0:
        raise ValueError(f"shared_expert_intermediate_size must be > 0, got {shared}")
    if num <= 0:
        raise ValueError(f"num_experts must be > 0, got {num}")
    renormalize = family == "qwen3_5_moe" or bool(getattr(hf, "norm_topk_prob", False))
    return MoEConfig(num, int(hf.num_experts_per_tok), int(hf.moe_intermediate_size),
                     renormalize, sparse, shared_intermediate_size=shared,
                     shared_gate=True)  # fmt: skip


def _windows(hf: Any, family: str) -> tuple[int, ...]:
    """Per-layer sliding window (-1 = full attention), following transformers' semantics."""
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    if family == "llama" or window is None:
        return (-1,) * n
    if family in ("qwen2", "qwen3"):
        if not getattr(hf, "use_sliding_window", False):
            return (-1,) * n
        types = getattr(hf, "layer_types", None) or ["full_attention"] * n
        return tuple(int(window) if t == "sliding_attention" else -1 for t in types)
    if family in GEMMA_FAMILIES:
        # transformers 5 always writes layer_types; older configs give the pattern.
        pattern = 2 if family == "gemma2" else int(getattr(hf, "sliding_window_pattern", 6))
        types = getattr(hf, "layer_types", None) or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        ]
        return tuple(int(window) if t == "sliding_attention" else -1 for t in types)
    if family == "qwen3_moe" and not getattr(hf, "use_sliding_window", False):
        return (-1,) * n
    # Mistral, Mixtral, Phi-3, Qwen3-MoE: every layer uses the window when one is configured.
    return (int(window),) * n

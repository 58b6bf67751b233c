"""GGUF files of the hybrid families: llama.cpp's ``qwen35`` (Qwen3.5), ``qwen35moe``
(Qwen3.5-MoE), ``qwen3next`` (Qwen3-Next) and ``nemotron_h`` / ``nemotron_h_moe``
(Nemotron-H without / with experts).

transformers has no GGUF config reader for these architectures, so ``hf_config`` builds
the transformers config from the file's metadata, and ``to_hf`` undoes what llama.cpp's
converter does to the tensors.

qwen35 (Qwen3.5):

- layer types: only ``full_attention_interval`` is stored; layer ``i`` is full attention
  when ``(i + 1) % interval == 0`` (as llama.cpp reads it). The gated delta-net shape is
  ``ssm.conv_kernel`` (conv kernel), ``ssm.state_size`` (key head dim), ``ssm.group_count``
  (key heads), ``ssm.time_step_rank`` (value heads) and ``ssm.inner_size`` (value heads x
  value head dim); ``rope.dimension_count`` is the rotated part of each head.
- norms: every RMSNorm except the delta-net's gated norm (``ssm_norm``) is stored as 1 + w.
- ``ssm_a`` is ``-exp(A_log)``: ``A_log`` comes back as ``log(-A)`` (computed in float64;
  exact to float32 rounding, not bit for bit).
- ``ssm_conv1d`` is squeezed to [channels, kernel]; ``ssm_dt.bias`` is ``dt_bias``.
- value heads: where there are more value heads than key heads the converter reorders
  them from grouped by key head (HF: k0v0 k0v1 .. k1v0 ..) to tiled (k0v0 k1v0 .. k0v1 ..)
  in the V rows of ``attn_qkv`` (``in_proj_qkv``), ``attn_gate`` (``in_proj_z``),
  ``ssm_beta`` / ``ssm_alpha`` (``in_proj_b`` / ``in_proj_a``), ``ssm_a``, ``ssm_dt``,
  the V channels of ``ssm_conv1d`` and the columns of ``ssm_out``; we undo it.
- multi-token-prediction blocks (``nextn_predict_layers``, after the decoder's) are not
  served and skipped.

qwen35moe (Qwen3.5-MoE): Qwen3.5's layers and transforms (value-head reorder included)
with a sparse MLP on every layer: router ``ffn_gate_inp``, stacked experts
``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` (or ``ffn_gate_up_exps``, gate
rows then up rows, from the converter's ``--fuse-gate-up-exps``), shared expert
``ffn_gate_shexp`` / ``ffn_up_shexp`` / ``ffn_down_shexp`` and its gate
``ffn_gate_inp_shexp``. ``expert_count``, ``expert_used_count``,
``expert_feed_forward_length`` and ``expert_shared_feed_forward_length`` give the shape;
``feed_forward_length`` is written only when the checkpoint's config has an
``intermediate_size`` (unused: no layer is dense; else the expert width is taken); the
router always renormalises. A layer without ``ffn_gate_inp`` is refused.

qwen3next (Qwen3-Next): as qwen35moe (same keys, norms as 1 + w, ``ssm_a``, conv and
``dt`` handling, MoE tensors), except:

- no value-head reorder: the converter writes the value heads in the checkpoint's
  grouped order.
- the checkpoint's ``in_proj_qkvz`` (per key head: q, k, then v and z of its value heads)
  is split into ``attn_qkv`` (q, k, v of every head) and ``attn_gate`` (z); we interleave
  them back. A file from an older converter stores it unchanged as ``ssm_in``.
  ``in_proj_ba`` is stored unchanged as ``ssm_ba``.
- ``expert_weights_norm`` (when written) is the router's renormalisation (else on, as
  llama.cpp). Every layer is sparse: the format has no dense-MLP tensors for qwen3next
  (the converter cannot write a checkpoint with ``mlp_only_layers``), so a layer without
  ``ffn_gate_inp`` is refused, as for qwen35moe. The multi-token-prediction weights are
  not converted.

nemotron_h / nemotron_h_moe (Nemotron-H):

- layer types: per-layer arrays ``attention.head_count_kv`` (non-zero: attention) and
  ``feed_forward_length`` (non-zero: MLP, or MoE in ``nemotron_h_moe``); both zero: Mamba-2.
  A file can therefore not mix dense MLP and MoE layers (nor can the converter write one).
- Mamba-2: ``ssm.time_step_rank`` heads, ``ssm.inner_size / time_step_rank`` head dim,
  ``ssm.group_count`` groups, ``ssm.state_size``, ``ssm.conv_kernel``. ``ssm_a`` is
  ``-exp(A_log)`` and ``ssm_d`` is ``D``, both as [heads, 1]; ``ssm_norm`` is
  [groups, inner / groups]; ``ssm_conv1d`` is squeezed.
- attention: the converter treats Nemotron-H as a Granite hybrid and permutes q/k rows
  for llama.cpp's interleaved rotary even though Nemotron-H has no rotary; we undo it.
- ``context_length`` is written as 2**20 (no rotary: any length), so ``max_position_embeddings``
  is that rather than the checkpoint's; ``time_step_limit`` is not stored (the default,
  no clamp, as llama.cpp).
- MoE: router ``ffn_gate_inp``, correction bias ``exp_probs_b``, stacked ``ffn_up_exps``
  / ``ffn_down_exps`` (squared-ReLU experts have no gate), shared expert
  ``ffn_up_shexp`` / ``ffn_down_shexp``; the ``expert_*`` keys give the shape and routing.
  The dense MLP width of an MoE file is not stored: ``intermediate_size`` is the expert width.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: llama.cpp architecture -> the transformers architecture we build a config for.
HYBRID_GGUF_ARCHITECTURES = {
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "nemotron_h_moe": "NemotronHForCausalLM",
}

QWEN35_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
#: The sparse MLP of Qwen3-Next and Qwen3.5-MoE: router, shared expert and its gate (the
#: stacked experts are split per expert by the loader).
QWEN_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{
        f"ffn_{g}_shexp.weight": f"mlp.shared_expert.{g}_proj.weight"
        for g in ("gate", "up", "down")
    },
}
QWEN35MOE_BLOCK_NAMES = {**QWEN35_BLOCK_NAMES, **QWEN_SHARED_EXPERT_NAMES}
#: Qwen3-Next: ``attn_qkv`` is read together with ``attn_gate`` (``QKVZ_PARTS``) as
#: ``in_proj_qkvz``; older files hold that tensor as ``ssm_in``; ``in_proj_ba`` is ``ssm_ba``.
QWEN3NEXT_BLOCK_NAMES = {
    **{k: v for k, v in QWEN35MOE_BLOCK_NAMES.items()
       if k not in ("attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")},
    "attn_qkv.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
}  # fmt: skip
#: Qwen3-Next: a tensor read together with a second one of the same block.
QKVZ_PARTS = {"attn_qkv.weight": "attn_gate.weight"}
NEMOTRON_H_GLOBAL_NAMES = {
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": "lm_head.weight",
}
NEMOTRON_H_BLOCK_NAMES = {
    "attn_norm.weight": "norm.weight",
    **{f"ssm_{g}.{b}": f"mixer.{h}.{b}" for g, h in (("in", "in_proj"), ("out", "out_proj"))
       for b in ("weight", "bias")},
    "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_norm.weight": "mixer.norm.weight",
    **{f"attn_{g}.{b}": f"mixer.{g}_proj.{b}" for g in "qkv" for b in ("weight", "bias")},
    "attn_output.weight": "mixer.o_proj.weight",
    "attn_output.bias": "mixer.o_proj.bias",
    **{f"ffn_{g}.{b}": f"mixer.{g}_proj.{b}" for g in ("up", "down") for b in ("weight", "bias")},
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    **{f"ffn_{g}_shexp.{b}": f"mixer.shared_experts.{g}_proj.{b}"
       for g in ("up", "down") for b in ("weight", "bias")},
}  # fmt: skip
#: Stacked expert tensors of nemotron_h_moe -> the per-expert projection name.
NEMOTRON_H_STACKED_EXPERTS = {
    "ffn_up_exps.weight": ("up_proj",),
    "ffn_down_exps.weight": ("down_proj",),
}


class Metadata:
    """A GGUF file's ``{arch}.*`` metadata, with a clear error for a missing key."""

    def __init__(self, reader: Any, path: Any) -> None:
        self.reader, self.path = reader, path
        self.arch = str(reader.fields["general.architecture"].contents())

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key.format(arch=self.arch))
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(
                f"GGUF {self.path} ({self.arch}) has no {key.format(arch=self.arch)!r}"
            )
        return value

    def tensor_shape(self, name: str) -> tuple[int, ...] | None:
        for t in self.reader.tensors:
            if t.name == name:
                return tuple(int(x) for x in reversed(t.shape))
        return None

    def has_tensor(self, suffix: str) -> bool:
        return any(t.name.endswith(suffix) for t in self.reader.tensors)


def decoder_layers(meta: Metadata) -> int:
    """The decoder's layers: ``block_count`` less the multi-token-prediction blocks."""
    import gguf

    return int(meta.need(gguf.Keys.LLM.BLOCK_COUNT)) - int(
        meta.get(gguf.Keys.LLM.NEXTN_PREDICT_LAYERS, 0) or 0
    )


def hf_config(reader: Any, path: Any) -> Any:
    """The transformers config of a hybrid GGUF file (``HYBRID_GGUF_ARCHITECTURES``).

    Raises ValueError naming a metadata key that is missing or cannot be mapped."""
    meta = Metadata(reader, path)
    common = _common(meta)
    if meta.arch.startswith("qwen"):
        return _qwen35(meta, common)
    return _nemotron_h(meta, common)


def _per_layer(value: Any, n: int) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * n
    return values[:n]


def _heads(meta: Metadata) -> int:
    """``attention.head_count``: one number, or per layer (0 on recurrent layers), the
    same on every attention layer."""
    import gguf

    value = meta.need(gguf.Keys.Attention.HEAD_COUNT)
    counts = {int(v) for v in value} - {0} if isinstance(value, (list, tuple)) else {int(value)}
    if len(counts) != 1:
        raise ValueError(
            f"GGUF {meta.path}: {meta.arch}.attention.head_count {value} is not one "
            "count for every attention layer"
        )
    return counts.pop()


def _common(meta: Metadata) -> dict[str, Any]:
    import gguf

    K = gguf.Keys
    embd = meta.tensor_shape("token_embd.weight")
    if embd is None:
        raise ValueError(f"GGUF {meta.path} has no 'token_embd.weight'")
    head_dim = meta.get(K.Attention.KEY_LENGTH)
    if head_dim is not None and meta.get(K.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise ValueError(
            f"GGUF {meta.path}: {meta.arch}.attention.value_length differs from key_length"
        )
    out = dict(
        vocab_size=int(embd[0]),
        hidden_size=int(meta.need(K.LLM.EMBEDDING_LENGTH)),
        num_hidden_layers=decoder_layers(meta),
        num_attention_heads=_heads(meta),
        max_position_embeddings=int(meta.need(K.LLM.CONTEXT_LENGTH)),
        tie_word_embeddings=meta.tensor_shape("output.weight") is None,
    )
    # Without key_length llama.cpp takes embedding_length / head_count (transformers'
    # config defaults would be 256 or 128).
    out["head_dim"] = int(head_dim or out["hidden_size"] // out["num_attention_heads"])
    for key, attr in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                      ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                      ("tokenizer.ggml.padding_token_id", "pad_token_id")):  # fmt: skip
        if meta.get(key) is not None:
            out[attr] = int(meta.get(key))
    kind = meta.get(K.Rope.SCALING_TYPE)
    if kind not in (None, "none"):
        raise ValueError(
            f"GGUF {meta.path}: {meta.arch}.rope.scaling.type {kind!r} is not supported"
        )
    return out


def _qwen35(meta: Metadata, common: dict[str, Any]) -> Any:
    """qwen35, qwen35moe and qwen3next: the gated delta-net hybrids."""
    import gguf
    import transformers

    K = gguf.Keys
    n = common["num_hidden_layers"]
    interval = int(meta.need(K.LLM.FULL_ATTENTION_INTERVAL))
    if interval < 1:
        raise ValueError(f"GGUF {meta.path}: {meta.arch}.full_attention_interval {interval} < 1")
    v_heads = int(meta.need(K.SSM.TIME_STEP_RANK))
    inner = int(meta.need(K.SSM.INNER_SIZE))
    if inner % v_heads:
        raise ValueError(
            f"GGUF {meta.path}: {meta.arch}.ssm.inner_size {inner} is not a multiple of "
            f"ssm.time_step_rank {v_heads}"
        )
    head_dim = common["head_dim"]
    rope_dims = int(meta.get(K.Rope.DIMENSION_COUNT, head_dim))
    kv = _per_layer(meta.need(K.Attention.HEAD_COUNT_KV), n)
    if meta.arch == "qwen35":
        kind, extra = (
            transformers.Qwen3_5TextConfig,
            {"intermediate_size": int(meta.need(K.LLM.FEED_FORWARD_LENGTH))},
        )
    else:
        kind = (
            transformers.Qwen3NextConfig
            if meta.arch == "qwen3next"
            else (transformers.Qwen3_5MoeTextConfig)
        )
        extra = _qwen_moe(meta, n)
    config = kind(
        **common,
        **extra,
        num_key_value_heads=max(kv),
        rms_norm_eps=float(meta.need(K.Attention.LAYERNORM_RMS_EPS)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(meta.get(K.Rope.FREQ_BASE, 10000.0)),
            "partial_rotary_factor": rope_dims / head_dim,
        },
        linear_conv_kernel_dim=int(meta.need(K.SSM.CONV_KERNEL)),
        linear_key_head_dim=int(meta.need(K.SSM.STATE_SIZE)),
        linear_num_key_heads=int(meta.need(K.SSM.GROUP_COUNT)),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=inner // v_heads,
        layer_types=[
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)
        ],
    )
    config.architectures = [HYBRID_GGUF_ARCHITECTURES[meta.arch]]
    return config


def _qwen_moe(meta: Metadata, n: int) -> dict[str, Any]:
    """The sparse-MLP settings of a qwen35moe / qwen3next file (the module docstring)."""
    import gguf

    K = gguf.Keys
    width = int(meta.need(K.LLM.EXPERT_FEED_FORWARD_LENGTH))
    out: dict[str, Any] = dict(
        num_experts=int(meta.need(K.LLM.EXPERT_COUNT)),
        num_experts_per_tok=int(meta.need(K.LLM.EXPERT_USED_COUNT)),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=int(meta.need(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)),
        # written when the checkpoint's config has one; a dense layer's width
        intermediate_size=int(meta.get(K.LLM.FEED_FORWARD_LENGTH, width)),
    )
    dense = [i for i in range(n) if meta.tensor_shape(f"blk.{i}.ffn_gate_inp.weight") is None]
    if dense:
        raise ValueError(
            f"GGUF {meta.path}: {meta.arch} layers {dense} have no router (ffn_gate_inp)"
        )
    if meta.arch == "qwen35moe":
        return out
    norm = meta.get(K.LLM.EXPERT_WEIGHTS_NORM)
    return dict(out, norm_topk_prob=True if norm is None else bool(norm), decoder_sparse_step=1)


def _nemotron_h(meta: Metadata, common: dict[str, Any]) -> Any:
    import gguf
    import transformers

    K = gguf.Keys
    n = common["num_hidden_layers"]
    moe = meta.arch == "nemotron_h_moe"
    kv = _per_layer(meta.need(K.Attention.HEAD_COUNT_KV), n)
    ff = _per_layer(meta.need(K.LLM.FEED_FORWARD_LENGTH), n)
    pattern = "".join("*" if h else ("E" if moe else "-") if f else "M" for h, f in zip(kv, ff))
    heads = int(meta.need(K.SSM.TIME_STEP_RANK))
    inner = int(meta.need(K.SSM.INNER_SIZE))
    if inner % heads:
        raise ValueError(
            f"GGUF {meta.path}: {meta.arch}.ssm.inner_size {inner} is not a multiple of "
            f"ssm.time_step_rank {heads}"
        )
    widths = {f for f in ff if f}
    if len(widths) > 1:
        raise ValueError(
            f"GGUF {meta.path}: {meta.arch}.feed_forward_length has several widths {widths}"
        )
    width = widths.pop() if widths else 0
    extra: dict[str, Any] = {}
    if moe:
        if meta.get(K.LLM.MOE_LATENT_SIZE) is not None:
            raise ValueError(
                f"GGUF {meta.path}: nemotron_h_moe.moe_latent_size (latent expert "
                "projections) is not supported"
            )
        n_group = int(meta.get(K.LLM.EXPERT_GROUP_COUNT, 1) or 1)
        extra = dict(
            n_routed_experts=int(meta.need(K.LLM.EXPERT_COUNT)),
            num_experts_per_tok=int(meta.need(K.LLM.EXPERT_USED_COUNT)),
            moe_intermediate_size=int(meta.need(K.LLM.EXPERT_FEED_FORWARD_LENGTH)),
            moe_shared_expert_intermediate_size=int(
                meta.need(K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)
            ),
            n_shared_experts=int(meta.get(K.LLM.EXPERT_SHARED_COUNT, 1)),
            norm_topk_prob=bool(meta.need(K.LLM.EXPERT_WEIGHTS_NORM)),
            routed_scaling_factor=float(meta.need(K.LLM.EXPERT_WEIGHTS_SCALE)),
            n_group=n_group,
            topk_group=int(
                meta.need(K.LLM.EXPERT_GROUP_USED_COUNT) if n_group > 1
                else meta.get(K.LLM.EXPERT_GROUP_USED_COUNT, 1)
            ),
        )  # fmt: skip
        width = extra["moe_intermediate_size"]
    # llama.cpp reads the RMS key; a file with only the layer-norm key is read the same.
    eps = float(meta.get(K.Attention.LAYERNORM_RMS_EPS) or meta.need(K.Attention.LAYERNORM_EPS))
    config = transformers.NemotronHConfig(
        **common,
        intermediate_size=width,
        num_key_value_heads=max(kv) or common["num_attention_heads"],
        hybrid_override_pattern=pattern,
        mamba_num_heads=heads,
        mamba_head_dim=inner // heads,
        n_groups=int(meta.need(K.SSM.GROUP_COUNT)),
        ssm_state_size=int(meta.need(K.SSM.STATE_SIZE)),
        conv_kernel=int(meta.need(K.SSM.CONV_KERNEL)),
        use_conv_bias=meta.has_tensor("ssm_conv1d.bias"),
        use_bias=meta.has_tensor("ssm_in.bias"),
        attention_bias=meta.has_tensor("attn_q.bias"),
        mlp_bias=meta.has_tensor("ffn_up.bias") or meta.has_tensor("ffn_up_shexp.bias"),
        layer_norm_epsilon=eps,
        **extra,
    )
    config.architectures = ["NemotronHForCausalLM"]
    return config


def reorder_value_heads(w: np.ndarray, axis: int, outer: int, inner: int, dim: int) -> np.ndarray:
    """Split ``axis`` into [outer, inner, dim] and swap outer and inner. With (key heads,
    value heads per key head) it is the converter's grouped -> tiled reorder; with the
    two swapped, its inverse."""
    shape = w.shape
    split = shape[:axis] + (outer, inner, dim) + shape[axis + 1 :]
    return np.swapaxes(w.reshape(split), axis, axis + 1).reshape(shape)


class HybridTensors:
    """Undo llama.cpp's converter on one hybrid tensor (``to_hf``), given the file's
    metadata (the module docstring lists the transforms)."""

    def __init__(self, reader: Any, path: Any) -> None:
        import gguf

        meta = Metadata(reader, path)
        self.arch = meta.arch
        K = gguf.Keys
        self.k_heads = int(meta.need(K.SSM.GROUP_COUNT))
        self.v_heads = int(meta.need(K.SSM.TIME_STEP_RANK))
        self.inner = int(meta.need(K.SSM.INNER_SIZE))
        self.k_dim = int(meta.need(K.SSM.STATE_SIZE))

    def unit_offset(self, gguf_name: str) -> bool:
        """Whether the converter stored this norm as 1 + w."""
        return (
            self.arch.startswith("qwen")
            and gguf_name.endswith("norm.weight")
            and not gguf_name.endswith("ssm_norm.weight")
        )

    def to_hf(self, gguf_name: str, data: np.ndarray) -> np.ndarray:
        kind = gguf_name.split(".", 2)[2] if gguf_name.startswith("blk.") else gguf_name
        if kind == "ssm_a":
            data = np.log(-data.astype(np.float64)).astype(np.float32)
        if kind in ("ssm_a", "ssm_d"):
            data = data.reshape(-1)
        if kind == "ssm_conv1d.weight":
            data = data[:, None, :]  # [channels, 1, kernel]
        if kind == "ssm_norm.weight":
            data = data.reshape(-1)
        if self.arch in ("qwen35", "qwen35moe") and self.v_heads != self.k_heads:
            data = self._unreorder(kind, data)
        return data

    def qkvz(self, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Qwen3-Next's ``in_proj_qkvz`` from ``attn_qkv`` and ``attn_gate``: per key head
        its q, k, v and z rows."""
        key = self.k_heads * self.k_dim
        parts = (qkv[:key], qkv[key : 2 * key], qkv[2 * key :], z)
        per_head = [p.reshape(self.k_heads, -1, p.shape[-1]) for p in parts]
        return np.concatenate(per_head, axis=1).reshape(-1, qkv.shape[-1])

    def _unreorder(self, kind: str, data: np.ndarray) -> np.ndarray:
        per_k = self.v_heads // self.k_heads
        v_dim = self.inner // self.v_heads

        def rows(w: np.ndarray, dim: int, axis: int = 0) -> np.ndarray:
            return reorder_value_heads(w, axis, per_k, self.k_heads, dim)

        qk = 2 * self.k_heads * self.k_dim
        if kind in ("attn_qkv.weight", "ssm_conv1d.weight"):
            return np.concatenate([data[:qk], rows(data[qk:], v_dim)])
        if kind == "attn_gate.weight":
            return rows(data, v_dim)
        if kind in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
            return rows(data, 1)
        if kind == "ssm_out.weight":
            return rows(data, v_dim, axis=1)
        return data

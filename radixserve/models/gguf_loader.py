"""Read a GGUF checkpoint with the ``gguf`` package into transformers-named float32 tensors.

Quantized tensors are dequantized with ``gguf.dequantize``. llama.cpp's
converter stores the q/k projections of the ``llama`` architecture permuted
for its interleaved rotary; we undo that permutation (Q with ``num_heads``,
K with ``num_kv_heads``) so the weights match the HF rotate-half layout.

Gemma 2/3: the converter stores every RMSNorm weight as ``1 + w`` (transformers
subtracts the 1 again, so do we), and ``ffn_norm`` is the pre-feedforward norm.
transformers' GGUF config reader skips some Gemma settings llama.cpp does store:
``complete_config`` adds Gemma 2's soft-caps and Gemma 3's rope scaling from the
file's metadata.

Phi-3 (``phi3``): q/k/v and gate/up stay fused as in the HF checkpoint (``attn_qkv``,
``ffn_up`` holding gate then up); LongRoPE's factor lists are the tensors
``rope_factors_long`` / ``rope_factors_short``, which ``complete_config`` turns back into
the rope parameters (with the original context, the attention factor, the rotary
dimension and the sliding window, none of which transformers' reader takes).

Qwen3-MoE (``qwen3moe``): the router is ``ffn_gate_inp``; each layer's experts are one
stacked tensor per projection (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``,
[experts, out, in]), split here into transformers' per-expert names; a fused
``ffn_gate_up_exps`` (gate rows, then up rows) is split in two as well.
``complete_config`` adds the experts' width (``expert_feed_forward_length``).

Hybrids (``qwen35``, ``qwen35moe``, ``qwen3next``, ``nemotron_h``, ``nemotron_h_moe``):
transformers reads no config of these, so ``gguf_hybrid.hf_config`` builds it from the
metadata, and ``gguf_hybrid`` undoes the converter's tensor transforms (its docstring
lists them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from radixserve.models import gguf_hybrid
from radixserve.models.sharding import Piece

#: GGUF architectures we can map, and whether their q/k are stored permuted.
GGUF_ARCHITECTURES = {
    "llama": True,
    "qwen2": False,
    "qwen3": False,
    "gemma2": False,
    "gemma3": False,
    "phi3": False,
    "qwen3moe": False,
    "qwen35": False,
    "qwen35moe": False,
    "qwen3next": False,
    "nemotron_h": True,  # no rotary, yet the converter permutes q/k as for llama
    "nemotron_h_moe": True,
}
#: Architectures whose GGUF norm weights are stored as 1 + w.
_UNIT_OFFSET_NORMS = ("gemma2", "gemma3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
#: Gemma's sandwich norms: there ``ffn_norm`` is the norm before the MLP.
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
#: Phi-3 keeps q/k/v and gate/up fused: ``ffn_up`` is gate_up there.
_PHI3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
#: Qwen3-MoE: the router, and stacked experts (split per expert in ``read_gguf_weights``).
_MOE_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_gate_inp.weight": "mlp.gate.weight"}
#: Stacked expert tensor -> the per-expert projections it holds, in row order.
_STACKED_EXPERTS = {
    "ffn_gate_exps.weight": ("gate_proj",),
    "ffn_up_exps.weight": ("up_proj",),
    "ffn_down_exps.weight": ("down_proj",),
    "ffn_gate_up_exps.weight": ("gate_proj", "up_proj"),
}
#: Tensors that are config, not weights (read by ``complete_config``).
_ROPE_FACTORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}
_BLOCK_NAMES_BY_ARCH = {
    "phi3": _PHI3_BLOCK_NAMES,
    "qwen3moe": _MOE_BLOCK_NAMES,
    "qwen35": gguf_hybrid.QWEN35_BLOCK_NAMES,
    "qwen35moe": gguf_hybrid.QWEN35MOE_BLOCK_NAMES,
    "qwen3next": gguf_hybrid.QWEN3NEXT_BLOCK_NAMES,
    "nemotron_h": gguf_hybrid.NEMOTRON_H_BLOCK_NAMES,
    "nemotron_h_moe": gguf_hybrid.NEMOTRON_H_BLOCK_NAMES,
}
#: Architectures whose layers live under ``backbone.`` (Nemotron-H's checkpoint layout).
_BACKBONE = ("nemotron_h", "nemotron_h_moe")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


class _Source(NamedTuple):
    """Where one transformers tensor is in the file: the GGUF tensor (with a second one
    read together with it, Qwen3-Next's ``attn_gate``), the expert within a stacked
    tensor, and which of ``parts`` equal row blocks of it (fused gate and up)."""

    tensor: Any
    expert: int | None = None
    part: int = 0
    parts: int = 1
    partner: Any = None


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` string of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return str(reader.fields["general.architecture"].contents())


def _open_supported(path: str | Path) -> tuple[Any, str]:
    """The file's reader and architecture; ValueError for an architecture we do not map."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return reader, arch


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(weights, n_head)`` for q/k projection rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_weights(
    path: str | Path, num_heads: int, num_kv_heads: int
) -> dict[str, torch.Tensor]:
    """All tensors of a GGUF file as float32 torch tensors under transformers' names.

    Raises ValueError for an unsupported architecture or a tensor name we cannot map.
    """
    weights = GGUFWeights(path, num_heads, num_kv_heads)
    return {name: weights.read(Piece(name)) for name in weights.names()}


class GGUFWeights:
    """A GGUF file's tensors under transformers' names, each dequantized when it is read
    (a ``models.weights.WeightReader``): a tensor-parallel rank then keeps only its
    slice, so loading holds the shard plus the few tensors in flight, not the whole
    float32 model. The last few dequantized tensors are kept, because a stacked
    expert tensor is read once per expert.

    Raises ValueError for an unsupported architecture or a tensor name we cannot map.
    """

    CACHED = 3  # gate, up and down of a stacked-expert layer

    def __init__(self, path: str | Path, num_heads: int, num_kv_heads: int) -> None:

        reader, arch = _open_supported(path)
        self.permuted = GGUF_ARCHITECTURES[arch]
        self.unit_offset = arch in _UNIT_OFFSET_NORMS
        self.heads = {"q_proj.weight": num_heads, "k_proj.weight": num_kv_heads}
        self.hybrid = (
            gguf_hybrid.HybridTensors(reader, path)
            if arch in gguf_hybrid.HYBRID_GGUF_ARCHITECTURES
            else None
        )
        block_names = (
            _GEMMA_BLOCK_NAMES if self.unit_offset else _BLOCK_NAMES_BY_ARCH.get(arch, _BLOCK_NAMES)
        )
        backbone = arch in _BACKBONE
        global_names = gguf_hybrid.NEMOTRON_H_GLOBAL_NAMES if backbone else _GLOBAL_NAMES
        stacked, experts = (
            (gguf_hybrid.NEMOTRON_H_STACKED_EXPERTS, "backbone.layers.{}.mixer.experts.")
            if backbone
            else (_STACKED_EXPERTS, "model.layers.{}.mlp.experts.")
        )
        layers = self.hybrid and gguf_hybrid.decoder_layers(gguf_hybrid.Metadata(reader, path))
        partners = gguf_hybrid.QKVZ_PARTS if arch == "qwen3next" else {}
        by_name = {t.name: t for t in reader.tensors}
        self._index: dict[str, _Source] = {}
        for t in reader.tensors:
            if t.name in _ROPE_FACTORS:
                continue
            m = _BLOCK.match(t.name)
            if m and layers and int(m.group(1)) >= layers:
                continue  # multi-token-prediction blocks: not served
            if m and m.group(2) in partners.values():
                continue  # read with its partner
            if m and m.group(2) in stacked:
                prefix, projections = experts.format(m.group(1)), stacked[m.group(2)]
                for e in range(int(t.shape[-1])):  # ggml order: experts last
                    for i, proj in enumerate(projections):
                        source = _Source(t, e, i, len(projections))
                        self._index[f"{prefix}{e}.{proj}.weight"] = source
                continue
            partner = None
            if m and m.group(2) in partners:
                partner_name = f"blk.{m.group(1)}.{partners[m.group(2)]}"
                if partner_name not in by_name:
                    raise ValueError(f"GGUF {path} has {t.name!r} but no {partner_name!r}")
                partner = by_name[partner_name]
            name = _hf_name(t.name, block_names, global_names, backbone)
            self._index[name] = _Source(t, partner=partner)
        self._cache: dict[str, np.ndarray] = {}

    def names(self) -> Iterable[str]:
        return self._index.keys()

    def read(self, piece: Piece) -> torch.Tensor:
        source = self._index[piece.name]
        data = self._dequantized(source.tensor, piece.name)
        if source.partner is not None:
            assert self.hybrid is not None
            data = self.hybrid.qkvz(data, self._dequantized(source.partner, piece.name))
        if source.expert is not None:
            data = data[source.expert]  # [experts, out, in]
        if source.parts > 1:
            rows = data.shape[0] // source.parts
            data = data[source.part * rows : (source.part + 1) * rows]
        if piece.dim is not None:
            index = (slice(None),) * piece.dim + (slice(piece.start, piece.stop),)
            data = data[index]
        return torch.from_numpy(np.array(data, dtype=np.float32, order="C", copy=True))

    def _dequantized(self, t: Any, name: str) -> np.ndarray:
        """The whole tensor in float32 in transformers' layout (norm offsets removed,
        llama's q/k rows un-permuted)."""
        import gguf

        if t.name in self._cache:
            return self._cache[t.name]
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml order is reversed
        data = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if self.unit_offset and t.name.endswith("norm.weight"):
            data = data - 1.0
        if self.hybrid is not None:
            if self.hybrid.unit_offset(t.name):
                data = data - 1.0
            data = self.hybrid.to_hf(t.name, data)
        for suffix, n_heads in self.heads.items():
            if self.permuted and name.endswith(suffix):
                data = unpermute_rotary(data, n_heads)
        if len(self._cache) >= self.CACHED:
            del self._cache[next(iter(self._cache))]
        self._cache[t.name] = data
        return data


def own_config(path: str | Path) -> Any:
    """The transformers config of a GGUF file whose architecture transformers cannot read
    (the hybrids, ``gguf_hybrid.hf_config``), else None. An architecture whose tensors
    we cannot map is refused here, before transformers reads its config."""

    reader, arch = _open_supported(path)
    if arch not in gguf_hybrid.HYBRID_GGUF_ARCHITECTURES:
        return None
    return gguf_hybrid.hf_config(reader, path)


def complete_config(hf_config: Any, path: str | Path) -> Any:
    """Add to transformers' config of a GGUF file what its reader leaves out and the file
    holds: Gemma 2's attention and final logit soft-caps, Gemma 3's rope scaling (linear,
    x8 on the larger models) of the global layers; Phi-3's original context, sliding
    window, rotary dimension and LongRoPE factors; Qwen3-MoE's expert width. Others are
    returned unchanged."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())

    def value(key: str) -> Any:
        field = reader.fields.get(key.format(arch=arch))
        return None if field is None else field.contents()

    if arch == "gemma2":
        for key, attr in ((gguf.Keys.LLM.ATTN_LOGIT_SOFTCAPPING, "attn_logit_softcapping"),
                          (gguf.Keys.LLM.FINAL_LOGIT_SOFTCAPPING, "final_logit_softcapping")):  # fmt: skip
            if value(key) is not None:
                setattr(hf_config, attr, float(value(key)))
    if arch == "llama" and value(gguf.Keys.LLM.EXPERT_COUNT):
        raise ValueError(
            f"{path} is a Mixtral GGUF (architecture 'llama' with experts): transformers "
            "reads its config as a dense Llama, so it is not supported; use the HF folder"
        )
    if arch == "phi3":
        _complete_phi3(hf_config, reader, value)
    if arch == "qwen3moe" and value(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH) is not None:
        hf_config.moe_intermediate_size = int(value(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH))
    if arch == "qwen3moe" and value(gguf.Keys.LLM.EXPERT_WEIGHTS_NORM) is not None:
        hf_config.norm_topk_prob = bool(value(gguf.Keys.LLM.EXPERT_WEIGHTS_NORM))
    kind = value(gguf.Keys.Rope.SCALING_TYPE)
    if arch == "gemma3" and kind not in (None, "none"):
        scaling = {"rope_type": str(kind), "factor": float(value(gguf.Keys.Rope.SCALING_FACTOR))}
        params = getattr(hf_config, "rope_parameters", None)
        if isinstance(params, dict) and "full_attention" in params:
            params["full_attention"].update(scaling)
        else:
            hf_config.rope_scaling = scaling
    return hf_config


def _complete_phi3(hf_config: Any, reader: Any, value: Any) -> None:
    """What llama.cpp's Phi-3 converter stores and transformers' reader skips."""
    import gguf

    window = value(gguf.Keys.Attention.SLIDING_WINDOW)
    if window is not None:  # 0: none (Phi-4)
        hf_config.sliding_window = int(window) or None
    original = value(gguf.Keys.Rope.SCALING_ORIG_CTX_LEN)
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    rope_dims = value(gguf.Keys.Rope.DIMENSION_COUNT)
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", float(getattr(hf_config, "rope_theta", 10000.0)))
    if rope_dims is not None and int(rope_dims) != head_dim:
        params["partial_rotary_factor"] = int(rope_dims) / head_dim
        hf_config.partial_rotary_factor = int(rope_dims) / head_dim
    if original is not None:
        hf_config.original_max_position_embeddings = int(original)
        params["original_max_position_embeddings"] = int(original)
    factors = {
        _ROPE_FACTORS[t.name]: [float(x) for x in np.asarray(t.data, dtype=np.float32)]
        for t in reader.tensors
        if t.name in _ROPE_FACTORS
    }
    if factors:
        params.update(rope_type="longrope", **factors)
        attention = value(gguf.Keys.Rope.SCALING_ATTN_FACTOR)
        if attention is not None:
            params["attention_factor"] = float(attention)
    hf_config.rope_parameters = params


def _hf_name(
    name: str,
    block_names: dict[str, str],
    global_names: dict[str, str] = _GLOBAL_NAMES,
    backbone: bool = False,
) -> str:
    if name in global_names:
        return global_names[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in block_names:
        prefix = "backbone" if backbone else "model"
        return f"{prefix}.layers.{m.group(1)}.{block_names[m.group(2)]}"
    raise ValueError(f"GGUF tensor {name!r} has no known transformers name")

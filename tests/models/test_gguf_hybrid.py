"""Qwen3.5 (``qwen35``), Qwen3.5-MoE (``qwen35moe``), Qwen3-Next (``qwen3next``) and
Nemotron-H (``nemotron_h`` / ``nemotron_h_moe``) GGUF files,
written as llama.cpp's converter writes them, load the same config and weights as the
safetensors folder they came from and decode the same greedy tokens; what a GGUF cannot
say is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from radixserve.models.gguf_hybrid import reorder_value_heads
from radixserve.models.loader import load_model, read_safetensors_folder
from radixserve.models.source import resolve_model
from tests.helpers.tiny_models import make_tiny_model, tiny_config
from tests.models.test_gguf_families import _finish, _floats, greedy

#: Not carried the same way by a GGUF: the architectures list is ours; Nemotron-H's
#: context length is written as 2**20 (no rotary), and with it the rope bound.
_NOT_COMPARED = ("architecture",)
_NEMOTRON_H_NOT_COMPARED = ("max_context_len", "rope_original_max_positions")


def _common(writer, hf_config, n_blocks):
    writer.add_block_count(n_blocks)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_key_length(hf_config.head_dim)
    writer.add_value_length(hf_config.head_dim)
    writer.add_bos_token_id(hf_config.bos_token_id)
    writer.add_eos_token_id(hf_config.eos_token_id)


def _collect_expert(experts, layer, expert, projection, w):
    """Hold one expert's projection until its layer's stacked tensor is written."""
    experts.setdefault((layer, projection), []).append((int(expert), w.numpy()))


def _write_experts(writer, names, experts, fuse_gate_up=False):
    """Each layer's experts stacked per projection ([experts, out, in]), as the
    converter's ``Qwen2MoeModel`` / ``NemotronHModel``; with ``fuse_gate_up`` gate and up
    as one ``ffn_gate_up_exps`` (gate rows, then up rows), as ``--fuse-gate-up-exps``."""
    import gguf

    stacked = {
        key: np.stack([w for _, w in sorted(per_expert, key=lambda x: x[0])])
        for key, per_expert in experts.items()
    }
    for (layer, projection), w in stacked.items():
        if fuse_gate_up and projection in ("gate_proj", "up_proj"):
            if projection == "gate_proj":
                name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP].format(bid=layer)
                up = stacked[(layer, "up_proj")]
                writer.add_tensor(name + ".weight", np.concatenate([w, up], axis=1))
            continue
        key = f"model.layers.{layer}.mlp.experts.{projection}"
        writer.add_tensor(names.get_name(key) + ".weight", w)


def write_qwen_hybrid_gguf(path, folder, hf_config, arch="qwen35", interval=4, **options):
    """As llama.cpp's ``Qwen3_5TextModel`` (``qwen35``), ``Qwen3_5MoeTextModel``
    (``qwen35moe``) and ``Qwen3NextModel`` (``qwen3next``): the delta-net shape as ``ssm.*``
    keys, the layer pattern as ``full_attention_interval``, a quarter-head rotary; A_log as
    -exp(A_log), conv1d squeezed, every norm but the delta-net's as 1 + w.

    qwen35 / qwen35moe: value heads reordered grouped -> tiled, mrope sections, and (as
    released checkpoints carry one multi-token-prediction block, which the converter
    appends after the decoder's, ``nextn_predict_layers``) a stand-in for it.
    qwen35moe / qwen3next: the ``expert_*`` keys, experts stacked (``fuse_gate_up``: as one
    gate-up tensor), the shared expert and its gate. qwen3next: no reorder and no
    multi-token-prediction block; ``in_proj_qkvz`` split into ``attn_qkv`` and
    ``attn_gate`` (``ssm_in=True``: kept whole as ``ssm_in``, as older converters did),
    ``in_proj_ba`` kept as ``ssm_ba``."""
    import gguf

    c = hf_config
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    next_ = arch == "qwen3next"
    writer = gguf.GGUFWriter(str(path), arch)
    _common(writer, c, c.num_hidden_layers + (0 if next_ else 1))
    if not next_:
        writer.add_nextn_predict_layers(1)
        mtp = f"blk.{c.num_hidden_layers}."
        writer.add_tensor(mtp + "nextn.eh_proj.weight", np.ones((64, 128), dtype=np.float32))
        writer.add_tensor(mtp + "attn_norm.weight", np.ones(64, dtype=np.float32))
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    if getattr(c, "intermediate_size", None) is not None:  # Qwen3.5-MoE's config: none
        writer.add_feed_forward_length(c.intermediate_size)
    if arch != "qwen35":
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers + 1)
    k, per_k = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    qk, v_dim = 2 * k * c.linear_key_head_dim, c.linear_value_head_dim
    experts: dict = {}
    for name, t in read_safetensors_folder(folder).items():
        w = t.clone()
        tiled = lambda x, dim, axis=0: torch.from_numpy(  # noqa: E731
            reorder_value_heads(x.numpy(), axis, k, per_k, dim)
        )
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.P.weight
            parts = name.split(".")
            _collect_expert(experts, parts[2], parts[5], parts[6], w)
            continue
        if per_k > 1 and not next_ and "linear_attn." in name:  # grouped -> tiled
            if "in_proj_qkv" in name:
                w = torch.cat([w[:qk], tiled(w[qk:], v_dim)])
            elif "in_proj_z" in name:
                w = tiled(w, v_dim)
            elif "in_proj_a" in name or "in_proj_b" in name or "A_log" in name or "dt_bias" in name:
                w = tiled(w, 1)
            elif "conv1d" in name:
                w = w.squeeze()
                w = torch.cat([w[:qk], tiled(w[qk:], v_dim)])
            elif "out_proj" in name:
                w = tiled(w, v_dim, axis=1)
        if name.endswith(".A_log"):
            w = -torch.exp(w)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            w = w.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1
        if "in_proj_qkvz" in name and not options.get("ssm_in"):
            # per key head [q, k, v, z] -> q, k, v of every head, then z
            k_dim, vz = c.linear_key_head_dim, per_k * v_dim
            q_, k_, v_, z_ = w.reshape(k, -1, w.shape[-1]).split([k_dim, k_dim, vz, vz], dim=1)
            qkv = torch.cat([x.reshape(-1, w.shape[-1]) for x in (q_, k_, v_)])
            layer = name.split(".")[2]
            writer.add_tensor(f"blk.{layer}.attn_qkv.weight", qkv.numpy())
            writer.add_tensor(f"blk.{layer}.attn_gate.weight", z_.reshape(-1, w.shape[-1]).numpy())
            continue
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(new, w.numpy())
    _write_experts(writer, names, experts, options.get("fuse_gate_up", False))
    return _finish(writer, path)


def write_nemotron_h_gguf(path, folder, hf_config):
    """As llama.cpp's ``NemotronHModel``: ``nemotron_h_moe`` when the config has experts.
    Per-layer ``head_count_kv`` and ``feed_forward_length`` (zero on Mamba layers),
    context 2**20, the Mamba-2 shape as ``ssm.*`` keys; A_log as -exp(A_log) and D as
    [heads, 1], the gated norm as [groups, inner / groups], conv1d squeezed, q/k rows
    permuted as for llama's rotary, experts stacked."""
    import gguf

    c = hf_config
    types = list(c.layers_block_type)
    moe = "moe" in types
    arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE if moe else gguf.MODEL_ARCH.NEMOTRON_H
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _common(writer, c, c.num_hidden_layers)
    writer.add_context_length(2**20)
    writer.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    writer.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0 for t in types])
    width = c.moe_intermediate_size if moe else c.intermediate_size
    writer.add_feed_forward_length([width if t in ("mlp", "moe") else 0 for t in types])
    writer.add_ssm_conv_kernel(c.conv_kernel)
    writer.add_ssm_state_size(c.ssm_state_size)
    writer.add_ssm_group_count(c.n_groups)
    inner = c.mamba_num_heads * c.mamba_head_dim
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(c.mamba_num_heads)
    writer.add_rope_scaling_finetuned(False)
    if moe:
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(c.moe_shared_expert_intermediate_size)
        writer.add_expert_count(c.n_routed_experts)
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_weights_norm(c.norm_topk_prob)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    experts: dict = {}
    for name, t in read_safetensors_folder(folder).items():
        w = t.clone()
        if ".experts." in name and ".shared_experts." not in name:
            parts = name.split(".")  # backbone.layers.L.mixer.experts.E.W.weight
            _collect_expert(experts, parts[2], parts[5], parts[6], w)
            continue
        if name.endswith(".A_log"):
            w = (-torch.exp(w)).reshape(-1, 1)
        elif name.endswith(".D"):
            w = w.reshape(-1, 1)
        elif name.endswith("mixer.norm.weight"):
            w = w.reshape(c.n_groups, inner // c.n_groups)
        elif "conv1d.weight" in name:
            w = w.squeeze()
        elif name.endswith("q_proj.weight") or name.endswith("k_proj.weight"):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            w = w.swapaxes(1, 2).reshape(t.shape)
        name = name.replace("dt_bias", "dt_proj.bias").replace(
            "e_score_correction_bias", "e_score_correction.bias"
        )
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), w.numpy())
    _write_experts(writer, names, experts)
    return _finish(writer, path)


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested config dicts (``mamba``, ``moe``, ``linear``) as dotted keys."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


def _check_like_safetensors(path, folder, not_compared=()):
    ours, _ = load_model(resolve_model(str(path)), torch.float32)
    ref, _ = load_model(resolve_model(str(folder)), torch.float32)
    got, want = _flat(dataclasses.asdict(ours.cfg)), _flat(dataclasses.asdict(ref.cfg))
    for field in _NOT_COMPARED + tuple(not_compared):
        got.pop(field), want.pop(field)
    assert {k: v for k, v in got.items() if not _floats(v)} == {
        k: v for k, v in want.items() if not _floats(v)
    }
    for k, v in want.items():
        if _floats(v):
            np.testing.assert_allclose(got[k], v, rtol=1e-7, err_msg=k)
    theirs = dict(ref.named_parameters())
    assert sorted(theirs) == sorted(dict(ours.named_parameters()))
    for n, p in ours.named_parameters():
        if n.endswith("A_log"):  # log(-(-exp(A_log))): float32 rounding of exp
            torch.testing.assert_close(p, theirs[n], rtol=1e-6, atol=1e-7)
        elif ours.cfg.norm_unit_offset and "norm" in n and "linear_attn" not in n:
            # 1 + w and back again in float32: one rounding of w's low bits.
            torch.testing.assert_close(p, theirs[n], rtol=0, atol=1e-6)
        else:
            assert torch.equal(p, theirs[n]), n
    prompt = np.random.default_rng(3).integers(4, 500, 40).tolist()
    assert greedy(str(path), prompt, 16) == greedy(str(folder), prompt, 16)
    return ours.cfg


def test_qwen35_gguf_loads_like_safetensors(tmp_path):
    """Three delta-net layers, then full attention (``full_attention_interval`` 4); two
    key heads serving four value heads, so the converter's value-head reorder is undone."""
    folder = make_tiny_model(tmp_path / "hf", "qwen3_5", seed=21, dtype=torch.float32)
    path = write_qwen_hybrid_gguf(tmp_path / "tiny-qwen35.gguf", folder, tiny_config("qwen3_5"))
    cfg = _check_like_safetensors(path, folder)
    assert cfg.family == "qwen3_5" and cfg.rotary_dim == 4 and cfg.norm_unit_offset
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)


@pytest.mark.parametrize("pattern", ["M-M*-M", "MEM*EM"])
def test_nemotron_h_gguf_loads_like_safetensors(tmp_path, pattern):
    """Dense (``nemotron_h``: Mamba-2, MLP, attention) and MoE (``nemotron_h_moe``) files;
    the layer types come back from the per-layer kv-head and feed-forward arrays. An MoE
    file stores no dense MLP width, so that model's ``intermediate_size`` is its experts'."""
    overrides = dict(hybrid_override_pattern=pattern)
    if "E" in pattern:
        overrides["intermediate_size"] = 32
    folder = make_tiny_model(tmp_path / "hf", "nemotron_h", seed=22, dtype=torch.float32,
                             **overrides)  # fmt: skip
    hf_config = tiny_config("nemotron_h", **overrides)
    path = write_nemotron_h_gguf(tmp_path / "tiny-nemotron-h.gguf", folder, hf_config)
    cfg = _check_like_safetensors(path, folder, _NEMOTRON_H_NOT_COMPARED)
    assert cfg.family == "nemotron_h" and cfg.max_context_len == 2**20
    assert (cfg.moe is not None) == ("E" in pattern)


def test_hybrid_gguf_missing_key_is_named(tmp_path):
    """A qwen35 file without ``full_attention_interval`` cannot say which layers attend:
    refused, naming the key."""
    import gguf

    hf_config = tiny_config("qwen3_5")
    path = tmp_path / "no-interval.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    _common(writer, hf_config, 4)
    writer.add_feed_forward_length(128)
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float32))
    _finish(writer, path)
    with pytest.raises(ValueError, match="qwen35.full_attention_interval"):
        load_model(resolve_model(str(path)), torch.float32)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_qwen_moe_gguf_layer_without_router_is_refused(tmp_path, arch):
    """Both families are sparse on every layer in a GGUF (llama.cpp has no dense-MLP
    tensors for them): a layer without ``ffn_gate_inp`` is refused, naming it."""
    import gguf

    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    _common(writer, tiny_config("qwen3_5"), 4)
    writer.add_head_count_kv(2)
    writer.add_full_attention_interval(4)
    for key, value in ((gguf.Keys.SSM.TIME_STEP_RANK, 4), (gguf.Keys.SSM.INNER_SIZE, 32)):
        writer.add_uint32(key.format(arch=arch), value)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_expert_feed_forward_length(32)
    writer.add_expert_shared_feed_forward_length(48)
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float32))
    for layer in (0, 1, 3):
        writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", np.zeros((8, 64), np.float32))
    _finish(writer, path)
    with pytest.raises(ValueError, match=rf"{arch} layers \[2\] have no router"):
        load_model(resolve_model(str(path)), torch.float32)


def test_hybrid_gguf_tokenizer(tmp_path):
    """transformers' ``AutoTokenizer`` reads a GGUF's config first and knows none of the
    hybrids; ``load_tokenizer`` converts such a file's byte-level BPE vocabulary directly."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    from radixserve.models.tokenizer import load_tokenizer

    tokens = sorted(ByteLevel.alphabet()) + ["Ġh", "<|endoftext|>"]
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen35")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(["Ġ h"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    _finish(writer, path)
    tok = load_tokenizer(str(path))
    ids = tok(" hi")["input_ids"]
    assert ids == [tokens.index("Ġh"), tokens.index("i")] and tok.decode(ids) == " hi"
    assert tok.eos_token == "<|endoftext|>"


def test_qwen35moe_gguf_loads_like_safetensors(tmp_path):
    """Qwen3.5's layers (value-head reorder undone) with a sparse MLP on every layer; the
    experts written as one fused gate-up tensor per layer, split back per expert."""
    folder = make_tiny_model(tmp_path / "hf", "qwen3_5_moe", seed=23, dtype=torch.float32)
    path = write_qwen_hybrid_gguf(tmp_path / "tiny-qwen35moe.gguf", folder,
                                  tiny_config("qwen3_5_moe"), "qwen35moe", fuse_gate_up=True)  # fmt: skip
    cfg = _check_like_safetensors(path, folder)
    assert cfg.family == "qwen3_5_moe" and cfg.moe.sparse_layers == (True,) * 4


@pytest.mark.parametrize("ssm_in", [False, True])
def test_qwen3next_gguf_loads_like_safetensors(tmp_path, ssm_in):
    """``in_proj_qkvz`` split into ``attn_qkv`` and ``attn_gate`` (or kept as ``ssm_in``)
    comes back interleaved per key head; no ``expert_weights_norm``: renormalised. Every
    layer sparse: the converter has no tensor names for a dense layer of this family."""
    folder = make_tiny_model(tmp_path / "hf", "qwen3_next", seed=24, dtype=torch.float32,
                             mlp_only_layers=[])  # fmt: skip
    hf_config = tiny_config("qwen3_next", mlp_only_layers=[])
    path = write_qwen_hybrid_gguf(tmp_path / "tiny-qwen3next.gguf", folder, hf_config,
                                  "qwen3next", ssm_in=ssm_in)  # fmt: skip
    cfg = _check_like_safetensors(path, folder)
    assert cfg.family == "qwen3_next" and cfg.moe.sparse_layers == (True,) * 4

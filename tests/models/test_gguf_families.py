"""Phi-3 and Qwen3-MoE GGUF files, written as llama.cpp's converter writes them, load the
same config and weights as the safetensors folder they came from and decode the same
greedy tokens; a Mixtral GGUF (``llama`` with experts) is refused by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from radixserve.models.loader import load_model, read_safetensors_folder
from radixserve.models.source import resolve_model
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import make_tiny_model, tiny_config

#: ModelConfig fields a GGUF cannot carry the same way (the file holds no architectures
#: list, transformers' reader names the model type, not the class).
_NOT_COMPARED = ("architecture",)


def _writer(path, arch: str, hf_config):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_vocab_size(hf_config.vocab_size)
    writer.add_bos_token_id(hf_config.bos_token_id)
    writer.add_eos_token_id(hf_config.eos_token_id)
    return writer


def _finish(writer, path):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_phi3_gguf(path, folder, hf_config):
    """As llama.cpp's ``Phi3MiniModel``: q/k/v and gate/up kept fused (``attn_qkv``,
    ``ffn_up``), the rotary dimension, original context, sliding window (0 = none) and,
    for LongRoPE, the attention factor and the factor lists as ``rope_factors_*`` tensors."""
    import gguf

    rope = hf_config.rope_parameters
    n_embd, n_head = hf_config.hidden_size, hf_config.num_attention_heads
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head
    writer = _writer(path, "phi3", hf_config)
    writer.add_rope_scaling_orig_ctx_len(hf_config.original_max_position_embeddings)
    writer.add_rope_dimension_count(rope_dims)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(hf_config.sliding_window or 0)
    scale = hf_config.max_position_embeddings / hf_config.original_max_position_embeddings
    orig = hf_config.original_max_position_embeddings
    writer.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(orig)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, hf_config.num_hidden_layers)
    for name, t in read_safetensors_folder(folder).items():
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", t.numpy())
    for kind in ("long", "short"):
        factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
        writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    return _finish(writer, path)


def write_qwen3moe_gguf(path, folder, hf_config):
    """As llama.cpp's ``Qwen3MoeModel``: head and expert widths, expert counts, the router
    as ``ffn_gate_inp`` and each projection's experts stacked into one [E, out, in] tensor."""
    import gguf

    writer = _writer(path, "qwen3moe", hf_config)
    writer.add_key_length(hf_config.head_dim)
    writer.add_value_length(hf_config.head_dim)
    writer.add_rope_freq_base(hf_config.rope_parameters["rope_theta"])
    writer.add_expert_count(hf_config.num_experts)
    writer.add_expert_used_count(hf_config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(hf_config.moe_intermediate_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, hf_config.num_hidden_layers)
    experts: dict[str, list[np.ndarray]] = {}
    for name, t in read_safetensors_folder(folder).items():
        parts = name.split(".")
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.W.weight
            key = ".".join(parts[:5] + parts[6:7])  # model.layers.L.mlp.experts.W
            experts.setdefault(key, []).append((int(parts[5]), t.numpy()))
            continue
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", t.numpy())
    for key, per_expert in experts.items():
        stacked = np.stack([w for _, w in sorted(per_expert, key=lambda x: x[0])])
        writer.add_tensor(names.get_name(key) + ".weight", stacked)
    return _finish(writer, path)


def greedy(model: str, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` from a ModelRunner on ``model``."""
    # Steps built by hand carry no window pages: one pool.
    runner = build_runner(
        WorkerConfig(model=model, dtype="float32", num_pages=16, page_size=16, sliding_pool_pages=0)
    )
    pages = np.arange(16, dtype=np.int32)
    tok = runner.step(Step([StepReq(0, np.array(prompt, dtype=np.int32), 0, pages, True,
                                    SamplingParams(temperature=0))])).tokens  # fmt: skip
    out = [int(tok[0])]
    for i in range(n - 1):
        req = StepReq(0, tok[:1].astype(np.int32), len(prompt) + i, pages[:0], True)
        tok = runner.step(Step([req])).tokens
        out.append(int(tok[0]))
    return out


def _floats(v) -> bool:
    return isinstance(v, float) or (isinstance(v, tuple) and any(isinstance(x, float) for x in v))


def _check_like_safetensors(path, folder):
    ours, _ = load_model(resolve_model(str(path)), torch.float32)
    ref, _ = load_model(resolve_model(str(folder)), torch.float32)
    got, want = dataclasses.asdict(ours.cfg), dataclasses.asdict(ref.cfg)
    for field in _NOT_COMPARED:
        got.pop(field), want.pop(field)
    # GGUF stores float metadata (eps, rope factors, attention factor) as float32.
    assert {k: v for k, v in got.items() if not _floats(v)} == {
        k: v for k, v in want.items() if not _floats(v)
    }
    for k, v in want.items():
        if _floats(v):
            np.testing.assert_allclose(got[k], v, rtol=1e-7, err_msg=k)
    theirs = dict(ref.named_parameters())
    assert sorted(theirs) == sorted(dict(ours.named_parameters()))
    assert all(torch.equal(p, theirs[n]) for n, p in ours.named_parameters())
    prompt = np.random.default_rng(3).integers(4, 500, 40).tolist()
    assert greedy(str(path), prompt, 16) == greedy(str(folder), prompt, 16)
    return ours.cfg


def test_phi3_gguf_loads_like_safetensors(tmp_path):
    """LongRoPE (factor 2), half the head rotated, a sliding window of 32: all come back
    from the GGUF's metadata and rope-factor tensors; q/k/v and gate/up stay fused."""
    overrides = dict(sliding_window=32)
    folder = make_tiny_model(tmp_path / "hf", "phi3", seed=11, dtype=torch.float32, **overrides)
    path = write_phi3_gguf(tmp_path / "tiny-phi3.gguf", folder, tiny_config("phi3", **overrides))
    cfg = _check_like_safetensors(path, folder)
    assert cfg.family == "phi3" and cfg.rope_type == "longrope" and cfg.rotary_dim == 8
    assert cfg.sliding_windows == (32, 32) and cfg.rope_original_max_positions == 512


def test_qwen3moe_gguf_loads_like_safetensors(tmp_path):
    """Every layer sparse (llama.cpp's qwen3moe has no dense layers), the expert width
    from ``expert_feed_forward_length``, ``norm_topk_prob`` as transformers' GGUF default."""
    overrides = dict(mlp_only_layers=[], norm_topk_prob=True)
    folder = make_tiny_model(tmp_path / "hf", "qwen3_moe", seed=12, dtype=torch.float32,
                             **overrides)  # fmt: skip
    hf_config = tiny_config("qwen3_moe", **overrides)
    path = write_qwen3moe_gguf(tmp_path / "tiny-qwen3moe.gguf", folder, hf_config)
    cfg = _check_like_safetensors(path, folder)
    assert cfg.family == "qwen3_moe" and cfg.moe.intermediate_size == 32 and cfg.qk_norm


def test_mixtral_gguf_is_refused(tmp_path):
    """llama.cpp stores Mixtral as ``llama`` with expert tensors; transformers reads that
    as a dense Llama config, so we refuse it with the reason instead of failing on a name."""
    import gguf

    hf_config = tiny_config("llama")
    path = tmp_path / "tiny-mixtral.gguf"
    writer = _writer(path, "llama", hf_config)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((512, 64), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 128, 64), dtype=np.float32))
    _finish(writer, path)
    assert gguf.GGUFReader(str(path)).fields["llama.expert_count"].contents() == 4
    with pytest.raises(ValueError, match="Mixtral"):
        load_model(resolve_model(str(path)), torch.float32)

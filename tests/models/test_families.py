"""Qwen3, Mixtral, Qwen3-MoE, Phi-3, Gemma 2 and Gemma 3 end to end: the Engine (scheduler, radix cache,
chunked prefill) against transformers' greedy tokens, Phi-3's long rotary factors,
config parsing, and loading each family from a saved (sharded) HF folder.

Logits to 1e-9 for whole, chunked and cached-prefix prompts are in test_tiny_vs_hf.py
(parametrized over every family); MoE routing in test_moe.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.models.config import ModelConfig
from radixserve.models.loader import load_model, read_safetensors_folder
from radixserve.models.rope import RotaryEmbedding, inv_frequencies
from radixserve.models.source import resolve_model
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import (
    NEW_FAMILIES,
    hf_cached_greedy,
    make_tiny_model,
    patch_hf_float64,
    tiny_config,
)

GEN = 64


def load_hf(folder):
    from transformers import AutoModelForCausalLM

    return patch_hf_float64(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    )


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_engine_greedy_equals_hf(tiny_family_dir, family):
    """Two prompts sharing a 40-token prefix through the Engine, prefill in 16-token chunks,
    page sizes 1 and 16; the second round hits the radix cache for whole prompts."""
    folder = tiny_family_dir(family)
    hf = load_hf(folder)
    rng = np.random.default_rng(1)
    shared = rng.integers(4, 512, 40).tolist()
    prompts = [
        shared + rng.integers(4, 512, 7).tolist(),
        shared + rng.integers(4, 512, 19).tolist(),
    ]
    want = [hf_cached_greedy(hf, p, GEN) for p in prompts]
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    for page_size, rounds in ((1, 1), (16, 2)):
        eng = Engine(str(folder), dtype="float64", num_pages=2048 // page_size, page_size=page_size,
                     chunked_prefill_size=16)  # fmt: skip
        for _ in range(rounds):
            assert [r.token_ids for r in eng.generate(prompts, sp)] == want
            eng.check_idle()
        assert eng.stats()["hit_tokens"] >= 32


def test_phi3_long_factors_past_the_original_context(tmp_path):
    """Original context 48: a 40-token prompt (short factors) decoded to position 72 must
    follow transformers' cached generation, which switches to the long factors (and keeps
    the keys already cached) once a step's position reaches 48."""
    folder = make_tiny_model(tmp_path / "phi3", "phi3", seed=3, original_max_position_embeddings=48)
    cfg = ModelConfig.from_hf(tiny_config("phi3", original_max_position_embeddings=48))
    assert cfg.rope_original_max_positions == 48 and cfg.rope_attention_factor > 1.3
    prompt = np.random.default_rng(2).integers(4, 512, 40).tolist()
    want = hf_cached_greedy(load_hf(folder), prompt, 32)
    eng = Engine(str(folder), dtype="float64", num_pages=256, page_size=16)
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    [r] = eng.generate([prompt], sp)
    assert r.token_ids == want
    # The table really switches: position 48 is rotated by the long factors.
    rot = RotaryEmbedding(cfg, torch.float64, torch.device("cpu"))
    cos, _ = rot.cos_sin(torch.tensor([47, 48]), 48)
    half = cfg.rotary_dim // 2
    for pos, long in ((47, False), (48, True)):
        angle = pos * inv_frequencies(cfg, long=long)
        want_cos = torch.cos(angle) * cfg.rope_attention_factor
        torch.testing.assert_close(cos[pos - 47, 0, :half], want_cos, rtol=1e-14, atol=1e-14)


def test_longrope_and_partial_rotary_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_config("phi3")
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.rotary_dim, cfg.head_dim) == (8, 16)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    short, attention = init(hf)
    long, _ = init(hf, seq_len=hf.rope_parameters["original_max_position_embeddings"] + 1)
    torch.testing.assert_close(inv_frequencies(cfg).float(), short, rtol=1e-6, atol=0)
    torch.testing.assert_close(inv_frequencies(cfg, long=True).float(), long, rtol=1e-6, atol=0)
    assert cfg.rope_attention_factor == pytest.approx(attention, rel=1e-12)
    assert not torch.allclose(short, long)


def test_moe_layers_follow_sparse_step_and_mlp_only_layers():
    hf = tiny_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    moe = ModelConfig.from_hf(hf).moe
    assert moe is not None and moe.sparse_layers == (False, True, False, False, False, True)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (8, 2, 32, False)
    mixtral = ModelConfig.from_hf(tiny_config("mixtral")).moe
    assert mixtral is not None and mixtral.renormalize and mixtral.sparse_layers == (True, True)
    assert ModelConfig.from_hf(tiny_config("qwen3")).qk_norm
    assert ModelConfig.from_hf(tiny_config("qwen3")).moe is None


def test_sliding_windows_per_family():
    assert ModelConfig.from_hf(tiny_config("mixtral", sliding_window=8)).sliding_windows == (8, 8)
    assert ModelConfig.from_hf(tiny_config("phi3", sliding_window=8)).sliding_windows == (8, 8)
    qwen3 = tiny_config("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert ModelConfig.from_hf(qwen3).sliding_windows == (-1, 8)
    off = tiny_config("qwen3_moe", sliding_window=8)  # use_sliding_window False: no window
    assert ModelConfig.from_hf(off).sliding_windows == (-1, -1)


#: A tensor each family's checkpoint has and the others do not.
FAMILY_TENSOR = {
    "qwen3": "model.layers.1.self_attn.k_norm.weight",
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.7.down_proj.weight",
    "phi3": "model.layers.1.mlp.gate_up_proj.weight",
    "gemma2": "model.layers.1.post_feedforward_layernorm.weight",
    "gemma3": "model.layers.2.self_attn.q_norm.weight",
}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_loads_from_sharded_hf_folder(tmp_path, tiny_family_dir, family):
    """transformers' own sharded save loads into the same weights as the single file, and a
    family-specific tensor missing from the checkpoint is named."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tiny_family_dir(family)
    sharded = tmp_path / "sharded"
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    hf.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    one, _ = load_model(resolve_model(str(folder)), torch.float64)
    many, _ = load_model(resolve_model(str(sharded)), torch.float64)
    theirs = dict(many.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in one.named_parameters())

    weights = read_safetensors_folder(folder)
    assert FAMILY_TENSOR[family] in weights
    del weights[FAMILY_TENSOR[family]]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((folder / "config.json").read_bytes())
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(KeyError, match=FAMILY_TENSOR[family].replace(".", r"\.")):
        build_runner(WorkerConfig(model=str(broken), dtype="float64", num_pages=8))


#: Our names -> GGUF names (llama.cpp's converter for qwen3, which stores q/k unpermuted).
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip


def test_qwen3_gguf_loads_like_safetensors(tmp_path):
    """A qwen3 GGUF (float32 tensors) written with gguf's writer: transformers reads its
    config, our loader maps its tensors (q/k norms included) to the same weights as the
    safetensors folder. transformers' qwen3 GGUF mapping has no key_length, so it assumes
    Qwen3Config's default head_dim (128): the tiny model uses that."""
    import gguf

    folder = make_tiny_model(tmp_path / "hf", "qwen3", seed=5, head_dim=128, dtype=torch.float32)
    path = tmp_path / "tiny-qwen3.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(1024)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_embedding_length(64)
    writer.add_rope_freq_base(10000.0)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(512)
    for name, t in read_safetensors_folder(folder).items():
        if name not in _GGUF_GLOBAL:
            layer, rest = name.split(".")[2], ".".join(name.split(".")[3:-1])
            writer.add_tensor(f"blk.{layer}.{_GGUF_BLOCK[rest]}.weight", t.numpy())
        else:
            writer.add_tensor(_GGUF_GLOBAL[name], t.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, hf_config = load_model(resolve_model(str(path)), torch.float32)
    assert hf_config.model_type == "qwen3" and ours.cfg.qk_norm
    ref, _ = load_model(resolve_model(str(folder)), torch.float32)
    theirs = dict(ref.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in ours.named_parameters())

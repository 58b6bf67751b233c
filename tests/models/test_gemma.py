"""Gemma 2 and Gemma 3 beyond the shared family tests (test_tiny_vs_hf.py and
test_families.py run both against transformers): config parsing, the text model of a
multimodal Gemma 3 checkpoint through the Engine, and GGUF files of both."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.models.config import ModelConfig
from radixserve.models.loader import load_model, read_safetensors_folder
from radixserve.models.source import resolve_model
from tests.helpers.tiny_models import (
    hf_cached_greedy,
    make_tiny_model,
    patch_hf_float64,
    tiny_config,
)


def test_gemma2_config():
    cfg = ModelConfig.from_hf(tiny_config("gemma2", num_hidden_layers=4))
    assert cfg.sliding_windows == (16, -1, 16, -1)  # every other layer, the first sliding
    assert cfg.attention_scale == 24**-0.5 and cfg.head_dim == 16
    assert (cfg.attn_softcap, cfg.final_softcap) == (3.0, 4.0)
    assert (cfg.activation, cfg.norm_unit_offset, cfg.sandwich_norms) == ("gelu_tanh", True, True)
    assert cfg.embed_scale == 64**0.5 and not cfg.qk_norm and cfg.rope_local_theta == 0
    with pytest.raises(ValueError, match="activation 'silu' for gemma2"):
        ModelConfig.from_hf(tiny_config("gemma2", hidden_activation="silu"))


def test_gemma3_config():
    cfg = ModelConfig.from_hf(tiny_config("gemma3", attn_logit_softcapping=5.0))
    assert cfg.sliding_windows == (16, 16, -1) and cfg.qk_norm
    # transformers' Gemma 3 attention ignores attn_logit_softcapping.
    assert (cfg.attn_softcap, cfg.final_softcap) == (0.0, 0.0)
    assert (cfg.rope_theta, cfg.rope_type, cfg.rope_factor) == (1e5, "linear", 2.0)
    assert cfg.rope_local_theta == 1000.0
    # The default layer pattern: five sliding layers, then a global one.
    six = ModelConfig.from_hf(tiny_config("gemma3", num_hidden_layers=12, layer_types=None,
                                          rope_parameters=None))  # fmt: skip
    assert six.sliding_windows == ((16,) * 5 + (-1,)) * 2
    assert (six.rope_theta, six.rope_local_theta) == (1_000_000.0, 10_000.0)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(tiny_config("gemma3", use_bidirectional_attention=True))


def make_multimodal_gemma3(folder, text_folder):
    """A tiny Gemma3ForConditionalGeneration saved with transformers' save_pretrained (the
    text model under ``language_model.model``), with the tiny text model's tokenizer."""
    import transformers

    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=tiny_config("gemma3").to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=4, image_token_index=509, boi_token_index=510, eoi_token_index=511,
    )  # fmt: skip
    torch.manual_seed(4)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1 if "norm" in name or p.dim() == 1 else p.shape[-1] ** -0.5)
    model.save_pretrained(folder)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (folder / name).write_bytes((text_folder / name).read_bytes())
    return folder


def test_multimodal_gemma3_checkpoint_serves_its_text_model(tmp_path, tiny_family_dir):
    """Gemma3ForConditionalGeneration: its text model through the Engine (16-token chunks,
    page size 16, a cached second round) gives transformers' greedy tokens on text."""
    from transformers import Gemma3ForConditionalGeneration

    folder = make_multimodal_gemma3(tmp_path / "mm", tiny_family_dir("gemma3"))
    hf = patch_hf_float64(
        Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float64).eval()
    )
    rng = np.random.default_rng(6)
    prompts = [rng.integers(4, 500, n).tolist() for n in (40, 23)]
    want = [hf_cached_greedy(hf, p, 32) for p in prompts]
    eng = Engine(str(folder), dtype="float64", num_pages=128, page_size=16,
                 chunked_prefill_size=16)  # fmt: skip
    assert eng.runner.model_config.architecture == "Gemma3ForConditionalGeneration"
    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        assert [r.token_ids for r in eng.generate(prompts, sp)] == want
        eng.check_idle()
    assert eng.stats()["hit_tokens"] >= 32


def write_gguf(path, arch, folder, hf_config, **metadata):
    """A float32 GGUF as llama.cpp's converter writes one: its tensor names (gguf's own
    map), norms stored as 1 + w, the dims transformers reads back, and ``metadata``
    (writer method name -> value)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], hf_config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(hf_config.max_position_embeddings)
    writer.add_block_count(hf_config.num_hidden_layers)
    writer.add_feed_forward_length(hf_config.intermediate_size)
    writer.add_embedding_length(hf_config.hidden_size)
    writer.add_head_count(hf_config.num_attention_heads)
    writer.add_head_count_kv(hf_config.num_key_value_heads)
    writer.add_key_length(hf_config.head_dim)
    writer.add_value_length(hf_config.head_dim)
    writer.add_layer_norm_rms_eps(hf_config.rms_norm_eps)
    writer.add_sliding_window(hf_config.sliding_window)
    writer.add_vocab_size(hf_config.vocab_size)
    for method, value in metadata.items():
        getattr(writer, method)(value)
    for name, t in read_safetensors_folder(folder).items():
        data = t.numpy() + 1.0 if name.endswith("norm.weight") else t.numpy()
        writer.add_tensor(names.get_name(name.removesuffix(".weight")) + ".weight", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


#: What the GGUF tests' tiny models must use where transformers' GGUF reader takes its
#: config class's default: query_pre_attn_scalar 256, Gemma 3's local rope base 10000
#: and layer pattern of 6.
GGUF_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, attn_logit_softcapping=3.0,
                   final_logit_softcapping=4.0),
    "gemma3": dict(query_pre_attn_scalar=256, num_hidden_layers=6, layer_types=None,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1e5},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0}}),
}  # fmt: skip


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_loads_like_safetensors(tmp_path, arch):
    """transformers reads the config (we add Gemma 2's soft-caps and Gemma 3's rope
    scaling from the file's metadata), our reader maps the tensors (norms back from
    1 + w): the same ModelConfig and the same weights as the safetensors folder."""
    import gguf

    overrides = GGUF_DEFAULTS[arch]
    folder = make_tiny_model(tmp_path / "hf", arch, seed=7, dtype=torch.float32, **overrides)
    hf_config = tiny_config(arch, **overrides)
    extra = {"add_rope_freq_base": 1e5, "add_rope_scaling_type": gguf.RopeScalingType.LINEAR,
             "add_rope_scaling_factor": 2.0} if arch == "gemma3" else {
             "add_rope_freq_base": 10000.0, "add_attn_logit_softcapping": 3.0,
             "add_final_logit_softcapping": 4.0}  # fmt: skip
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, folder, hf_config, **extra)
    ours, gguf_config = load_model(resolve_model(str(path)), torch.float32)
    ref, _ = load_model(resolve_model(str(folder)), torch.float32)
    fields = ("sliding_windows", "attention_scale", "attn_softcap", "final_softcap",
              "rope_theta", "rope_type", "rope_factor", "rope_local_theta", "qk_norm",
              "head_dim", "tie_word_embeddings", "family")  # fmt: skip
    assert {f: getattr(ours.cfg, f) for f in fields} == {f: getattr(ref.cfg, f) for f in fields}
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        # 1 + w and back again in float32: one rounding of w's low bits.
        torch.testing.assert_close(p, theirs[name], rtol=0, atol=1e-6 if "norm" in name else 0)

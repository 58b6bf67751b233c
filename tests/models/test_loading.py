"""Model resolution, config validation, weight loading errors, rope scaling, sliding window."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from radixserve.models.config import ModelConfig
from radixserve.models.loader import read_safetensors_folder
from radixserve.models.rope import inv_frequencies
from radixserve.models.source import resolve_model
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import make_tiny_model, patch_hf_float64, tiny_config


def test_unknown_architecture_is_named():
    cfg = tiny_config("llama")
    cfg.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        ModelConfig.from_hf(cfg)


def test_unknown_rope_type_is_refused():
    cfg = tiny_config(
        "llama", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    )
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_hf(cfg)


def test_bad_model_name_says_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="is not 'smollm2', a folder with config.json"):
        resolve_model(str(tmp_path / "nothing-here"))


def test_llama3_and_linear_rope_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}  # fmt: skip
    for rope in (params, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}):
        hf = tiny_config("llama", head_dim=64, rope_parameters=rope)
        ours = inv_frequencies(ModelConfig.from_hf(hf))
        theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
        torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    # llama3 must actually change something relative to unscaled rope
    plain = ModelConfig.from_hf(tiny_config("llama", head_dim=64))
    assert not torch.allclose(ours, inv_frequencies(plain))


def test_missing_tensor_is_named(tmp_path, tiny_llama_dir):
    from safetensors.torch import save_file

    weights = read_safetensors_folder(tiny_llama_dir)
    del weights["model.layers.1.mlp.up_proj.weight"]
    for name in ("config.json", "tokenizer.model", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        build_runner(WorkerConfig(model=str(tmp_path), dtype="float64", num_pages=8))


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_llama_dir):
    from safetensors.torch import save_file

    weights = read_safetensors_folder(tiny_llama_dir)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: weights[k] for k in keys}, str(tmp_path / fname))
        weight_map.update({k: fname for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    reloaded = read_safetensors_folder(tmp_path)
    assert sorted(reloaded) == names
    assert all(torch.equal(reloaded[k], weights[k]) for k in names)


def test_mistral_sliding_window_matches_hf(tmp_path):
    """Sliding window 8 over a 30-token prompt, chunked, plus decodes, vs HF's own mask."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "mistral", "mistral", seed=4, sliding_window=8)
    hf = patch_hf_float64(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64))
    # Steps built by hand carry no window pages: one pool (test_sliding_pool.py has both).
    runner = build_runner(WorkerConfig(model=str(folder), dtype="float64", page_size=4,
                                      num_pages=32, max_running_requests=2,
                                      sliding_pool_pages=0))  # fmt: skip
    assert runner.model_config.sliding_windows == (8, 8)
    ids = np.random.default_rng(5).integers(4, 512, 30).astype(np.int32)
    greedy = SamplingParams(temperature=0)
    runner.forward_logits(Step([StepReq(0, ids[:13], 0, np.arange(4, dtype=np.int32),
                                             False, greedy)]))  # fmt: skip
    got = runner.forward_logits(Step([StepReq(0, ids[13:], 13, np.arange(4, 8, dtype=np.int32),
                                                   True)]))  # fmt: skip
    with torch.no_grad():
        want = hf(torch.tensor(ids, dtype=torch.long)[None]).logits[0, -1]
    assert torch.max(torch.abs(got[0] - want)).item() < 1e-9
    # Decode: one more token through the vectorised decode path.
    nxt = np.array([int(want.argmax())], np.int32)
    got = runner.forward_logits(Step([StepReq(0, nxt, 30, np.zeros(0, np.int32), True)]))
    with torch.no_grad():
        want = hf(torch.tensor(np.append(ids, nxt), dtype=torch.long)[None]).logits[0, -1]
    assert torch.max(torch.abs(got[0] - want)).item() < 1e-9

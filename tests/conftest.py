"""Shared fixtures: tiny random models (float64 HF folders) built once per test session."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import NEW_FAMILIES, make_tiny_model

# Two cores in CI: keep torch from oversubscribing them across test processes.
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama (GQA 4:2) as an HF folder with a sentencepiece tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """A tiny random Qwen2 (qkv bias, GQA 4:2) as an HF folder with a sentencepiece tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory):
    """family -> its tiny random model's HF folder, each built once per session on first use."""
    built = {}

    def get(family: str):
        if family not in built:
            seed = 10 + NEW_FAMILIES.index(family)
            built[family] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family, seed)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL (float64) with its image processor and chat template."""
    from tests.helpers.tiny_vlm import make_tiny_qwen2_5_vl

    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2_5_vl"), seed=5)


@pytest.fixture(scope="session")
def tiny_idefics3_dir(tmp_path_factory):
    """A tiny random Idefics3 (SmolVLM, float64) with its image processor and chat template."""
    from tests.helpers.tiny_vlm import make_tiny_idefics3

    return make_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), seed=6)


@pytest.fixture(scope="session")
def smollm2_cache_dir(tmp_path_factory):
    """Cache dir holding the converted embedded model: $RADIXSERVE_CACHE_DIR when set (so a
    developer's warm cache is reused), else a fresh directory converted once per session."""
    import os

    from radixserve.models.embedded import ensure_smollm2

    env = os.environ.get("RADIXSERVE_CACHE_DIR")
    root = env if env else str(tmp_path_factory.mktemp("radixserve-cache"))
    ensure_smollm2(root)
    return root


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the embedded GGUF (float32): the oracle, loaded once."""
    from transformers import AutoModelForCausalLM

    from radixserve.models.embedded import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()

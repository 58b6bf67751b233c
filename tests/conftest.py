"""Shared fixtures: tiny random models (float64 HF folders) built once per test session."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model

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

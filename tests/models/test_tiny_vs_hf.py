"""Our forward pass vs transformers on tiny random float64 models (HF patched to true float64),
one of each supported family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import NEW_FAMILIES, hf_greedy, patch_hf_float64

GREEDY = SamplingParams(temperature=0.0)
PROMPT_LEN, GEN_LEN = 40, 64


@pytest.fixture(scope="module", params=["llama", "qwen2", *NEW_FAMILIES])
def tiny(request, tiny_llama_dir, tiny_qwen2_dir, tiny_family_dir):
    """(folder, patched HF model, prompt ids) for each architecture."""
    from transformers import AutoModelForCausalLM

    dirs = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}
    folder = dirs.get(request.param) or tiny_family_dir(request.param)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    hf.eval()
    patch_hf_float64(hf)
    prompt = np.random.default_rng(3).integers(4, 512, PROMPT_LEN).astype(np.int32)
    return folder, hf, prompt


class Pages:
    """A minimal page allocator standing in for the scheduler (ids handed out in a shuffled order)."""

    def __init__(self, num_pages, page_size, seed=0):
        self.free = list(np.random.default_rng(seed).permutation(num_pages))
        self.page_size = page_size
        self.held = 0

    def grow(self, total_tokens):
        need = -(-total_tokens // self.page_size) - self.held
        pages = [self.free.pop() for _ in range(max(0, need))]
        self.held += len(pages)
        return np.array(pages, dtype=np.int32)


def run_greedy(runner, prompt, n, chunks, slot=0):
    """Prefill ``prompt`` in the given chunk sizes, then decode; returns (tokens, first logits)."""
    pages = Pages(runner.num_pages, runner.page_size, seed=slot)
    pos, first = 0, True
    logits0 = None
    for size in chunks:
        piece = prompt[pos : pos + size]
        last = pos + size == len(prompt)
        req = StepReq(slot, piece, pos, pages.grow(pos + size), last, GREEDY if first else None)
        logits = runner.forward_logits(Step([req]))
        first = False
        pos += size
        if last:
            logits0 = logits[0]
    tokens = [int(logits0.argmax())]
    while len(tokens) < n:
        req = StepReq(slot, np.array(tokens[-1:], np.int32), pos, pages.grow(pos + 1), True)
        tokens.append(int(runner.step(Step([req])).tokens[0]))
        pos += 1
    runner.step(Step([], release=[slot]))
    return tokens, logits0


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_and_logits_match_hf(tiny, page_size):
    folder, hf, prompt = tiny
    want, want_logits = hf_greedy(hf, prompt, GEN_LEN)
    runner = build_runner(
        WorkerConfig(model=str(folder), dtype="float64", page_size=page_size,
                     num_pages=512 // page_size + 8, max_running_requests=4,
                     sliding_pool_pages=0)  # steps built by hand: one pool, no window pages
    )  # fmt: skip
    for chunks in ([PROMPT_LEN], [7, 13, 1, 19], [1] * 5 + [PROMPT_LEN - 5]):
        got, logits = run_greedy(runner, prompt, GEN_LEN, chunks)
        assert torch.max(torch.abs(logits - want_logits)).item() < 1e-9
        assert got == want, f"chunks {chunks}"


def test_cached_prefix_then_suffix_matches_hf(tiny):
    """A second request reuses the first's prefix pages (as the radix cache would) and computes
    only its suffix; it must match HF computing the whole prompt, in one batch with a decode."""
    folder, hf, prompt = tiny
    page_size = 16
    runner = build_runner(WorkerConfig(model=str(folder), dtype="float64", page_size=page_size,
                                      num_pages=64, max_running_requests=4,
                                      sliding_pool_pages=0))  # fmt: skip
    prefix = prompt[:32]
    other = np.random.default_rng(9).integers(4, 512, 20).astype(np.int32)
    pages_a = np.array([5, 2, 40], np.int32)  # first request: prompt tokens 0..39
    out_a = runner.step(Step([StepReq(0, prompt, 0, pages_a, True, GREEDY)])).tokens
    pages_b = np.array([11, 12], np.int32)  # unrelated request already decoding in slot 2
    runner.step(Step([StepReq(2, other, 0, pages_b, True, GREEDY)]))
    # Slot 1: cached prefix = A's first two pages (32 tokens), then its own suffix page.
    suffix = np.concatenate([prompt[32:], np.array([7, 8, 9], np.int32)])
    full = np.concatenate([prefix, suffix])
    req_b = StepReq(1, suffix, 32, np.array([5, 2, 30], np.int32), True, GREEDY)
    req_dec = StepReq(2, np.array([3], np.int32), len(other), np.zeros(0, np.int32), True)
    req_a = StepReq(0, out_a, len(prompt), np.zeros(0, np.int32), True)
    logits = runner.forward_logits(Step([req_dec, req_b, req_a]))
    with torch.no_grad():
        want_b = hf(torch.tensor(full, dtype=torch.long)[None]).logits[0, -1]
        want_dec = hf(torch.tensor(np.append(other, 3), dtype=torch.long)[None]).logits[0, -1]
        want_a = hf(torch.tensor(np.append(prompt, out_a), dtype=torch.long)[None]).logits[0, -1]
    assert torch.max(torch.abs(logits[0] - want_dec)).item() < 1e-9
    assert torch.max(torch.abs(logits[1] - want_b)).item() < 1e-9
    assert torch.max(torch.abs(logits[2] - want_a)).item() < 1e-9

"""A ModelRunner on the flashinfer backend (through the CPU double) against the torch backend.

A tiny random Llama with head_dim 64 (GQA 4:2) in bfloat16: the same scheduler-like
script of steps (fresh prefills, a prefill after a cached prefix, a chunked prefill,
batched decodes) must give the same logits on both backends, within bfloat16's
rounding, and so the same greedy tokens wherever the top two logits are further apart
than that. The flashinfer run is fed the torch run's tokens (teacher forcing): in
bfloat16 two correct attention kernels can round a near-tie differently (the torch
backend's native kernel rounds probabilities to bfloat16, as GPU kernels do; oneDNN's
products differ by CPU), and one different token would make every later step differ.
As with the backend tests, this proves the wiring through the model, not FlashInfer's
kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from radixserve.worker.model_runner import ModelRunner
from tests.helpers.tiny_models import make_tiny_model
from tests.worker import fake_flashinfer

GREEDY = SamplingParams(temperature=0)
DECODE_STEPS = 8
# Logits of this model are O(1); bfloat16 rounding of the attention output moves them
# by about 1e-2 here. A wiring error (a wrong page, position or mask) moves them by O(1).
LOGIT_TOL = 0.125


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-d64"), "llama", seed=4,
        hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def script(
    runner: ModelRunner, page_size: int, forced: dict[int, list[int]] | None = None
) -> tuple[dict[int, list[int]], list[torch.Tensor]]:
    """Slots 0/1 prefill fresh; slot 2 reuses slot 0's first prefix pages (a cache hit);
    slot 3 prefills in two chunks; everyone then decodes together. Returns each slot's
    greedy tokens and each step's logits; with ``forced``, those tokens are fed back
    instead of the run's own."""
    rng = np.random.default_rng(0)
    prompt = {s: rng.integers(4, 512, n).astype(np.int32) for s, n in [(0, 40), (1, 9), (3, 30)]}
    prefix = 32 if page_size > 1 else 27
    prompt[2] = np.concatenate([prompt[0][:prefix], rng.integers(4, 512, 6).astype(np.int32)])
    pages = {s: list(range(100 * s, 100 * s + 100 // page_size)) for s in range(4)}
    pages[2] = pages[0][: prefix // page_size] + pages[2]
    held = dict.fromkeys(range(4), 0)
    pos = dict.fromkeys(range(4), 0)
    out: dict[int, list[int]] = {s: [] for s in range(4)}
    fed: dict[int, list[int]] = {s: [] for s in range(4)}
    logits: list[torch.Tensor] = []

    def req(slot, ids, sample=True):
        need = -(-(pos[slot] + len(ids)) // page_size)
        new = np.array(pages[slot][held[slot] : need], np.int32)  # a first step sends all so far
        r = StepReq(slot, ids, pos[slot], new, sample, GREEDY if held[slot] == 0 else None)
        held[slot], pos[slot] = need, pos[slot] + len(ids)
        return r

    def run(reqs):
        step_logits = runner.forward_logits(Step(reqs)).float()
        logits.append(step_logits)
        for r, row in zip([r for r in reqs if r.sample], step_logits):
            out[r.slot].append(int(row.argmax()))
            source = out if forced is None else forced
            fed[r.slot].append(source[r.slot][len(out[r.slot]) - 1])

    def last(slot):
        return np.array(fed[slot][-1:], np.int32)

    run([req(0, prompt[0]), req(1, prompt[1]), req(3, prompt[3][:17], sample=False)])
    pos[2] = prefix  # its first step starts after the cached prefix
    held[2] = 0
    run([req(2, prompt[2][prefix:]), req(3, prompt[3][17:]), req(0, last(0))])
    for _ in range(DECODE_STEPS):
        run([req(s, last(s)) for s in range(4)])
    return out, logits


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_equal_torch_backend(monkeypatch, head64_dir, page_size):
    fake = fake_flashinfer.install(monkeypatch)
    results, logits = {}, {}  # no warm-up: the calls below are counted
    for name in ("torch", "flashinfer"):
        cfg = WorkerConfig(model=str(head64_dir), dtype="bfloat16", page_size=page_size,
                           num_pages=512, max_running_requests=4, attention_backend=name,
                           warmup=False)  # fmt: skip
        runner = build_runner(cfg)
        assert runner.backend_name == name
        fake.calls.clear()  # count the script's calls, not the start-up probe's
        results[name], logits[name] = script(runner, page_size, results.get("torch"))
    for torch_step, fi_step in zip(logits["torch"], logits["flashinfer"], strict=True):
        assert (fi_step - torch_step).abs().max() < LOGIT_TOL
    assert [len(v) for v in results["torch"].values()] == [DECODE_STEPS + 2, DECODE_STEPS + 1,
                                                           DECODE_STEPS + 1, DECODE_STEPS + 1]  # fmt: skip
    assert sum(name == "append" for name, _ in fake.calls) == 2 * (DECODE_STEPS + 2)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_verification_step_equals_torch_backend(monkeypatch, head64_dir, page_size):
    """Speculative decoding's step on flashinfer: slot 0 verifies 4 drafts (5 query
    rows over its paged KV, past a page boundary) beside slot 1's plain decode row;
    then its table is cut (``keep_pages``) and it decodes on. Every row's logits
    equal the torch backend's within bfloat16's rounding."""
    fake_flashinfer.install(monkeypatch)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 512, 14).astype(np.int32), rng.integers(4, 512, 9).astype(np.int32)]
    drafts = rng.integers(4, 512, 4).astype(np.int32)
    pages = {0: np.arange(0, 32, dtype=np.int32), 1: np.arange(32, 64, dtype=np.int32)}
    per = -(-30 // page_size)  # pages each slot gets up front: 30 tokens
    rows = {}
    for name in ("torch", "flashinfer"):
        cfg = WorkerConfig(model=str(head64_dir), dtype="bfloat16", page_size=page_size,
                           num_pages=64, max_running_requests=2, attention_backend=name,
                           warmup=False)  # fmt: skip
        runner = build_runner(cfg)
        first = Step([StepReq(s, prompts[s], 0, pages[s][:per], True, GREEDY) for s in (0, 1)])
        out = [runner.forward_logits(first).float()]
        last = out[0].argmax(dim=-1).to(torch.int32).numpy()
        ids0 = np.concatenate([last[:1], drafts])
        verify = Step([StepReq(0, ids0, 14, pages[0][:0], True, num_drafts=4),
                       StepReq(1, last[1:], 9, pages[1][:0], True)])  # fmt: skip
        with torch.inference_mode():
            logits, num_sampled, _, plan = runner._forward(verify, [])
        assert num_sampled == 2 and plan == {0: (2, 4)}
        out.append(logits.float())
        # Slot 0 keeps the pages of its 16 tokens with K/V (14 + the last + 1 accepted
        # draft, as if one were) and decodes on from position 16 into a fresh page.
        keep = -(-16 // page_size)
        fresh = pages[0][per : per + -(-17 // page_size) - keep]  # pages not used before
        after = Step([StepReq(0, drafts[:1], 16, fresh, True, keep_pages=keep)])
        out.append(runner.forward_logits(after).float())
        assert runner.page_table.pages(0).tolist() == [*pages[0][:keep], *fresh]
        rows[name] = out
    for a, b in zip(rows["torch"], rows["flashinfer"], strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max() < LOGIT_TOL

"""A ModelRunner on the flashinfer backend (through the CPU double) against the torch backend.

A tiny random Llama with head_dim 64 (GQA 4:2) in bfloat16: the same scheduler-like
script of steps (fresh prefills, a prefill after a cached prefix, a chunked prefill,
batched decodes) must give the same greedy tokens on both backends. As with the
backend tests, this proves the wiring through the model, not FlashInfer's kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.config import WorkerConfig
from radixserve.worker.model_runner import ModelRunner
from tests.helpers.tiny_models import make_tiny_model
from tests.worker import fake_flashinfer

GREEDY = SamplingParams(temperature=0)
DECODE_STEPS = 8


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-d64"), "llama", seed=4,
        hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def script(runner: ModelRunner, page_size: int) -> dict[int, list[int]]:
    """Slots 0/1 prefill fresh; slot 2 reuses slot 0's first prefix pages (a cache hit);
    slot 3 prefills in two chunks; everyone then decodes together."""
    rng = np.random.default_rng(0)
    prompt = {s: rng.integers(4, 512, n).astype(np.int32) for s, n in [(0, 40), (1, 9), (3, 30)]}
    prefix = 32 if page_size > 1 else 27
    prompt[2] = np.concatenate([prompt[0][:prefix], rng.integers(4, 512, 6).astype(np.int32)])
    pages = {s: list(range(100 * s, 100 * s + 100 // page_size)) for s in range(4)}
    pages[2] = pages[0][: prefix // page_size] + pages[2]
    held = dict.fromkeys(range(4), 0)
    pos = dict.fromkeys(range(4), 0)
    out: dict[int, list[int]] = {s: [] for s in range(4)}

    def req(slot, ids, sample=True):
        need = -(-(pos[slot] + len(ids)) // page_size)
        new = np.array(pages[slot][held[slot] : need], np.int32)  # a first step sends all so far
        r = StepReq(slot, ids, pos[slot], new, sample, GREEDY if held[slot] == 0 else None)
        held[slot], pos[slot] = need, pos[slot] + len(ids)
        return r

    def run(reqs):
        toks = runner.step(Step(reqs)).tokens
        for r, t in zip([r for r in reqs if r.sample], toks):
            out[r.slot].append(int(t))

    run([req(0, prompt[0]), req(1, prompt[1]), req(3, prompt[3][:17], sample=False)])
    pos[2] = prefix  # its first step starts after the cached prefix
    held[2] = 0
    run([req(2, prompt[2][prefix:]), req(3, prompt[3][17:]), req(0, np.array(out[0][-1:]))])
    for _ in range(DECODE_STEPS):
        run([req(s, np.array(out[s][-1:], np.int32)) for s in range(4)])
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_tokens_equal_torch_backend(monkeypatch, head64_dir, page_size):
    fake = fake_flashinfer.install(monkeypatch)
    results = {}  # no warm-up: the calls below are counted
    for name in ("torch", "flashinfer"):
        cfg = WorkerConfig(model=str(head64_dir), dtype="bfloat16", page_size=page_size,
                           num_pages=512, max_running_requests=4, attention_backend=name,
                           warmup=False)  # fmt: skip
        runner = ModelRunner(cfg)
        assert runner.backend_name == name
        fake.calls.clear()  # count the script's calls, not the start-up probe's
        results[name] = script(runner, page_size)
    assert results["flashinfer"] == results["torch"]
    assert [len(v) for v in results["torch"].values()] == [DECODE_STEPS + 2, DECODE_STEPS + 1,
                                                           DECODE_STEPS + 1, DECODE_STEPS + 1]  # fmt: skip
    assert sum(name == "append" for name, _ in fake.calls) == 2 * (DECODE_STEPS + 2)

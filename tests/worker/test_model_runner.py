"""ModelRunner's step contract: slots, page tables, release, batching, sizing."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from radixserve.worker.kv_pool import KVPool

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    return build_runner(WorkerConfig(model=str(tiny_llama_dir), dtype="float64", page_size=4,
                                    num_pages=256, max_running_requests=8))  # fmt: skip


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 512, int(rng.integers(3, 30))).astype(np.int32) for _ in range(n)]


def generate_alone(runner, prompt, n, slot=0, first_page=0):
    pages = np.arange(first_page, first_page + 64, dtype=np.int32)
    held, pos, out = 0, 0, []
    ids = prompt
    for i in range(n):
        need = -(-(pos + len(ids)) // 4)
        req = StepReq(slot, ids, pos, pages[held:need], True, GREEDY if i == 0 else None)
        held = need
        tok = runner.step(Step([req])).tokens
        pos += len(ids)
        ids = tok
        out.append(int(tok[0]))
    runner.step(Step([], release=[slot]))
    return out


def test_attributes(runner):
    assert (runner.num_pages, runner.page_size, runner.vocab_size) == (256, 4, 512)
    assert runner.max_context_len == 1024 and runner.eos_token_ids == (2,)
    assert runner.backend_name == "torch" and isinstance(runner.model_name, str)


def test_staggered_batch_equals_each_request_alone(runner):
    """Requests join and leave a shared batch at different steps; each must get the tokens
    it gets when run alone (greedy, float64)."""
    ps = prompts(5)
    alone = [generate_alone(runner, p, 12) for p in ps]
    state = {}  # slot -> [pos, next ids, pages held, base page, outputs]
    step = 0
    while len(state) < len(ps) or any(len(s[4]) < 12 for s in state.values()):
        reqs, release = [], []
        if step < len(ps):  # a new request joins every step
            state[step] = [0, ps[step], 0, step * 40, []]
        for slot, s in sorted(state.items(), reverse=True):
            if len(s[4]) >= 12:
                if s[0] >= 0:
                    release.append(slot)
                    s[0] = -1
                continue
            need = -(-(s[0] + len(s[1])) // 4)
            new = np.arange(s[3] + s[2], s[3] + need, dtype=np.int32)
            reqs.append(StepReq(slot, s[1], s[0], new, True, GREEDY if s[0] == 0 else None))
            s[2] = need
        toks = runner.step(Step(reqs, release)).tokens
        for r, t in zip(reqs, toks):
            s = state[r.slot]
            s[0] += len(s[1])
            s[1] = np.array([t], np.int32)
            s[4].append(int(t))
        step += 1
    runner.step(Step([], release=[slot for slot, s in state.items() if s[0] >= 0]))
    assert [state[i][4] for i in range(len(ps))] == alone


def test_released_slot_is_reused_in_the_same_step(runner):
    a, b = prompts(2, seed=1)
    want = generate_alone(runner, b, 4, slot=3, first_page=100)
    runner.step(Step([StepReq(3, a, 0, np.arange(8, dtype=np.int32), True, GREEDY)]))
    out = []
    pos, ids, held = 0, b, 0
    for i in range(4):
        need = -(-(pos + len(ids)) // 4)
        req = StepReq(3, ids, pos, np.arange(100 + held, 100 + need, dtype=np.int32), True,
                      GREEDY if i == 0 else None)  # fmt: skip
        held = need
        ids = runner.step(Step([req], release=[3] if i == 0 else [])).tokens
        pos += len(req.input_ids)
        out.append(int(ids[0]))
    runner.step(Step([], release=[3]))
    assert out == want


def test_non_sampling_chunk_returns_no_token(runner):
    p = prompts(1, seed=2)[0]
    out = runner.step(Step([StepReq(0, p, 0, np.arange(8, dtype=np.int32), False, GREEDY)])).tokens
    assert out.dtype == np.int32 and out.shape == (0,)
    runner.step(Step([], release=[0]))


def test_page_table_must_cover_the_new_tokens(runner):
    p = np.arange(4, 14, dtype=np.int32)  # 10 tokens need 3 pages of 4
    with pytest.raises(ValueError, match="3 needed for 10 tokens"):
        runner.step(Step([StepReq(1, p, 0, np.arange(2, dtype=np.int32), True, GREEDY)]))
    runner.step(Step([], release=[1]))


def test_sampling_params_are_required_when_sampling(runner):
    with pytest.raises(ValueError, match="never given SamplingParams"):
        runner.step(Step([StepReq(2, np.array([5], np.int32), 0, np.array([0], np.int32))]))
    runner.step(Step([], release=[2]))


def test_pool_sized_from_memory_budget(tiny_llama_dir):
    per_page = KVPool.bytes_per_page(2, 16, 2, 16, __import__("torch").float32)
    r = build_runner(
        WorkerConfig(
            model=str(tiny_llama_dir), dtype="float32", page_size=16, kv_memory=10 * per_page + 5
        )
    )
    assert r.num_pages == 10
    assert r.pool.layers[0].shape == (10, 2, 16, 2, 16)

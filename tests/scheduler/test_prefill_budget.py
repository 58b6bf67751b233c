"""The prefill budget while requests decode (``decode_step_tokens``), against the
KV-simulating worker: the rule per step, the full chunk with no decode, a long
prompt that still finishes under a budget the decodes use up, and the same
tokens with the budget on and off."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.scheduler.request import ReqStatus
from tests.scheduler.test_scheduler import expected_tokens, greedy, make


def run_recording(sched, worker, arrivals=None, max_steps=20_000):
    """Step until idle, adding ``arrivals[step]`` (rid, prompt, params) lists; returns
    the results and, per step, (decode tokens, prefill tokens)."""
    arrivals = arrivals or {}
    steps: list[tuple[int, int]] = []
    results: dict[str, list[int]] = {}

    def run(batch):
        decode = sum(n for r, n in sched._batch if r.status is ReqStatus.DECODE)
        prefill = sum(n for r, n in sched._batch if r.status is ReqStatus.PREFILL)
        assert decode + prefill == sum(n for _, n in sched._batch)
        if decode + prefill:  # not a step that only releases slots
            steps.append((decode, prefill))
        return worker.step(batch)

    for step in range(max_steps):
        for rid, prompt, sp in arrivals.get(step, ()):
            sched.add_request(rid, prompt, sp)
        if not sched.has_work() and step > max(arrivals, default=0):
            sched.check_idle()
            return results, steps
        for out in sched.step(run):
            results.setdefault(out.rid, []).extend(out.token_ids)
    raise AssertionError("did not finish")


def check_outputs(results, prompts, max_tokens):
    """Every request's tokens are its true greedy continuation (ignoring EOS)."""
    assert set(results) == set(prompts)
    for rid, tokens in results.items():
        assert tokens == expected_tokens(prompts[rid], max_tokens[rid], ignore_eos=True), rid


def rule(decode: int, chunk: int, budget: int, ps: int) -> int:
    if decode == 0 or budget == 0:
        return chunk
    left = budget - decode
    return min(chunk, max(ps, left - left % ps))


def staggered(rng, n, length, every, max_tokens):
    """``n`` prompts of ``length`` tokens, one every ``every`` steps."""
    sp = greedy(max_tokens, ignore_eos=True)
    return {i * every: [(f"r{i}", rng.integers(3, 512, length).tolist(), sp)] for i in range(n)}


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_prefill_tokens_per_step_follow_the_budget_and_outputs_do_not_change(page_size):
    chunk, budget = 256, 96
    arrivals = staggered(np.random.default_rng(page_size), 24, 300, 3, 40)
    prompts = {rid: p for reqs in arrivals.values() for rid, p, _ in reqs}
    tokens = {}
    for on in (budget, 0):
        sched, worker = make(page_size=page_size, chunked_prefill_size=chunk, decode_step_tokens=on)
        results, steps = run_recording(sched, worker, arrivals)
        check_outputs(results, prompts, dict.fromkeys(prompts, 40))
        tokens[on] = results
        for decode, prefill in steps:
            assert prefill <= rule(decode, chunk, on, page_size)
        if on:
            # The budget binds while requests decode, and is used to the full
            # (a request mid-prefill was waiting in those steps).
            bound = [s for s in steps if s[0] and s[1] == rule(s[0], chunk, on, page_size)]
            assert len(bound) > 10
        else:
            assert any(d and p > budget for d, p in steps)  # off: decodes carry whole chunks
    assert tokens[budget] == tokens[0]


def test_no_decodes_prefill_the_full_chunk():
    chunk = 128
    sched, worker = make(page_size=4, chunked_prefill_size=chunk, decode_step_tokens=16)
    prompt = np.random.default_rng(0).integers(3, 512, 1000).tolist()
    sp = greedy(3, ignore_eos=True)
    results, steps = run_recording(sched, worker, {0: [("long", prompt, sp)]})
    # 1000 tokens in chunks of 128 with nothing decoding, then two decodes.
    assert steps == [(0, chunk)] * 7 + [(0, 1000 - 7 * chunk), (1, 0), (1, 0)]
    check_outputs(results, {"long": prompt}, {"long": 3})


@pytest.mark.parametrize("page_size", [1, 8])
def test_a_long_prompt_progresses_while_decodes_use_the_whole_budget(page_size):
    """32 requests decode (32 tokens a step, over a budget of 16): a long prompt that
    arrives meanwhile still prefills one page a step and finishes while they run."""
    rng = np.random.default_rng(1)
    sched, worker = make(
        num_pages=32768, page_size=page_size, chunked_prefill_size=512,
        decode_step_tokens=16, max_running_requests=40,
    )  # fmt: skip
    short = [
        (f"d{i}", rng.integers(3, 512, 8).tolist(), greedy(400, ignore_eos=True)) for i in range(32)
    ]
    long_prompt = rng.integers(3, 512, 40 * page_size + 3).tolist()
    arrivals = {0: short, 2: [("long", long_prompt, greedy(2, ignore_eos=True))]}
    results, steps = run_recording(sched, worker, arrivals)
    prefills = [p for d, p in steps[2:] if p]
    # One page a step (the last chunk is what is left), while the others decode.
    assert prefills == [page_size] * (len(long_prompt) // page_size) + [3] * (page_size > 1)
    assert all(d >= 32 for d, p in steps[2:] if p)
    assert len(results["long"]) == 2
    check_outputs(
        results,
        {rid: p for reqs in arrivals.values() for rid, p, _ in reqs},
        {**{rid: 400 for rid, _, _ in short}, "long": 2},
    )


def test_budget_zero_keeps_the_old_schedule():
    sched, _ = make(chunked_prefill_size=2048, decode_step_tokens=0)
    assert sched.prefill_budget(0) == sched.prefill_budget(64) == 2048
    sched, _ = make(page_size=16, chunked_prefill_size=2048, decode_step_tokens=512)
    assert sched.prefill_budget(0) == 2048
    assert sched.prefill_budget(32) == 480  # whole pages of what the decodes leave
    assert sched.prefill_budget(40) == 464
    assert sched.prefill_budget(600) == 16  # one page at least

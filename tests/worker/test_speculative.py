"""The worker's verification of drafts (``worker/speculative.py``) and its step.

- Greedy: the verified tokens are those a token-at-a-time loop over the same rows
  gives, logits processing (penalties, bias, min_tokens) included.
- Sampling: rejection sampling is lossless. With fixed rows (so the model's
  distribution at each position is known exactly), many seeds: the first token is
  distributed as the first row's filtered distribution whatever the draft, and the
  second, given the first draft was accepted, as the second row's (chi-square tests,
  enough samples to see a 4% shift).
- The step: a request's drafts as extra rows of a real model's step give the tokens
  of one-token steps, and ``keep_pages`` cuts the slot's table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from radixserve.worker.logits import LogitsProcessor
from radixserve.worker.sampler import Sampler, filtered_probs
from radixserve.worker.speculative import verify
from tests.helpers.tiny_models import make_tiny_model

VOCAB = 12


def sequential(rows, slot, first_pos, sampler, processor):
    """Token after token: process row j with the tokens before it counted, argmax."""
    out = []
    for j in range(rows.shape[0]):
        row = processor.apply(rows[j : j + 1].clone(), [slot], [first_pos + j])
        t = int(row.argmax())
        processor.record([slot], np.asarray([t], dtype=np.int32))
        out.append(t)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, logit_bias={3: 0.4}),
        SamplingParams(temperature=0.0, min_tokens=6, stop_token_ids=[5]),
    ],
)
def test_greedy_verification_is_token_at_a_time_decoding(params):
    rng = np.random.default_rng(0)
    history = np.asarray([1, 2, 3, 3, 4, 5], dtype=np.int32)
    for trial in range(40):
        rows = torch.from_numpy(rng.normal(size=(6, VOCAB)))
        rows[:, 5] += 0.8  # the stop token is often the best: min_tokens matters
        want = {}
        for name in ("plain", "spec"):
            sampler, proc = Sampler(), LogitsProcessor(VOCAB, (5,), torch.device("cpu"))
            sampler.add(0, params)
            proc.add(0, params, 4, history)
            if name == "plain":
                want[name] = sequential(rows, 0, 6, sampler, proc)
            else:
                # Drafts: the right tokens up to a cut, then a wrong one.
                cut = trial % 6
                drafts = want["plain"][:cut] + [(want["plain"][cut] + 1) % VOCAB]
                drafts = drafts[:5]
                got = verify(rows[: len(drafts) + 1], drafts, 0, 6, sampler, proc)
                assert got == want["plain"][: len(got)]
                assert len(got) == min(cut, 5) + 1
                # The counts the processor kept are those of the tokens returned.
                if proc._slots.get(0) is not None and proc._slots[0].counts is not None:
                    counts = np.bincount(list(history[4:]) + got, minlength=VOCAB)
                    assert proc._slots[0].counts.tolist() == counts.tolist()


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(samples, minlength=len(probs))
    keep = probs > 0
    assert observed[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = probs[keep] / probs[keep].sum() * len(samples)
    chi2 = float((((observed[keep] - expected) ** 2) / expected).sum())
    df = int(keep.sum()) - 1
    # The chi-square survival function: the regularized upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)))


@pytest.mark.parametrize(
    "params,draft0",
    [
        (SamplingParams(temperature=1.0), 0),  # the draft is the likeliest token
        (SamplingParams(temperature=0.7, top_k=5), 4),  # a middling one
        (SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05), 11),  # one filtered out
    ],
)
def test_rejection_sampling_keeps_the_models_distribution(params, draft0):
    rows = torch.tensor(
        [
            [2.0, 1.5, 1.2, 1.0, 0.6, 0.4, 0.1, 0.0, -0.5, -1.0, -2.0, -3.0],
            [0.3, 2.2, -1.0, 1.9, 0.0, 0.5, 1.1, -0.2, 0.8, -3.0, 0.2, 1.0],
            [0.0] * VOCAB,
        ],
        dtype=torch.float64,
    )
    drafts = [draft0, 1]
    n = 3000
    first, second = [], []
    sampler, proc = Sampler(), LogitsProcessor(VOCAB, (), torch.device("cpu"))
    for seed in range(n):
        sampler.add(0, SamplingParams(**{**params.__dict__, "seed": seed}))
        got = verify(rows, drafts, 0, 10, sampler, proc)
        first.append(got[0])
        if got[0] == draft0:
            second.append(got[1])
    p0 = filtered_probs(rows[0:1], [params])[0].numpy()
    p1 = filtered_probs(rows[1:2], [params])[0].numpy()
    assert chi_square_p(np.asarray(first), p0) > 1e-3
    if p0[draft0] > 0:
        assert len(second) > 150
        assert chi_square_p(np.asarray(second), p1) > 1e-3
    # The test has power: a distribution 4% off is rejected at these sizes.
    shifted = p0.copy()
    top = int(np.argmax(p0))
    shifted[top] -= 0.04
    shifted[int(np.argsort(p0)[-2])] += 0.04
    assert chi_square_p(np.asarray(first), shifted) < 1e-3


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-verify"), "llama", seed=7)
    cfg = WorkerConfig(model=str(folder), dtype="float64", page_size=4, num_pages=64, warmup=False)
    return build_runner(cfg)


def test_a_step_with_drafts_gives_the_tokens_of_one_token_steps(runner):
    greedy = SamplingParams(temperature=0.0)
    prompt = np.random.default_rng(1).integers(4, 512, 13).astype(np.int32)
    pages = np.arange(16, dtype=np.int32)
    # One token at a time: slot 0.
    tok = runner.step(Step([StepReq(0, prompt, 0, pages[:6], True, greedy)])).tokens.tolist()
    seq = list(prompt) + tok
    for _ in range(7):
        r = runner.step(
            Step([StepReq(0, np.asarray(seq[-1:], np.int32), len(seq) - 1, pages[4:4], True)])
        )
        seq.append(int(r.tokens[0]))
    plain = seq[len(prompt) :]
    # Slot 1: the same prompt, then the last token with 5 drafts, 3 of them right.
    r = runner.step(Step([StepReq(1, prompt, 0, pages[8:12], True, greedy)]))
    assert r.tokens.tolist() == plain[:1]
    drafts = plain[1:4] + [(plain[4] + 1) % 512, 7]
    ids = np.asarray(plain[:1] + drafts, np.int32)
    r = runner.step(Step([StepReq(1, ids, 13, pages[12:14], True, num_drafts=5)]))
    assert r.tokens.tolist() == [plain[1]]
    (v,) = r.verified
    assert v.slot == 1 and v.token_ids.tolist() == plain[1:5]
    # Its K/V covers 13 + 1 + 3 = 17 tokens: 5 pages; the sixth goes back.
    assert runner.page_table.num_slot_pages(1) == 6
    r = runner.step(
        Step([StepReq(1, np.asarray(plain[4:5], np.int32), 17, pages[14:15], True, keep_pages=5)])
    )
    assert runner.page_table.pages(1).tolist() == [8, 9, 10, 11, 12, 14]
    assert r.tokens.tolist() == plain[5:6]
    with pytest.raises(ValueError, match="drafts"):
        runner.step(
            Step([StepReq(1, np.asarray(plain[5:6], np.int32), 18, pages[:0], True, num_drafts=1)])
        )
    runner.step(Step([], release=np.asarray([0, 1], np.int32)))

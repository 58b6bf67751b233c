"""Logprobs, prompt logprobs, penalties, logit_bias and min_tokens through the
Engine, against HF transformers on a tiny float64 model.

The oracles: HF's log-softmax over a full recomputation (no cache) for every
logprob, and HF ``generate`` with its own logits processors (plus the
OpenAI-style penalties and the bias written here as processors) for greedy
tokens. Cache on and off, page sizes 1 and 16, chunked prefill, a cached
prefix, and retraction under KV pressure.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from tests.helpers.tiny_models import load_hf_float64, make_tiny_model

TOL = 1e-9


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-logprobs"), "llama", seed=11)


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return load_hf_float64(tiny_dir)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    shared = rng.integers(4, 512, 40).tolist()
    return [shared + rng.integers(4, 512, 7).tolist(), shared + rng.integers(4, 512, 19).tolist()]


def engine(tiny_dir, **kw) -> Engine:
    kw.setdefault("dtype", "float64")
    kw.setdefault("num_pages", 512)
    return Engine(str(tiny_dir), **kw)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is the log-distribution of the token at position p + 1."""
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits, dim=-1)


def check_entry(entry, token: int, row: torch.Tensor, k: int) -> None:
    assert entry.token_id == token
    assert abs(entry.logprob - float(row[token])) < TOL
    assert len(entry.top) == k
    want = row.topk(k)
    assert [t.token_id for t in entry.top] == want.indices.tolist()
    got = np.array([t.logprob for t in entry.top])
    np.testing.assert_allclose(got, want.values.numpy(), rtol=0, atol=TOL)


CONFIGS = [
    dict(page_size=1),
    dict(page_size=16),
    dict(page_size=16, chunked_prefill_size=16),
    dict(page_size=16, cache="none"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_sampled_and_prompt_logprobs_equal_hf(tiny_dir, hf, prompts, cfg):
    eng = engine(tiny_dir, **cfg)
    sp = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    plain = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    # The second round hits the first one's prefix in the cache.
    for _ in range(2):
        for prompt, res, ref in zip(prompts, eng.generate(prompts, sp), plain):
            assert res.token_ids == ref.token_ids  # asking for logprobs changes nothing
            table = hf_logprobs(hf, prompt + res.token_ids)
            assert len(res.logprobs) == len(res.token_ids)
            for i, (tok, entry) in enumerate(zip(res.token_ids, res.logprobs)):
                check_entry(entry, tok, table[len(prompt) + i - 1], 5)
            assert len(res.prompt_logprobs) == len(prompt)
            assert res.prompt_logprobs[0] is None
            for p in range(1, len(prompt)):
                check_entry(res.prompt_logprobs[p], prompt[p], table[p - 1], 3)
            # The whole prompt was scored: nothing of it could come from the cache.
            assert res.usage.cached_tokens == 0
    eng.check_idle()


@pytest.mark.parametrize("page_size", [1, 16])
def test_logprob_start_len_caps_the_hit(tiny_dir, hf, prompts, page_size):
    eng = engine(tiny_dir, page_size=page_size, chunked_prefill_size=24)
    prompt = prompts[1]
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    [warm] = eng.generate([prompt], greedy)  # the whole prompt is now cached
    assert warm.usage.cached_tokens == 0
    table = hf_logprobs(hf, prompt)
    k = 30
    sp = SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprob_start_len=k
    )
    for _ in range(2):  # and again: the rule holds with its own pages cached too
        [res] = eng.generate([prompt], sp)
        assert res.token_ids == warm.token_ids
        assert 0 < res.usage.cached_tokens <= k - 1
        if page_size == 1:
            assert res.usage.cached_tokens == k - 1  # everything the scored part allows
        assert res.prompt_logprobs[:k] == [None] * k
        for p in range(k, len(prompt)):
            check_entry(res.prompt_logprobs[p], prompt[p], table[p - 1], 2)
    # The prompt's pages were inserted as usual: a plain request hits all of it.
    [again] = eng.generate([prompt], greedy)
    matchable = len(prompt) - 1
    assert again.usage.cached_tokens == matchable - matchable % page_size
    eng.check_idle()


def test_max_tokens_zero_scores_and_caches_the_prompt_only(tiny_dir, hf, prompts):
    eng = engine(tiny_dir, page_size=4, chunked_prefill_size=16)
    prompt = prompts[0]
    sp = SamplingParams(max_tokens=0, prompt_logprobs=1)
    [res] = eng.generate([prompt], sp)
    assert (res.text, res.token_ids, res.finish_reason) == ("", [], "length")
    assert res.usage.completion_tokens == 0
    table = hf_logprobs(hf, prompt)
    for p in range(1, len(prompt)):
        check_entry(res.prompt_logprobs[p], prompt[p], table[p - 1], 1)
    # Prefilled, it is cached: a longer prompt sharing it hits every whole page.
    [more] = eng.generate([prompt + [9, 10]], SamplingParams(max_tokens=1, temperature=0.0))
    assert more.usage.cached_tokens == len(prompt) // 4 * 4
    eng.check_idle()


def test_prompt_logprobs_with_n_are_scored_once(tiny_dir, hf, prompts):
    eng = engine(tiny_dir, page_size=16)
    prompt = prompts[0]
    sp = SamplingParams(
        max_tokens=3, temperature=1.0, seed=5, n=3, ignore_eos=True, prompt_logprobs=1, logprobs=0
    )
    results = eng.generate([prompt], sp)
    assert [r.index for r in results] == [0, 1, 2]
    table = hf_logprobs(hf, prompt)
    check_entry(results[0].prompt_logprobs[len(prompt) - 1], prompt[-1], table[-2], 1)
    assert results[1].prompt_logprobs is None and results[2].prompt_logprobs is None
    for r in results:  # sampled tokens' logprobs: raw log-softmax, before temperature
        full = hf_logprobs(hf, prompt + r.token_ids)
        for i, (tok, entry) in enumerate(zip(r.token_ids, r.logprobs)):
            check_entry(entry, tok, full[len(prompt) + i - 1], 0)
    eng.check_idle()


def test_seeded_sampling_unchanged_by_logprobs(tiny_dir, prompts):
    eng = engine(tiny_dir, page_size=16)
    base = dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    want = eng.generate(prompts, SamplingParams(**base))
    got = eng.generate(prompts, SamplingParams(**base, logprobs=20, prompt_logprobs=20))
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(len(e.top) == 20 for r in got for e in r.logprobs)


# ------------------------------------------------------------ penalties vs HF generate
class OpenAIPenalties:
    """OpenAI's frequency and presence penalties over the generated tokens, as an
    HF logits processor (the oracle for ours)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class Bias:
    def __init__(self, bias: dict[int, float]) -> None:
        self.bias = bias

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for t, b in self.bias.items():
            scores[:, t] += max(-100.0, min(100.0, b))
        return scores


def hf_generate(hf, prompt: list[int], sp: SamplingParams) -> list[int]:
    """HF ``generate``, greedy, with processors in radixserve's order: min_tokens,
    logit_bias, repetition penalty, frequency and presence penalties."""
    from transformers import (
        LogitsProcessorList,
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
    )

    procs = []
    if sp.min_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(len(prompt), sp.min_tokens, [2]))
    if sp.logit_bias:
        procs.append(Bias(dict(sp.logit_bias)))
    if sp.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if sp.frequency_penalty or sp.presence_penalty:
        procs.append(OpenAIPenalties(len(prompt), sp.frequency_penalty, sp.presence_penalty))
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=sp.max_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList(procs),
            eos_token_id=None if sp.ignore_eos else 2,
            pad_token_id=3,
        )
    tokens = out[0, len(prompt) :].tolist()
    if not sp.ignore_eos and 2 in tokens:
        tokens = tokens[: tokens.index(2) + 1]
    return tokens


PENALTIES = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=-1.2),
    "bias": dict(logit_bias={7: 30.0, 9: 500.0, 11: -100}),
    "all": dict(
        repetition_penalty=0.7, frequency_penalty=0.4, presence_penalty=0.9, logit_bias={5: 3.0}
    ),
}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalties_equal_hf_generate(tiny_dir, hf, prompts, name):
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **PENALTIES[name])
    want = [hf_generate(hf, p, sp) for p in prompts]
    plain = [hf_generate(hf, p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in prompts]
    if name != "presence":  # a penalty that changes nothing would prove nothing
        assert want != plain
    eng = engine(tiny_dir, page_size=16, chunked_prefill_size=16)
    eng.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))  # cache the prompts
    for _ in range(2):  # cached prefixes: the penalties still see the whole prompt
        assert [r.token_ids for r in eng.generate(prompts, sp)] == want
    eng.check_idle()


def test_min_tokens_masks_eos_until_reached(tiny_dir, hf, prompts):
    eager = dict(max_tokens=12, temperature=0.0, logit_bias={2: 40.0})  # EOS is always argmax
    eng = engine(tiny_dir, page_size=16)
    [res] = eng.generate([prompts[0]], SamplingParams(**eager))
    assert res.token_ids == [2] and res.finish_reason == "stop"
    sp = SamplingParams(**eager, min_tokens=5)
    want = hf_generate(hf, prompts[0], sp)
    assert len(want) == 6 and want[-1] == 2
    [res] = eng.generate([prompts[0]], sp)
    assert res.token_ids == want and res.finish_reason == "stop"
    # stop_token_ids are masked too.
    stop = dict(max_tokens=12, temperature=0.0, logit_bias={9: 40.0}, stop_token_ids=[9])
    [res] = eng.generate([prompts[0]], SamplingParams(**stop, min_tokens=4))
    assert len(res.token_ids) == 5 and res.token_ids[-1] == 9 and 9 not in res.token_ids[:-1]
    eng.check_idle()


def test_penalty_counts_survive_retraction(tiny_dir, prompts):
    """Under KV pressure requests are retracted and recomputed; the worker's
    counts are rebuilt from the history and the tokens do not change."""
    sp = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.8,
        repetition_penalty=1.3, presence_penalty=0.3, logprobs=2,
    )  # fmt: skip
    batch = [prompts[i % 2][: 30 + i] for i in range(6)]
    want = engine(tiny_dir, page_size=1, num_pages=4096).generate(batch, sp)
    eng = engine(tiny_dir, page_size=4, num_pages=48, decode_reserve_ratio=0.0)
    got = eng.generate(batch, sp)
    assert eng.stats()["preemptions"] > 0
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(
            [e.logprob for e in a.logprobs], [e.logprob for e in b.logprobs], rtol=0, atol=TOL
        )
    eng.check_idle()


@pytest.mark.parametrize(
    "params, match",
    [
        (dict(logprobs=21), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty="1"), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(min_tokens=9, max_tokens=8), "min_tokens"),
        (dict(logprob_start_len=-2), "logprob_start_len"),
    ],
)
def test_bad_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**params)


def test_bad_parameters_for_this_model_are_refused(tiny_dir, prompts):
    eng = engine(tiny_dir, page_size=16)
    with pytest.raises(ValueError, match="logit_bias token id 512"):
        eng.generate([prompts[0]], SamplingParams(logit_bias={512: 1.0}))
    with pytest.raises(ValueError, match="logprob_start_len"):
        eng.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=1, logprob_start_len=4))
    eng.check_idle()

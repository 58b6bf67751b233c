"""Sampler: filters keep exactly the right tokens, seeds make outputs batch-independent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.sampling_params import SamplingParams
from radixserve.worker.sampler import Sampler

VOCAB = 50


def draw(params, logits, n=400, seed=0):
    s = Sampler(seed)
    s.add(0, params)
    return np.array([s.sample(logits[None], [0], [i])[0] for i in range(n)])


@pytest.fixture
def logits():
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2


def test_greedy_is_argmax(logits):
    assert set(draw(SamplingParams(temperature=0), logits, n=5)) == {int(logits.argmax())}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_of_the_lm_heads_layout(dtype):
    """Logits as the LM head gives them on the CPU (the transposed view of [vocab, rows],
    which the native argmax reads in place) beside sampled rows: the greedy rows get
    the first maximum, with ties everywhere (rounded values)."""
    g = torch.Generator().manual_seed(1)
    yt = (torch.randn(997, 9, generator=g) * 3).round().to(dtype)
    logits = yt.t()
    s = Sampler(0)
    for slot in range(9):
        s.add(slot, SamplingParams(temperature=0 if slot % 3 else 1.0))
    tokens = s.sample(logits, list(range(9)), [5] * 9)
    greedy = [r for r in range(9) if r % 3]
    ref = logits.double().argmax(dim=-1)
    assert tokens[greedy].tolist() == ref[greedy].tolist()


def test_top_k_keeps_only_k_best(logits):
    best = set(torch.topk(logits, 3).indices.tolist())
    got = set(draw(SamplingParams(temperature=5.0, top_k=3), logits))
    assert got == best


def test_top_p_keeps_smallest_prefix_reaching_p(logits):
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    allowed = set(order[mass_before < 0.6].tolist())
    got = set(draw(SamplingParams(temperature=1.0, top_p=0.6), logits, n=1000))
    assert got == allowed


def test_min_p_drops_unlikely_tokens(logits):
    probs = logits.softmax(-1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    got = set(draw(SamplingParams(temperature=1.0, min_p=0.2), logits, n=1000))
    assert got == allowed


def test_temperature_sampling_follows_distribution(logits):
    got = draw(SamplingParams(temperature=1.0), logits, n=4000)
    freq = np.bincount(got, minlength=VOCAB) / len(got)
    probs = logits.softmax(-1).numpy()
    assert np.abs(freq - probs).max() < 0.03


@pytest.mark.parametrize("top_p,other_top_p", [(0.9, 1.0), (1.0, 0.8)])
def test_seeded_request_is_independent_of_batch_composition(logits, top_p, other_top_p):
    """The same seeded request alone, or among others added in another order, gives the
    same tokens (a filtered row among unfiltered ones, and the other way round: the two
    kinds are sampled apart)."""
    mine = SamplingParams(temperature=1.0, top_p=top_p, seed=1234)
    alone = Sampler(seed=0)
    alone.add(5, mine)
    crowd = Sampler(seed=99)
    crowd.add(0, SamplingParams(temperature=0.7, top_p=other_top_p))
    crowd.add(3, SamplingParams(temperature=0))
    crowd.add(5, mine)
    others = torch.randn(2, VOCAB, dtype=torch.float64)
    a, b = [], []
    for pos in range(50):
        a.append(alone.sample(logits[None], [5], [pos])[0])
        b.append(
            crowd.sample(torch.stack([others[0], logits, others[1]]), [0, 5, 3], [9, pos, 4])[1]
        )
    assert a == b
    assert len(set(a)) > 1  # it really samples
    # A retracted request restarts its slot: the same positions give the same tokens.
    again = Sampler(seed=7)
    again.add(2, mine)
    assert [again.sample(logits[None], [2], [pos])[0] for pos in range(50)] == a


def test_unseeded_requests_differ_but_worker_seed_reproduces(logits):
    def run(worker_seed):
        s = Sampler(worker_seed)
        s.add(0, SamplingParams(temperature=1.0))
        s.add(1, SamplingParams(temperature=1.0))
        return [tuple(s.sample(torch.stack([logits, logits]), [0, 1], [i, i])) for i in range(20)]

    first = run(0)
    assert first == run(0)
    assert [x for x, _ in first] != [y for _, y in first]


@pytest.mark.parametrize("temperature", [1e-39, 1e-45, 1e-30, 1e-6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tiny_temperature_is_greedy(logits, temperature, dtype):
    """Logits divided by a temperature near zero overflow to inf (and softmax to NaN):
    such temperatures must give the argmax, as temperature 0 does."""
    x = logits.to(dtype) * 50  # large logits: 1e3 / 1e-39 is inf even in float64
    assert set(draw(SamplingParams(temperature=temperature), x, n=50)) == {int(x.argmax())}

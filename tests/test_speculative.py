"""Speculative decoding through the in-process Engine on a tiny float64 model, and the
embedded SmolLM2 in float32 through the Engine and through ``radixserve launch``.

Greedy outputs (tokens, text, finish reasons, logprobs) must be those of the same
Engine without speculation, whatever the drafter, page size and chunking, for
prompts hit in the cache, prompts replayed (radix drafts that are right), prompts
that repeat themselves (ngram drafts), ``n > 1``, stop strings, a stop token inside
an accepted run, EOS inside an accepted run, and ``max_tokens`` ending inside one.
The idle invariant holds after every run (no page or lock left behind). Sampling
with drafts keeps the model's distribution (a test of homogeneity against sampling
without them).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.client import Client
from tests.helpers.server import Server, wait_idle
from tests.helpers.tiny_models import make_tiny_model, use_char_tokenizer

MAX_NEW = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # One token per character: the text is a function of the token ids however they
    # arrive (a byte-fallback tokenizer's replacement characters depend on how
    # random bytes are grouped, and a verification delivers several tokens at once).
    return use_char_tokenizer(
        make_tiny_model(
            tmp_path_factory.mktemp("tiny-spec"), "llama", seed=5, max_position_embeddings=1024
        )
    )


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    shared = rng.integers(4, 512, 40).tolist()
    loop = rng.integers(4, 512, 12).tolist()
    return [
        shared + rng.integers(4, 512, 9).tolist(),
        shared + rng.integers(4, 512, 23).tolist(),  # a cached prefix
        loop * 4,  # repeats itself: ngram drafts
        rng.integers(4, 512, 31).tolist(),
    ]


def engine(folder, **kw) -> Engine:
    kw.setdefault("dtype", "float64")
    kw.setdefault("num_pages", 1024)
    kw.setdefault("warmup", False)
    return Engine(str(folder), **kw)


def run_twice(eng: Engine, prompts, params) -> list[list]:
    """Every prompt twice (the second time the tree holds the first's output)."""
    out = []
    for _ in range(2):
        res = eng.generate(prompts, params)
        out.append([(r.token_ids, r.text, r.finish_reason) for r in res])
    eng.check_idle()
    return out


@pytest.fixture(scope="module")
def plain(tiny_dir, prompts):
    """Greedy outputs without speculation, by page size."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2)
    out = {}
    for ps in (1, 16):
        with engine(tiny_dir, page_size=ps) as eng:
            out[ps] = run_twice(eng, prompts, params)
    assert out[1] == out[16]
    return out


@pytest.mark.parametrize(
    "algorithm,page_size,chunk", [("ngram", 1, 2048), ("radix", 16, 16), ("radix", 1, 8)]
)
def test_greedy_outputs_equal_those_without_speculation(
    tiny_dir, prompts, plain, algorithm, page_size, chunk
):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2)
    with engine(
        tiny_dir,
        page_size=page_size,
        chunked_prefill_size=chunk,
        speculative_algorithm=algorithm,
        speculative_min_match=1,
        speculative_max_batch=16,  # all 8 sequences draft (the default stops above 6)
    ) as eng:
        assert run_twice(eng, prompts, params) == plain[page_size]
        stats = eng.stats()
    assert stats["spec_verifications"] > 0
    if algorithm == "radix":  # the replays' drafts come from the first run's outputs
        assert stats["spec_accepted_tokens"] >= len(prompts) * MAX_NEW // 2


def test_logprobs_of_accepted_tokens_equal_the_plain_ones(tiny_dir, prompts):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    got = {}
    for algorithm in ("off", "radix"):
        with engine(tiny_dir, speculative_algorithm=algorithm) as eng:
            eng.generate(prompts, params)
            got[algorithm] = eng.generate(prompts, params)  # replayed: drafts accepted
            accepted = eng.stats()["spec_accepted_tokens"]
    assert accepted > 0
    for a, b in zip(got["off"], got["radix"]):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.token_id == x.token_id
            assert [t.token_id for t in y.top] == [t.token_id for t in x.top]
            assert y.logprob == pytest.approx(x.logprob, abs=1e-9)
            for t, u in zip(y.top, x.top):
                assert t.logprob == pytest.approx(u.logprob, abs=1e-9)


def test_a_run_of_accepted_drafts_is_cut_exactly(tiny_dir, prompts):
    """Replays drafted from the tree, cut by max_tokens, a stop token, a stop
    string and EOS inside the accepted run: the plain engine's outputs."""
    p = prompts[3]
    with engine(tiny_dir) as eng:
        full = eng.generate(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    stop_token = full.token_ids[11]
    stop_text = full.text[len(full.text) // 2 :][:3]
    cases = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 6)]
    cases.append(
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token])
    )
    cases.append(SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_text]))
    want, got = [], []
    for algorithm, out in (("off", want), ("radix", got)):
        with engine(
            tiny_dir, speculative_algorithm=algorithm, speculative_num_draft_tokens=5
        ) as eng:
            eng.generate(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
            for sp in cases:
                r = eng.generate(p, sp)[0]
                out.append((r.token_ids, r.text, r.finish_reason, r.usage.completion_tokens))
            eng.check_idle()
    assert got == want
    assert want[2][2] == "stop" and want[2][0][-1] == stop_token
    assert want[3][2] == "stop" and stop_text not in want[3][1]


def test_eos_inside_an_accepted_run_ends_it(tiny_dir, prompts, tmp_path):
    """The same weights with an EOS id the model emits mid-output (config edited):
    a replay's accepted drafts reach past it, the output must end at it."""
    p = prompts[0]
    with engine(tiny_dir) as eng:
        full = eng.generate(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    eos = full.token_ids[9]
    folder = tmp_path / "eos"
    shutil.copytree(tiny_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(cfg))
    gen = folder / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = eos
        gen.write_text(json.dumps(g))
    with engine(folder, speculative_algorithm="radix") as eng:
        eng.generate(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        r = eng.generate(p, SamplingParams(max_tokens=30, temperature=0.0))[0]
        accepted = eng.stats()["spec_accepted_tokens"]
        eng.check_idle()
    # The plain output up to the first EOS, which the replay's drafts reached past.
    assert r.token_ids == full.token_ids[: full.token_ids.index(eos) + 1]
    assert r.finish_reason == "stop" and accepted >= len(r.token_ids) - 2


def test_sampled_outputs_keep_their_distribution(tiny_dir):
    """Sampling with radix drafts (the tree holds the greedy continuation and every
    earlier sample's) against sampling without: the first two tokens of 240
    independent seeded samples per arm, top-k 3, must come from one distribution
    (chi-square test of homogeneity); many drafts are accepted and many rejected."""
    prompt = np.random.default_rng(11).integers(4, 512, 20).tolist()
    n = 240
    counts = {}
    for arm, algorithm in enumerate(("off", "radix")):
        with engine(tiny_dir, speculative_algorithm=algorithm, speculative_max_batch=1000) as eng:
            eng.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0))
            params = [
                SamplingParams(max_tokens=3, temperature=1.5, top_k=3, seed=arm * n + i)
                for i in range(n)
            ]
            res = eng.generate([prompt] * n, params)
            stats = eng.stats()
            eng.check_idle()
        counts[algorithm] = {}
        for r in res:
            key = tuple(r.token_ids[:2])
            counts[algorithm][key] = counts[algorithm].get(key, 0) + 1
    assert stats["spec_accepted_tokens"] > 50
    assert stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] > 50
    for depth in (1, 2):
        keys = sorted({k[:depth] for c in counts.values() for k in c})
        table = np.array(
            [
                [sum(v for k, v in c.items() if k[:depth] == key) for key in keys]
                for c in counts.values()
            ],
            dtype=np.float64,
        )
        table = table[:, table.sum(axis=0) >= 10]  # chi-square needs no tiny cells
        expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
        chi2 = float(((table - expected) ** 2 / expected).sum())
        df = table.shape[1] - 1
        p = float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(chi2 / 2)))
        assert df >= 2 and p > 1e-3, (depth, table, p)


# The embedded SmolLM2 in float32: a verification's rows go through the same kernels
# as decode rows (on the CPU, the one-call step up to 32 rows), so greedy outputs with
# drafts are those without. One chat whose answer copies the prompt (ngram drafts
# while the tree has nothing), n = 2 and past its EOS, then its replays, drafted from
# the tree and cut by max_tokens, by EOS and by a stop string inside the drafted run;
# 16-token pages, the 50-token prompt prefilled in 32-token chunks, replays hitting
# the cache. The Engine without speculation, run once, is the oracle of the Engine
# with radix drafts and of a launched server with them.
SMOLLM2_CHAT = [
    {
        "role": "user",
        "content": "Repeat this sentence exactly: The quick brown fox jumps over the "
        "lazy dog near the old river bank.",
    }
]
SMOLLM2_POOL = dict(page_size=16, chunked_prefill_size=32, num_pages=128)
SMOLLM2_REQUESTS = [
    dict(max_tokens=20, ignore_eos=True, n=2),  # the answer, its EOS, and past it
    dict(max_tokens=14, ignore_eos=True),  # max_tokens inside what the tree drafts
    dict(max_tokens=20),  # EOS inside it
    dict(max_tokens=20, stop=["lazy"]),  # a stop string inside it
]


def smollm2_engine(cache_dir, algorithm: str) -> Engine:
    return Engine("smollm2", cache_dir=cache_dir, dtype="float32", warmup=False,
                  speculative_algorithm=algorithm, **SMOLLM2_POOL)  # fmt: skip


def outcomes(results) -> list[tuple]:
    return [(r.token_ids, r.text, r.finish_reason) for r in results]


@pytest.fixture(scope="module")
def smollm2_plain(smollm2_cache_dir):
    with smollm2_engine(smollm2_cache_dir, "off") as eng:
        want = [
            outcomes(eng.generate(SMOLLM2_CHAT, SamplingParams(temperature=0.0, **kw)))
            for kw in SMOLLM2_REQUESTS
        ]
    assert [[o[2] for o in w] for w in want] == [["length"] * 2, ["length"], ["stop"], ["stop"]]
    assert [len(w[0][0]) for w in want[1:]] == [14, 11, 8]  # EOS 11th, "lazy" ends the 8th
    return want


def check_drafts_accepted(first: dict, last: dict) -> None:
    """``first``: the counters after the first request (ngram drafts of the copied
    sentence), ``last`` after the replays (radix drafts)."""
    assert first["spec_accepted_tokens"] >= 8
    assert last["spec_accepted_tokens"] - first["spec_accepted_tokens"] >= 15


def test_smollm2_float32_greedy_equal_with_radix_drafts(smollm2_cache_dir, smollm2_plain):
    got, stats = [], []
    with smollm2_engine(smollm2_cache_dir, "radix") as eng:
        for kw in SMOLLM2_REQUESTS:
            got.append(outcomes(eng.generate(SMOLLM2_CHAT, SamplingParams(temperature=0.0, **kw))))
            stats.append(eng.stats())
        eng.check_idle()
    assert got == smollm2_plain
    check_drafts_accepted(stats[0], stats[-1])


def test_smollm2_float32_launch_with_radix_drafts(smollm2_cache_dir, smollm2_plain):
    """The same requests to ``radixserve launch --speculative-algorithm radix`` over
    ZeroMQ (the first replay streamed): the plain Engine's outputs, drafts accepted
    (the server's counters), the server idle and clean after."""
    flags = ["--dtype", "float32", "--cache-dir", smollm2_cache_dir, "--no-warmup"]
    for k, v in SMOLLM2_POOL.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    srv = Server("smollm2", *flags, "--speculative-algorithm", "radix")
    got, stats = [], []
    try:
        with Client(srv.endpoint, timeout=300) as c:
            for i, kw in enumerate(SMOLLM2_REQUESTS):
                if i == 1:
                    chunks = list(c.generate_stream(messages=SMOLLM2_CHAT, temperature=0.0, **kw))
                    ids = [t for ch in chunks for t in ch.token_ids]
                    text = "".join(ch.text for ch in chunks)
                    got.append([(ids, text, chunks[-1].finish_reason)])
                    assert any(len(ch.token_ids) > 1 for ch in chunks)  # drafts arrive together
                else:
                    res = c.generate(messages=SMOLLM2_CHAT, temperature=0.0, **kw)
                    got.append(outcomes(res if isinstance(res, list) else [res]))
                stats.append(wait_idle(c))
            assert c.check()["ok"]
    finally:
        assert srv.stop() == 0
    assert srv.orphans() == []
    assert got == smollm2_plain
    check_drafts_accepted(stats[0], stats[-1])
    print("drafts", {k: v for k, v in stats[-1].items() if k.startswith("spec_")})

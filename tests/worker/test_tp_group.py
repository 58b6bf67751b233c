"""Tensor parallelism over real processes (gloo): the Engine's ``WorkerGroup`` and
``radixserve launch --tp`` against one rank, and a rank's death. The sharding itself
is tested in-process (tests/models/test_tensor_parallel.py); these few tests spawn
processes, so they stay small."""

from __future__ import annotations

import os
import re
import signal

import numpy as np
import pytest

from radixserve import Engine, SamplingParams, StructuredOutput
from radixserve.client import Client, ServerError
from tests.helpers.server import Server
from tests.helpers.tiny_models import make_tiny_model, use_char_tokenizer

REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
PREFIX = "the common part of every prompt, "
PROMPTS = [PREFIX + "then one", PREFIX + "and two", "something else"]


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
    """8 query / 4 KV heads, a character tokenizer (so a regex always completes)."""
    folder = make_tiny_model(
        tmp_path_factory.mktemp("tp-chars"), "llama", seed=4, tokenizer=False, vocab_size=128,
        num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip
    return use_char_tokenizer(folder)


def _run(folder, **kw):
    """Greedy with logprobs, then seeded sampling and a regex-constrained request, then the
    greedy prompts again (cached): (token ids, logprobs, constrained text, cached tokens)."""
    eng = Engine(str(folder), dtype="float64", warmup=False, num_pages=1024, **kw)
    try:
        plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
        first = eng.generate(PROMPTS, plain)
        seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, n=2)
        first += eng.generate(PROMPTS[0], seeded)
        constrained = SamplingParams(
            max_tokens=40, temperature=0.0, structured=StructuredOutput.regex(REGEX)
        )
        [regex] = eng.generate("mail: ", constrained)
        again = eng.generate(PROMPTS, plain)
        eng.check_idle()
    finally:
        eng.close()
    ids = [r.token_ids for r in first + again]
    lps = np.array([[t.logprob for t in r.logprobs] for r in first[:3] + again])
    return ids, lps, regex.text, again[0].usage.cached_tokens


@pytest.mark.parametrize(
    "kw", [dict(page_size=4, chunked_prefill_size=8), dict(page_size=1, cache="none")]
)
def test_engine_tp2_equals_one_rank(char_dir, kw):
    one_ids, one_lps, one_regex, one_cached = _run(char_dir, **kw)
    tp_ids, tp_lps, tp_regex, tp_cached = _run(char_dir, tp=2, **kw)
    assert tp_ids == one_ids
    assert np.allclose(tp_lps, one_lps, atol=1e-9, rtol=0)
    assert tp_regex == one_regex and re.fullmatch(REGEX, tp_regex)
    assert tp_cached == one_cached and (tp_cached > 0) == (kw.get("cache") != "none")


def test_launch_tp2_serves_and_a_dead_rank_stops_it(char_dir):
    want = Engine(str(char_dir), dtype="float64", warmup=False, num_pages=1024)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in want.generate(PROMPTS, sp)]
    srv = Server(char_dir, "--tp", "2", "--num-pages", "1024", "--page-size", "4",
                 "--no-warmup")  # fmt: skip
    assert "tp=2 weights_mib=" in srv.summary
    with Client(srv.endpoint, timeout=120) as c:
        got = [c.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True) for p in PROMPTS]
        assert [r.token_ids for r in got] == expected
        stream = c.generate_stream(prompt="go on", max_tokens=400, ignore_eos=True)
        next(stream)
        os.kill(srv.pids["worker1"], signal.SIGKILL)
        with pytest.raises(ServerError, match="worker1"):
            for _ in stream:
                pass
    assert srv.wait() != 0
    assert srv.wait_orphans_gone() == []

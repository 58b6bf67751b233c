"""``few-shot --score`` end to end through the in-process Engine backend, on a tiny model.

Scored from each choice's start, the cache serves the context and question (all
but their last token) and the hit rate reaches >= 0.98 of the optimum under the
start-position rule; scoring the whole prompt hits nothing and computes more
tokens, with the same logprobs. Then the command itself: one table, both passes,
the JSON; and the refusals (the openai backend, flags that do not apply).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from radixserve.benchmark.backends import EngineBackend
from radixserve.benchmark.metrics import compare_scores, summarize
from radixserve.benchmark.runner import run
from radixserve.benchmark.workloads import TokenSource, few_shot_score
from radixserve.cli import main as radixserve_main
from radixserve.engine import Engine
from tests.helpers.tiny_models import make_tiny_model

PAGE = 4
ENGINE_FLAGS = ("--page-size", str(PAGE), "--num-pages", "4096", "--dtype", "float64")


@pytest.fixture(scope="module")
def model_dir():
    folder = Path(tempfile.mkdtemp(prefix="rs-score-"))
    make_tiny_model(folder, "llama", seed=5, max_position_embeddings=1024)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def workload():
    src = TokenSource.random(512, 7, exclude=[0, 1, 2, 3])
    return few_shot_score(
        src, subjects=2, questions=4, shots=3, example_len=20, question_len=9, choices=4,
        choice_len=3,
    )  # fmt: skip


async def both_passes(engine: Engine, w):
    backend = EngineBackend(engine)
    out = {}
    for score_from in ("choice", "whole"):
        await backend.reset_cache()
        before = await backend.stats()
        result = await run(w, backend, progress=False, score_from=score_from)
        out[score_from] = (result, before, await backend.stats())
    await backend.close()
    return out


def test_rule_reaches_the_optimum_and_saves_computation(model_dir):
    w = workload()
    engine = Engine(str(model_dir), page_size=PAGE, num_pages=4096, dtype="float64")
    try:
        runs = asyncio.run(both_passes(engine, w))
        engine.check_idle()
    finally:
        engine.close()
    rule, whole = runs["choice"][0], runs["whole"][0]
    mr, mw = summarize(rule, PAGE, w), summarize(whole, PAGE, w)

    for m, result in ((mr, rule), (mw, whole)):
        assert m["failed"] == m["not_sent"] == 0, m["errors"]
        assert m["requests"] == w.num_requests == 32
        assert m["prompt_count_mismatches"] == m["output_count_mismatches"] == 0
        assert m["questions_scored"] == m["questions"] == 8
        assert all(r.choice_logprob is not None and r.choice_logprob < 0 for r in result.records)
    # The start positions sent: the choice's start, or 0 (the whole prompt).
    assert all(r.logprob_start_len == r.score_start == 2 * 3 * 10 + 9 for r in rule.records)
    assert all(r.logprob_start_len == 0 for r in whole.records)

    # With the rule: at most start - 1 tokens cached per request, and the optimum under
    # that rule reached (the first choice of each question computes its question).
    assert all(r.usage.cached_tokens <= r.score_start - 1 for r in rule.records)
    assert all(r.usage.cached_tokens % PAGE == 0 for r in rule.records)
    assert mr["hit_rate"] <= mr["optimal_hit_rate"] <= mr["optimal_hit_rate_page1"]
    assert mr["hit_vs_optimal"] >= 0.98
    assert mr["optimal_hit_rate"] > 0.6
    _, before, after = runs["choice"]
    assert after["hit_tokens"] - before["hit_tokens"] == mr["cached_tokens"]

    # The whole prompt scored: nothing may come from the cache, so more is computed.
    assert mw["optimal_hit_rate"] == mw["cached_tokens"] == 0
    assert mw["prompt_tokens"] == mr["prompt_tokens"]
    assert mw["computed_tokens"] == mw["prompt_tokens"] > 2 * mr["computed_tokens"]

    # The same requests, the same scores (float64: recomputed and cached KV agree).
    cmp = compare_scores(w, rule.records, whole.records)
    assert cmp["picks_agree"] == 1.0 and cmp["max_logprob_diff"] < 1e-9
    assert mr["accuracy"] is not None and mr["chance"] == 0.25


def bench_argv(model_dir, *extra):
    argv = ["bench", "few-shot", "--score", "--model", str(model_dir), "--backend", "engine"]
    argv += ["--subjects", "2", "--questions", "2", "--shots", "2", "--example-len", "20"]
    argv += ["--question-len", "6", "--choices", "3", "--choice-len", "2", "--no-progress"]
    return argv + ["--server-args", " ".join(ENGINE_FLAGS), *extra]


def test_command_prints_both_passes_side_by_side(model_dir, tmp_path, capsys):
    out = tmp_path / "score"
    assert radixserve_main(bench_argv(model_dir, "--no-plot", "--output", str(out))) == 0
    table = capsys.readouterr().out
    assert "whole-prompt / from-choice" in table and "computed tokens" in table
    assert "accuracy (sum)" in table and "hit / optimal" in table
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["workload"] == "few-shot-score" and doc["workload_params"]["choices"] == 3
    rule, whole = doc["variants"]
    assert (rule["label"], rule["score_from"]) == ("from-choice", "choice")
    assert (whole["label"], whole["score_from"]) == ("whole-prompt", "whole")
    assert rule["backend"] == "engine" and "--page-size" in rule["server_args"]
    assert len(rule["requests"]) == len(whole["requests"]) == 2 * 2 * 3
    start = 2 * 20 + 6
    assert all(r["logprob_start_len"] == r["score_start"] == start for r in rule["requests"])
    assert all(r["logprob_start_len"] == 0 for r in whole["requests"])
    mr, mw = rule["metrics"], whole["metrics"]
    assert mr["hit_vs_optimal"] >= 0.98 and mw["cached_tokens"] == 0
    assert mw["computed_tokens"] > mr["computed_tokens"]
    assert mw["picks_agree"] == 1.0


def test_refusals(model_dir):
    argv = ["bench", "shared-prefix", "--score", "--model", str(model_dir), "--no-plot"]
    with pytest.raises(SystemExit, match="--score does not apply to shared-prefix"):
        radixserve_main(argv)
    argv = ["bench", "few-shot", "--choices", "3", "--model", str(model_dir), "--no-plot"]
    with pytest.raises(SystemExit, match="--choices does not apply to few-shot"):
        radixserve_main(argv)
    with pytest.raises(SystemExit, match="--output-len does not apply to few-shot --score"):
        radixserve_main(bench_argv(model_dir, "--output-len", "2", "--no-plot"))

"""Every workload at tiny scale against real launched servers: the numbers must add up.

Three launches in all: one radix-cache server shared by the per-workload tests,
and the two fresh servers ``radixserve bench --compare cache=radix,none`` starts.
Checks: nothing fails; usage agrees with the tokens sent and received; a child's
prompt is its parent's prompt + answer + its own tokens; hits never exceed the
offline optimum and reach >= 0.98 of it; the server's own counters agree; cache
none hits nothing; the JSON and PNG are written. A scoring workload (prompt
logprobs from each choice's start) goes over ZeroMQ too, and again scoring
the whole prompt: nothing hits, the scores agree.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from radixserve.benchmark.backends import RadixserveBackend
from radixserve.benchmark.metrics import compare_scores, summarize
from radixserve.benchmark.runner import run
from radixserve.benchmark.workloads import (
    TokenSource,
    few_shot,
    few_shot_score,
    multi_turn,
    shared_prefix,
    tree,
)
from radixserve.cli import main as radixserve_main
from tests.helpers.server import Server
from tests.helpers.tiny_models import make_tiny_model

PAGE = 4
# The scheduler holds back every request that shares a prefix of >= 32 tokens
# with a prompt being prefilled until that prefix is cached, so each shared
# prefix is computed once and hits reach >= 0.98 of the offline optimum.
SERVER_ARGS = ("--page-size", str(PAGE), "--num-pages", "8192")


@pytest.fixture(scope="module")
def model_dir():
    folder = Path(tempfile.mkdtemp(prefix="rs-bench-"))
    make_tiny_model(folder, "llama", seed=5, max_position_embeddings=1024)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(model_dir, *SERVER_ARGS)
    yield srv
    assert srv.stop() == 0


def src(seed: int) -> TokenSource:
    return TokenSource.random(512, seed, exclude=[0, 1, 2, 3])


WORKLOADS = {
    "shared-prefix": lambda: shared_prefix(
        src(1), groups=3, prompts=5, system_len=61, question_len=7, output_len=5
    ),
    "multi-turn": lambda: multi_turn(
        src(2),
        conversations=3,
        turns=3,
        system_len=9,
        user_len_min=10,
        user_len_max=30,
        output_len=6,
    ),
    "few-shot": lambda: few_shot(
        src(3), subjects=2, questions=5, shots=3, example_len=15, question_len=6
    ),
    "tree": lambda: tree(
        src(4), trees=2, depth=2, branches=3, root_len=37, branch_len=5, output_len=4
    ),
    "few-shot-score": lambda: few_shot_score(
        src(6), subjects=2, questions=3, shots=3, example_len=15, question_len=6, choices=3
    ),
}


async def bench(endpoint: str, workload, **kw):
    backend = RadixserveBackend(endpoint, timeout=120)
    try:
        await backend.reset_cache()
        before = await backend.stats()
        result = await run(workload, backend, progress=False, **kw)
        after = await backend.stats()
        check = await backend.client.check()
    finally:
        await backend.close()
    return result, before, after, check


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workload_numbers_add_up(server, name):
    workload = WORKLOADS[name]()
    kw = {"rate": 40.0, "max_concurrency": 4} if name == "few-shot" else {}
    result, before, after, check = asyncio.run(bench(server.endpoint, workload, **kw))
    m = summarize(result, PAGE)

    assert m["failed"] == m["not_sent"] == 0, m["errors"]
    assert m["requests"] == workload.num_requests == len(result.records)
    assert m["prompt_count_mismatches"] == m["output_count_mismatches"] == 0
    assert m["prompt_tokens"] == m["sent_prompt_tokens"]
    assert m["completion_tokens"] == m["received_output_tokens"] == m["expected_output_tokens"]
    assert sorted(r.order for r in result.records) == list(range(workload.num_requests))

    # A child's prompt is exactly its parent's prompt + answer + its own new tokens.
    by_key = {r.key: r for r in result.records}
    for root in workload.roots:
        for node in root.walk():
            for child in node.children:
                parent = by_key[node.key]
                assert (
                    by_key[child.key].prompt_ids
                    == parent.prompt_ids + parent.output_ids + child.tokens
                )
                assert by_key[child.key].order > parent.order

    # Hits: never above the optimum, and close to it; the server's counters agree.
    assert m["optimal_hit_rate"] > 0.3
    assert m["optimal_hit_rate"] <= m["optimal_hit_rate_page1"]
    assert m["hit_rate"] <= m["optimal_hit_rate"]
    assert m["hit_vs_optimal"] >= 0.98
    assert all(r.usage.cached_tokens % PAGE == 0 for r in result.records)
    assert after["hit_tokens"] - before["hit_tokens"] == m["cached_tokens"]
    assert after["query_tokens"] - before["query_tokens"] == m["prompt_tokens"]
    assert check == {"ok": True, "error": None}

    assert m["ttft_mean_ms"] > 0 and m["e2e_p99_ms"] >= m["ttft_p99_ms"]
    if workload.roots[0].max_tokens > 1:
        assert m["itl_mean_ms"] > 0


def test_scoring_the_whole_prompt_over_zeromq(server):
    w = WORKLOADS["few-shot-score"]()
    rule, *_ = asyncio.run(bench(server.endpoint, w))
    whole, before, after, check = asyncio.run(bench(server.endpoint, w, score_from="whole"))
    mr, mw = summarize(rule, PAGE, w), summarize(whole, PAGE, w)
    assert mr["failed"] == mw["failed"] == 0 and check == {"ok": True, "error": None}
    assert mr["questions_scored"] == mw["questions_scored"] == 6
    assert mr["hit_vs_optimal"] >= 0.98
    assert mw["cached_tokens"] == mw["optimal_hit_rate"] == 0
    assert after["hit_tokens"] == before["hit_tokens"]
    assert mw["computed_tokens"] > mr["computed_tokens"]
    # The server runs in the CPU's auto dtype (bfloat16 where it is fast), in which
    # cached and recomputed KV may differ in the last bits; test_score.py checks
    # equality in float64.
    cmp = compare_scores(w, rule.records, whole.records)
    largest = max(abs(r.choice_logprob) for r in rule.records)
    assert cmp["picks_agree"] is not None and cmp["max_logprob_diff"] <= 0.02 * largest


def test_compare_cache_radix_none(model_dir, tmp_path, capsys):
    """The whole command: two fresh servers, one table, the JSON, the PNG and the tree."""
    out = tmp_path / "sp"
    argv = ["bench", "shared-prefix", "--model", str(model_dir), "--groups", "2", "--prompts", "4"]
    argv += ["--system-len", "50", "--question-len", "6", "--output-len", "4", "--no-progress"]
    argv += ["--server-args", " ".join(("--dtype", "float64", *SERVER_ARGS)), "--compare"]
    argv += ["cache=radix,none", "--output", str(out)]
    assert radixserve_main(argv) == 0

    table = capsys.readouterr().out
    assert (
        "cache=radix" in table and "cache=none / cache=radix" in table and "hit / optimal" in table
    )
    doc = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The cache's tree next to the plot, as the dashboard draws it: the two system
    # prompts are its largest prefixes; cache=none has no tree to draw.
    svg = (tmp_path / "sp-tree-cache_radix.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") >= 3
    assert not (tmp_path / "sp-tree-cache_none.svg").exists()
    assert doc["workload_params"]["groups"] == 2 and doc["config"]["compare"] == [
        "cache=radix,none"
    ]
    radix, none = doc["variants"]
    assert radix["label"] == "cache=radix" and none["label"] == "cache=none"
    assert "--cache" in none["server_args"] and "cache=none" in none["server_summary"]
    assert len(radix["requests"]) == len(none["requests"]) == 8
    # The same prompts went to both servers.
    assert [r["prompt_len"] for r in radix["requests"]] == [
        r["prompt_len"] for r in none["requests"]
    ]
    mr, mn = radix["metrics"], none["metrics"]
    assert mn["cached_tokens"] == 0 and mn["hit_rate"] == 0.0
    assert mr["optimal_hit_rate"] == mn["optimal_hit_rate"] > 0.5
    assert mr["hit_vs_optimal"] >= 0.98
    assert mr["page_size"] == PAGE and mr["prompt_tokens"] == mn["prompt_tokens"] == 8 * 56

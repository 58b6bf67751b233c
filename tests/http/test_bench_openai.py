"""`radixserve bench --backend openai` against radixserve's own HTTP front.

The benchmark's OpenAI backend (SSE with ``stream_options.include_usage``, token-id
prompts, ``usage.prompt_tokens_details.cached_tokens``, ``return_token_ids``) runs a
shared-prefix and a multi-turn workload through the front; its numbers must agree with
what was sent, with the scheduler's own counters, and reach the offline-optimal hit rate.
"""

from __future__ import annotations

import asyncio

import pytest

from radixserve.benchmark.backends import OpenAIBackend
from radixserve.benchmark.metrics import summarize
from radixserve.benchmark.runner import run
from radixserve.benchmark.workloads import TokenSource, few_shot_score, multi_turn, shared_prefix
from tests.http.conftest import MODEL

PAGE = 4  # tests/serving's SERVER_ARGS


WORKLOADS = {
    "shared-prefix": lambda src: shared_prefix(
        src, groups=2, prompts=4, system_len=40, question_len=6, output_len=4
    ),
    # Later turns resend earlier answers: exact only through return_token_ids.
    "multi-turn": lambda src: multi_turn(
        src, conversations=2, turns=2, system_len=9, user_len_min=10, user_len_max=20, output_len=4
    ),
}


def run_openai(base_url: str, workload):
    async def go():
        backend = OpenAIBackend(base_url, model=MODEL, page_size=PAGE, timeout=120)
        try:
            return await run(workload, backend, progress=False)
        finally:
            await backend.close()

    return asyncio.run(go())


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_openai_backend_against_the_http_front(base_url, zmq_client, name):
    src = TokenSource.random(512, 21, exclude=[0, 1, 2, 3])
    workload = WORKLOADS[name](src)
    zmq_client.flush_cache()
    before = zmq_client.stats()

    m = summarize(run_openai(base_url, workload), PAGE)
    after = zmq_client.stats()
    assert m["failed"] == 0, m["errors"]
    assert m["requests"] == workload.num_requests
    assert m["prompt_tokens"] == m["sent_prompt_tokens"]
    assert m["completion_tokens"] == m["expected_output_tokens"] == m["received_output_tokens"]
    assert m["output_count_mismatches"] == 0
    assert after["hit_tokens"] - before["hit_tokens"] == m["cached_tokens"] > 0
    assert after["query_tokens"] - before["query_tokens"] == m["prompt_tokens"]
    assert m["hit_rate"] <= m["optimal_hit_rate"]
    assert m["hit_vs_optimal"] >= 0.98


def test_openai_backend_scores_from_the_choice(base_url, zmq_client):
    """Scoring through /v1/completions (echo + logprob_start_len): each choice is
    scored, and the shared context still comes from the cache."""
    src = TokenSource.random(512, 23, exclude=[0, 1, 2, 3])
    workload = few_shot_score(
        src, subjects=2, questions=2, shots=2, example_len=24, question_len=6, choices=3
    )
    zmq_client.flush_cache()

    result = run_openai(base_url, workload)
    m = summarize(result, PAGE)
    assert m["failed"] == 0, m["errors"]
    assert all(r.choice_logprob is not None and r.choice_logprob < 0 for r in result.records)
    assert m["hit_vs_optimal"] >= 0.98

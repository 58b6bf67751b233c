"""Generation through launch + client equals the in-process Engine's, in every shape:
token ids and text prompts, chat messages, streaming, n > 1, stop strings, concurrency."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from radixserve import SamplingParams, StructuredOutput
from radixserve import protocol as P
from radixserve.client import AsyncClient, Client, ServerError
from tests.helpers.server import Server, wait_idle
from tests.serving.conftest import SERVER_ARGS

MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    shared = rng.integers(4, 512, 40).tolist()
    return [
        shared + rng.integers(4, 512, 7).tolist(),
        shared + rng.integers(4, 512, 19).tolist(),
        shared[:21] + rng.integers(4, 512, 5).tolist(),
        rng.integers(4, 512, 33).tolist(),
        rng.integers(4, 512, 3).tolist(),
    ]


@pytest.fixture(scope="module")
def expected(engine, prompts):
    return engine.generate(prompts, GREEDY)


async def generate_all(endpoint: str, prompts: list[list[int]]) -> list:
    """Every prompt at once over one AsyncClient (replies demultiplexed by id)."""
    async with AsyncClient(endpoint, timeout=120) as client:
        jobs = [client.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
        return await asyncio.gather(*jobs)


def assert_same(got, want) -> None:
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    assert [r.finish_reason for r in got] == ["length"] * len(want)
    assert [r.usage.prompt_tokens for r in got] == [r.usage.prompt_tokens for r in want]


def test_greedy_equals_engine_radix(server, client, prompts, expected):
    # Twice: the second round hits the KV the first one left in the tree.
    for _ in range(2):
        assert_same(asyncio.run(generate_all(server.endpoint, prompts)), expected)


def test_greedy_equals_engine_without_cache(model_dir, prompts, expected):
    srv = Server(model_dir, *SERVER_ARGS, "--cache", "none")
    try:
        assert "cache=none" in srv.summary
        for _ in range(2):
            results = asyncio.run(generate_all(srv.endpoint, prompts))
            assert_same(results, expected)
            assert all(r.usage.cached_tokens == 0 for r in results)
        with Client(srv.endpoint, timeout=120) as c:
            stats = wait_idle(c)
            assert stats["pages_free"] == stats["num_pages"]
            assert c.check()["ok"]
    finally:
        assert srv.stop() == 0
    assert srv.orphans() == []


def test_shared_prefix_hits_in_usage_and_stats(client):
    rng = np.random.default_rng(9)
    prefix = rng.integers(4, 512, 64).tolist()
    client.flush_cache()
    before = client.stats()
    first = client.generate(input_ids=prefix + [7, 8, 9], sampling_params=GREEDY)
    second = client.generate(input_ids=prefix + [10, 11], sampling_params=GREEDY)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 64  # the whole prefix, in 4-token pages
    after = client.stats()
    assert after["hit_tokens"] - before["hit_tokens"] == 64
    assert after["query_tokens"] - before["query_tokens"] == 67 + 66


def test_text_prompt_and_messages(client, engine):
    [want] = engine.generate("The quick brown fox", GREEDY)
    got = client.generate("The quick brown fox", sampling_params=GREEDY)
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    chat = [{"role": "user", "content": "Hello there"}]
    [want] = engine.generate([chat], GREEDY)
    got = client.generate(messages=chat, sampling_params=GREEDY)
    assert (got.text, got.token_ids) == (want.text, want.token_ids)


def test_tools_reach_the_chat_template(client, engine):
    chat = [{"role": "user", "content": "Weather in Rome?"}]
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "book_flight"}},
    ]
    [want] = engine.generate([chat], GREEDY, tools=tools)
    got = client.generate(messages=chat, tools=tools, sampling_params=GREEDY, echo=True)
    assert got.prompt_text == "tools: get_weather book_flight.\nuser: Weather in Rome?\nassistant:"
    assert (got.token_ids, got.usage.prompt_tokens) == (want.token_ids, want.usage.prompt_tokens)
    plain = client.generate(messages=chat, sampling_params=GREEDY)
    assert plain.usage.prompt_tokens < got.usage.prompt_tokens
    chunks = list(client.generate_stream(messages=chat, tools=tools, sampling_params=GREEDY))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    with pytest.raises(ServerError, match="tool definitions contain special tokens"):
        client.generate(messages=chat, tools=[{"function": {"name": "</s>"}}], max_tokens=2)


def test_streaming_matches_the_whole_result(client, engine):
    [want] = engine.generate("Streaming works", GREEDY)
    chunks = list(client.generate_stream("Streaming works", sampling_params=GREEDY))
    assert len(chunks) == MAX_NEW  # one token per step
    assert [c.finish_reason for c in chunks] == [None] * (MAX_NEW - 1) + ["length"]
    assert [c.usage is None for c in chunks] == [True] * (MAX_NEW - 1) + [False]
    assert "".join(c.text for c in chunks) == want.text
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert chunks[-1].usage["completion_tokens"] == MAX_NEW


def test_stop_string_and_n(client, engine):
    base = client.generate("A stop string", max_tokens=24, temperature=0.0, ignore_eos=True)
    stop = base.text[4:7]
    assert len(stop) == 3
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    [want] = engine.generate("A stop string", sp)
    cut = client.generate("A stop string", sampling_params=sp)
    assert cut.finish_reason == want.finish_reason == "stop"
    assert cut.text == want.text == base.text[: base.text.index(stop)]
    many = client.generate("Sampled", max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [r.index for r in many] == [0, 1, 2]
    want_many = engine.generate("Sampled", SamplingParams(max_tokens=8, seed=5, n=3))
    assert [r.token_ids for r in many] == [r.token_ids for r in want_many]


def same_logprobs(got: list, want: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert (a.token_id, a.text) == (b.token_id, b.text)
        assert [(t.token_id, t.text) for t in a.top] == [(t.token_id, t.text) for t in b.top]
        lps = [a.logprob] + [t.logprob for t in a.top]
        np.testing.assert_allclose(lps, [b.logprob] + [t.logprob for t in b.top], atol=1e-9)


def test_logprobs_and_penalties_equal_engine(client, engine, prompts):
    sp = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2,
        logprob_start_len=20, frequency_penalty=0.5, logit_bias={7: 2.5}, min_tokens=2,
    )  # fmt: skip
    [want] = engine.generate([prompts[1]], sp)
    got = client.generate(input_ids=prompts[1], sampling_params=sp)
    assert got.token_ids == want.token_ids
    same_logprobs(got.logprobs, want.logprobs)  # other pages and chunks: same to 1e-9
    same_logprobs(got.prompt_logprobs, want.prompt_logprobs)
    assert got.prompt_logprobs[:20] == [None] * 20
    assert got.usage.cached_tokens <= 19
    assert all(e.text == engine.tokenizer.decode([e.token_id]) for e in got.logprobs)
    chunks = list(client.generate_stream(input_ids=prompts[1], sampling_params=sp))
    assert [len(c.logprobs) for c in chunks] == [1] * len(chunks)
    assert chunks[0].prompt_logprobs is not None
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    np.testing.assert_allclose(
        [c.logprobs[0][2] for c in chunks], [e.logprob for e in want.logprobs], atol=1e-9
    )


def test_concurrent_threads_share_one_client(server, client, prompts, expected):
    import threading

    got: dict[int, object] = {}

    def run(i: int) -> None:
        got[i] = client.generate(input_ids=prompts[i], sampling_params=GREEDY)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert_same([got[i] for i in range(len(prompts))], expected)


def test_stats_and_health(client):
    """Stats count what one known request did: its pages, hits and steps."""
    client.flush_cache()
    before = wait_idle(client)
    assert (before["pages_free"], before["pages_cached"], before["pages_used"]) == (1024, 0, 0)
    assert before["page_size"] == 4 and before["num_pages"] == 1024
    prompt = list(range(10, 50))  # 40 tokens: prefill chunks of 32 + 8
    client.generate(input_ids=prompt, sampling_params=GREEDY)
    wait_idle(client)  # its release step has run: the next request cannot share it
    client.generate(input_ids=prompt[:36] + [7, 7], sampling_params=GREEDY)
    after = wait_idle(client)
    # The first request leaves KV for 40 + 15 tokens (the last sampled token has none):
    # 13 whole pages in the tree, its partial tail page freed. The second hits 9 pages
    # (36 tokens) and adds 38 + 15 - 36 = 17 tokens: 4 more whole pages.
    assert after["pages_cached"] == 13 + 4
    assert after["pages_free"] == 1024 - 17 and after["pages_used"] == 0
    assert after["hit_tokens"] - before["hit_tokens"] == 36
    assert after["query_tokens"] - before["query_tokens"] == 40 + 38
    # Worker steps: 2 prefill chunks + 15 decodes, then 1 chunk + 15 decodes, and after
    # each request one step that only releases its slot (nothing else was running).
    assert after["steps"] - before["steps"] == (17 + 1) + (16 + 1)
    assert after["preemptions"] == before["preemptions"]
    health = client.health()
    assert health["status"] == "ok"
    assert (health["num_pages"], health["page_size"], health["max_context_len"]) == (1024, 4, 512)


def test_structured_output_equals_engine_streamed_and_not(client, engine):
    """The worker compiles the grammar off its step loop and jumps forward over
    forced text; the server's tokens are the Engine's, whole or streamed, and a
    bad regex is an error reply that leaves the server serving."""
    import re

    so = StructuredOutput.regex(r"(yes|no), because [a-z ]{1,12}\.")
    sp = SamplingParams(max_tokens=40, temperature=0.0, structured=so)
    [want] = engine.generate("Is it so?", sp)
    assert want.finish_reason == "stop" and re.fullmatch(so.spec, want.text)
    got = client.generate("Is it so?", sampling_params=sp)
    assert (got.text, got.token_ids) == (want.text, want.token_ids)
    chunks = list(client.generate_stream("Is it so?", sampling_params=sp))
    assert "".join(c.text for c in chunks) == want.text
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    # ", because " is forced: some chunk carries several tokens.
    assert max(len(c.token_ids) for c in chunks) > 1
    bad = SamplingParams(max_tokens=4, structured=StructuredOutput.regex("(unclosed"))
    with pytest.raises(ServerError, match="invalid regex"):
        client.generate("x", sampling_params=bad)
    assert client.generate("Still serving", sampling_params=GREEDY).finish_reason == "length"


def test_a_request_past_its_timeout_fails_with_a_clear_error(client):
    """The scheduler enforces ``timeout``: the request ends with an error naming it, its
    KV is released (the fixture checks the idle invariant), and the client goes on."""
    with pytest.raises(ServerError, match="timed out after 0.001 s") as e:
        client.generate(input_ids=[5, 6, 7], max_tokens=400, ignore_eos=True,
                        temperature=0.0, request_timeout=0.001)  # fmt: skip
    assert str(e.value).startswith(P.REQUEST_TIMED_OUT)  # the client's deadline, no failure
    assert client.stats()["timeouts"] >= 1
    r = client.generate(input_ids=[5, 6, 7], max_tokens=2, temperature=0.0, priority=3)
    assert r.usage.completion_tokens == 2

"""The official ``openai`` package against the HTTP front: what it gets equals what the
ZeroMQ client gets for the same greedy request (texts, finish reasons, usage)."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest

from tests.http.conftest import MODEL

MAX = 12
EXTRA = {"ignore_eos": True}  # the tiny model would otherwise stop at random EOS tokens
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a radix tree?"},
]


@pytest.fixture
def oai(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_completions_match_the_zmq_client(oai, zmq_client):
    prompts = ["The quick brown fox", "Prefix caching saves"]
    want = [zmq_client.generate(p, max_tokens=MAX, temperature=0, ignore_eos=True) for p in prompts]
    one = oai.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=MAX, temperature=0, extra_body=EXTRA
    )
    assert one.object == "text_completion" and one.model == MODEL
    assert [(c.index, c.text, c.finish_reason) for c in one.choices] == [
        (0, want[0].text, "length")
    ]
    assert one.usage.prompt_tokens == want[0].usage.prompt_tokens
    assert one.usage.completion_tokens == MAX
    assert one.usage.total_tokens == want[0].usage.prompt_tokens + MAX
    # A batch of prompts, and token ids as a prompt.
    batch = oai.completions.create(
        model=MODEL, prompt=prompts, max_tokens=MAX, temperature=0, extra_body=EXTRA
    )
    assert [(c.index, c.text) for c in batch.choices] == [(0, want[0].text), (1, want[1].text)]
    assert batch.usage.prompt_tokens == sum(w.usage.prompt_tokens for w in want)
    assert batch.usage.completion_tokens == 2 * MAX
    ids = want[1].token_ids[:5]
    by_ids = oai.completions.create(
        model=MODEL, prompt=ids, max_tokens=MAX, temperature=0, extra_body=EXTRA
    )
    want_ids = zmq_client.generate(input_ids=ids, max_tokens=MAX, temperature=0, ignore_eos=True)
    assert by_ids.choices[0].text == want_ids.text
    assert by_ids.usage.prompt_tokens == 5


def test_completions_stream_with_usage(oai, zmq_client):
    want = zmq_client.generate("Streaming text", max_tokens=MAX, temperature=0, ignore_eos=True)
    stream = oai.completions.create(
        model=MODEL,
        prompt="Streaming text",
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRA,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert [c.usage is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.usage.prompt_tokens, MAX)
    assert usage.total_tokens == usage.prompt_tokens + MAX


def test_chat_sync_and_async_stream(base_url, oai, zmq_client):
    want = zmq_client.generate(messages=CHAT, max_tokens=MAX, temperature=0, ignore_eos=True)
    got = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=MAX, temperature=0, extra_body=EXTRA
    )
    assert got.object == "chat.completion"
    msg = got.choices[0].message
    assert (msg.role, msg.content, got.choices[0].finish_reason) == (
        "assistant",
        want.text,
        "length",
    )
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == MAX

    async def stream() -> list:
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=120
        ) as client:
            s = await client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=MAX,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=EXTRA,
            )
            return [c async for c in s]

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.usage.prompt_tokens, MAX)
    # The whole prompt but its last token was cached by the identical requests before.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_n_choices_match_the_protocols_n(oai, zmq_client):
    sampled = dict(max_tokens=8, temperature=1.0, seed=5, n=3)
    want = zmq_client.generate("Sampled", ignore_eos=True, **sampled)
    got = oai.completions.create(model=MODEL, prompt="Sampled", extra_body=EXTRA, **sampled)
    assert [(c.index, c.text) for c in got.choices] == [(w.index, w.text) for w in want]
    assert got.usage.prompt_tokens == want[0].usage.prompt_tokens  # the prompt counts once
    assert got.usage.completion_tokens == 3 * 8
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRA,
        **sampled,
    )
    texts = ["", "", ""]
    finishes: dict[int, str] = {}
    chunks = list(stream)
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    want = zmq_client.generate(messages=CHAT, ignore_eos=True, **sampled)
    assert texts == [w.text for w in want]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 3 * 8


def test_stop_string(oai, zmq_client):
    base = zmq_client.generate("A stop string", max_tokens=24, temperature=0, ignore_eos=True)
    stop = base.text[4:7]
    want = zmq_client.generate(
        "A stop string", max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]
    )
    got = oai.completions.create(
        model=MODEL,
        prompt="A stop string",
        max_tokens=24,
        temperature=0,
        stop=stop,
        extra_body=EXTRA,
    )
    assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, "stop")
    assert got.usage.completion_tokens == want.usage.completion_tokens


def test_cached_tokens_equal_the_zmq_clients(oai, zmq_client):
    rng = np.random.default_rng(21)
    prefix = rng.integers(4, 512, 48).tolist()
    prompts = [prefix + [7, 8, 9], prefix + [10, 11]]

    def via_zmq() -> list[int]:
        zmq_client.flush_cache()
        outs = [zmq_client.generate(input_ids=p, max_tokens=2, temperature=0) for p in prompts]
        return [r.usage.cached_tokens for r in outs]

    def via_http() -> list[int]:
        zmq_client.flush_cache()
        outs = [
            oai.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
            for p in prompts
        ]
        return [r.usage.prompt_tokens_details.cached_tokens for r in outs]

    assert via_http() == via_zmq() == [0, 48]


def test_models_health_stats_and_flush(base_url, oai, zmq_client):
    import httpx

    [card] = oai.models.list().data
    assert card.id == MODEL
    root = base_url.removesuffix("/v1")
    assert httpx.get(root + "/health").json() == {"status": "ok"}
    stats = httpx.get(root + "/stats").json()
    assert stats["num_pages"] == zmq_client.stats()["num_pages"]
    oai.completions.create(model=MODEL, prompt="fill the cache", max_tokens=2, temperature=0)
    freed = httpx.post(root + "/flush_cache").json()["freed_pages"]
    assert freed > 0
    assert zmq_client.stats()["pages_cached"] == 0


def test_concurrent_streams_like_a_benchmark(base_url, zmq_client):
    """Many streaming requests at once over one AsyncOpenAI, sharing a prefix: each gets
    its own text and exact usage (what the benchmark's openai backend relies on)."""
    shared = "You are a helpful assistant. " * 6
    prompts = [f"{shared}Question {i}:" for i in range(8)]
    want = [zmq_client.generate(p, max_tokens=MAX, temperature=0, ignore_eos=True) for p in prompts]
    zmq_client.flush_cache()

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, object]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=MAX,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
        text, usage = "", None
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async def run() -> list:
        async with openai.AsyncOpenAI(
            base_url=base_url, api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(run())
    assert [t for t, _ in got] == [w.text for w in want]
    assert [u.prompt_tokens for _, u in got] == [w.usage.prompt_tokens for w in want]
    assert all(u.completion_tokens == MAX for _, u in got)
    assert sum(u.prompt_tokens_details.cached_tokens for _, u in got) > 0  # the shared prefix


def test_completions_echo_logprobs_equal_the_zmq_client(oai, zmq_client):
    """lm-eval's loglikelihood request: token ids, echo, logprobs, one new token."""
    ids = zmq_client.generate("Scoring a continuation", max_tokens=10, temperature=0).token_ids
    prompt = [5, 9, 33] + ids
    want = zmq_client.generate(
        input_ids=prompt, max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1, echo=True
    )
    got = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    [choice] = got.choices
    lp = choice.logprobs
    assert choice.text == want.prompt_text + want.text
    assert len(lp.tokens) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    scored = want.prompt_logprobs[1:] + want.logprobs
    np.testing.assert_allclose(lp.token_logprobs[1:], [e.logprob for e in scored], atol=1e-9)
    assert lp.tokens[1:] == [e.text for e in scored]
    for top, e in zip(lp.top_logprobs[1:], scored):  # the best token, and the chosen one
        assert top[e.top[0].text] == pytest.approx(e.top[0].logprob, abs=1e-9)
        assert top[e.text] == pytest.approx(e.logprob, abs=1e-9)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    # Without echo: only the new tokens, and the text alone.
    plain = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0, logprobs=3, extra_body=EXTRA
    )
    assert (
        plain.choices[0].text
        == zmq_client.generate(input_ids=prompt, max_tokens=3, temperature=0, ignore_eos=True).text
    )
    assert len(plain.choices[0].logprobs.tokens) == 3
    assert all(len(t) >= 3 for t in plain.choices[0].logprobs.top_logprobs)


def test_completions_stream_echo_logprobs(oai, zmq_client):
    prompt = [7, 11, 13, 17, 19, 23]
    whole = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True,
        extra_body=EXTRA,
    )  # fmt: skip
    chunks = list(
        oai.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            logprobs=2,
            echo=True,
            extra_body=EXTRA,
            stream=True,
        )  # fmt: skip
    )
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    offsets = [
        x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset
    ]
    assert offsets == whole.choices[0].logprobs.text_offset


def test_chat_logprobs_and_penalties(oai, zmq_client):
    sampling = dict(
        temperature=0, frequency_penalty=0.7, presence_penalty=0.3, logit_bias={"40": 3.0}
    )
    want = zmq_client.generate(
        messages=CHAT, max_tokens=MAX, ignore_eos=True, logprobs=5, **sampling
    )
    got = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX, logprobs=True, top_logprobs=5,
        extra_body=EXTRA, **sampling,
    )  # fmt: skip
    [choice] = got.choices
    assert choice.message.content == want.text
    content = choice.logprobs.content
    assert [c.token for c in content] == [e.text for e in want.logprobs]
    np.testing.assert_allclose(
        [c.logprob for c in content], [e.logprob for e in want.logprobs], atol=1e-9
    )
    assert all(len(c.top_logprobs) == 5 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    # The penalties changed the greedy text (else this test would prove nothing).
    plain = zmq_client.generate(messages=CHAT, max_tokens=MAX, temperature=0, ignore_eos=True)
    assert plain.token_ids != want.token_ids
    stream = oai.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX, logprobs=True, top_logprobs=2,
        extra_body=EXTRA, stream=True, **sampling,
    )  # fmt: skip
    tokens = [
        t.token for ch in stream if ch.choices[0].logprobs for t in ch.choices[0].logprobs.content
    ]
    assert tokens == [e.text for e in want.logprobs]
    # min_tokens and stop_token_ids pass through as vLLM's extras.
    eos_first = oai.completions.create(
        model=MODEL, prompt="x", max_tokens=8, temperature=0, logit_bias={"2": 50},
        extra_body={"min_tokens": 3},
    )  # fmt: skip
    assert eos_first.usage.completion_tokens == 4 and eos_first.choices[0].finish_reason == "stop"


def test_echo_scores_from_logprob_start_len_and_keeps_the_cache(oai, zmq_client):
    context = zmq_client.generate("A few-shot context", max_tokens=40, temperature=0).token_ids
    context = [5, 9] + context
    choices = [[101, 102], [103, 104, 105]]

    def score(choice):
        return oai.completions.create(
            model=MODEL, prompt=context + choice, max_tokens=1, temperature=0, logprobs=1,
            echo=True, extra_body={"logprob_start_len": len(context)},
        )  # fmt: skip

    first = score(choices[0])
    for choice in choices:
        got = score(choice)
        lp = got.choices[0].logprobs
        assert lp.token_logprobs[: len(context)] == [None] * len(context)
        assert all(x is not None for x in lp.token_logprobs[len(context) :])
        # The context came from the cache (in whole 4-token pages, as the server's).
        assert got.usage.prompt_tokens_details.cached_tokens >= len(context) - 1 - 3
    again = score(choices[0]).choices[0].logprobs.token_logprobs[len(context) :]
    want = first.choices[0].logprobs.token_logprobs[len(context) :]
    np.testing.assert_allclose(again, want, atol=1e-9)  # cached or not, the same scores

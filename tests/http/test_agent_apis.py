"""The official ``anthropic`` and ``openai`` packages on Anthropic's Messages API and
OpenAI's Responses API: their objects parse, greedy text equals what
``/v1/chat/completions`` answers for the same conversation, usage adds up, and hostile
bodies are 4xx in each API's own error shape.

The tiny model stops at random EOS tokens: both sides of each comparison run the
same greedy request, so they stop at the same one.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest

from tests.http.conftest import MODEL

MAX = 8
# This version of the anthropic package passes sampling parameters as body fields only.
GREEDY = {"temperature": 0}
SYSTEM = "You answer briefly, about data structures and caches."
QUESTION = "What is a radix tree?"
# Closed choices: the random model's free strings would run on to max_tokens.
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Rome", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
}


@pytest.fixture
def claude(http_server):
    with anthropic.Anthropic(
        base_url=http_server.http_url, api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


@pytest.fixture
def oai(base_url):
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(http_server):
    with httpx.Client(base_url=http_server.http_url, timeout=120) as c:
        yield c


def chat(http, messages, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX, "temperature": 0, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------ Messages API
def test_messages_create_and_stream_equal_chat_completions(claude, http):
    want = chat(
        http, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    )
    text = want["choices"][0]["message"]["content"]
    msg = claude.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX,
        extra_body=GREEDY,
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert "".join(b.text for b in msg.content) == text
    finish = want["choices"][0]["finish_reason"]
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    u = msg.usage
    assert (
        u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
        == (want["usage"]["prompt_tokens"])
    )
    assert u.output_tokens == want["usage"]["completion_tokens"]
    assert u.cache_creation_input_tokens == 0  # no breakpoint

    # Streamed, with system as blocks and top_k passed as a body field.
    with claude.messages.stream(
        model=MODEL,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        max_tokens=MAX,
        extra_body={"temperature": 0, "top_k": 1},
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text == final.content[0].text
    assert final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == u.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again


def test_messages_event_sequence(http):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]}  # fmt: skip
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x]
    names = [x[7:] for x in lines if x.startswith("event: ")]
    datas = [json.loads(x[6:]) for x in lines if x.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    middle = names[2:-2]
    if middle:  # the model may end at once
        assert middle[0] == "content_block_start" and middle[-1] == "content_block_stop"
        assert set(middle[1:-1]) == {"content_block_delta"}


def test_count_tokens_is_the_prompt(claude, http):
    messages = [{"role": "user", "content": QUESTION}]
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    counted = claude.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=messages, tools=tools
    )
    want = chat(
        http,
        [{"role": "system", "content": SYSTEM}, *messages],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        tool_choice="none",
    )
    assert counted.input_tokens == want["usage"]["prompt_tokens"]


def test_tool_round_trip(claude, http):
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    question = {"role": "user", "content": "Weather in Rome?"}
    msg = claude.messages.create(
        model=MODEL,
        messages=[question],
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=200,
        extra_body=GREEDY,
    )
    assert msg.stop_reason == "tool_use"
    [call] = [b for b in msg.content if b.type == "tool_use"]
    assert call.name == "get_weather" and set(call.input) == {"city", "days"}
    # The result goes back; the answer continues the conversation as chat would.
    turns = [
        question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}]},
    ]  # fmt: skip
    answer = claude.messages.create(
        model=MODEL, messages=turns, tools=tools, max_tokens=MAX, extra_body=GREEDY,
        tool_choice={"type": "none"},
    )  # fmt: skip
    openai_tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    ]
    want = chat(
        http,
        [
            question,
            {"role": "assistant", "content": "", "tool_calls": [{"id": call.id,
             "type": "function", "function": {"name": "get_weather",
                                              "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
        ],
        tools=openai_tools,
        tool_choice="none",
    )  # fmt: skip
    assert "".join(b.text for b in answer.content) == want["choices"][0]["message"]["content"]
    assert (
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens
        == (want["usage"]["prompt_tokens"])
    )


def test_a_breakpoint_reads_the_cache_on_the_next_call(claude):
    system = [{"type": "text", "text": SYSTEM + " Breakpoint test.",
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]  # fmt: skip
    calls = [
        claude.messages.create(
            model=MODEL,
            system=system,
            max_tokens=2,
            extra_body=GREEDY,
            messages=[{"role": "user", "content": f"Question {i}: {QUESTION}"}],
        )  # fmt: skip
        for i in range(2)
    ]
    first, second = (c.usage for c in calls)
    total = first.input_tokens + first.cache_read_input_tokens + first.cache_creation_input_tokens
    assert total > 0
    # The shared system prompt (~15 tokens) is read from the cache the second time.
    assert second.cache_read_input_tokens >= first.cache_read_input_tokens + 8


@pytest.mark.parametrize(
    "body, status, words",
    [
        ("not json", 400, "JSON"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "messages": []}, 400, "messages"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}]}, 400, "takes no images"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/bmp",
                                         "data": "AAAA"}}]}]}, 400, "media_type"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}, 400,
         "image source"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "video", "url": "x"}]}]}, 400, "does not match"),
        ({"model": MODEL, "max_tokens": "4", "messages": [{"role": "user", "content": "x"}]},
         400, "max_tokens"),
        ({"model": MODEL, "max_tokens": 2**70, "messages": [{"role": "user", "content": "x"}]},
         400, "max_tokens"),
        ({"model": MODEL, "max_tokens": 4, "top_k": -5, "messages": [
            {"role": "user", "content": "x"}]}, 400, "top_k"),
        ({"model": MODEL, "max_tokens": 4, "tool_choice": {"type": "any"},
          "messages": [{"role": "user", "content": "x"}]}, 400, "tool_choice needs tools"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x",
          "cache_control": {"type": "ephemeral", "ttl": "99y"}}]}, 400, "cache_control"),
        ({"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
         404, "nope"),
        ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "assistant"),
    ],
)  # fmt: skip
def test_hostile_messages_are_4xx_in_anthropics_shape(http, body, status, words):
    kw = {"content": body} if isinstance(body, str) else {"json": body}
    r = http.post("/v1/messages", **kw)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] in (
        "invalid_request_error", "not_found_error")  # fmt: skip
    assert words in err["error"]["message"]


def test_the_official_client_sees_a_bad_request(claude):
    image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}
    with pytest.raises(anthropic.BadRequestError, match="takes no images"):
        claude.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [image]}]
        )
    r = httpx.post(
        str(claude.base_url) + "/v1/messages/count_tokens",
        json={"model": MODEL, "messages": "x"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["type"] == "error"


# ------------------------------------------------------------------ Responses API
def test_responses_create_stream_and_continue(oai, http):
    first_turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    want = chat(http, first_turn)
    text = want["choices"][0]["message"]["content"]
    r1 = oai.responses.create(
        model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=MAX, temperature=0
    )
    assert r1.object == "response" and r1.model == MODEL
    assert r1.output_text == text
    assert r1.status == ("incomplete" if want["choices"][0]["finish_reason"] == "length"
                         else "completed")  # fmt: skip
    assert r1.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r1.usage.output_tokens == want["usage"]["completion_tokens"]

    stream = oai.responses.create(
        model=MODEL, instructions=SYSTEM, input=[{"role": "user", "content": QUESTION}],
        max_output_tokens=MAX, temperature=0, stream=True, store=False,
    )  # fmt: skip
    events = list(stream)
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].response.output_text == text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0

    # A continuation: the earlier turns come from the store, and from the prefix cache.
    follow = "Say more."
    r2 = oai.responses.create(
        model=MODEL, instructions=SYSTEM, input=follow, previous_response_id=r1.id,
        max_output_tokens=MAX, temperature=0,
    )  # fmt: skip
    want2 = chat(
        http, [*first_turn, {"role": "assistant", "content": text},
               {"role": "user", "content": follow}],
    )  # fmt: skip
    assert r2.output_text == want2["choices"][0]["message"]["content"]
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens == want2["usage"]["prompt_tokens"]
    assert r2.usage.input_tokens_details.cached_tokens >= want["usage"]["prompt_tokens"] - 4
    # The streamed one was not stored.
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        oai.responses.create(
            model=MODEL, input="x", previous_response_id=events[-1].response.id,
            max_output_tokens=2,
        )  # fmt: skip


def test_responses_function_calls(oai, http):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = oai.responses.create(
        model=MODEL, input="Weather in Rome?", tools=tools, max_output_tokens=200,
        temperature=0, tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "days"}
    # The result as an item of the continuation.
    r2 = oai.responses.create(
        model=MODEL, previous_response_id=r.id, tools=tools, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}],
        max_output_tokens=MAX, temperature=0,
    )  # fmt: skip
    want = chat(
        http,
        [{"role": "user", "content": "Weather in Rome?"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id,
          "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}]},
         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        tool_choice="none",
    )  # fmt: skip
    assert r2.output_text == want["choices"][0]["message"]["content"]


def test_a_prefill_only_call_warms_the_prefix(oai, http):
    prompt = "Warm this long shared context about radix trees, pages and eviction policies."
    warm = oai.responses.create(
        model=MODEL, input=prompt, max_output_tokens=0,
        extra_body={"prompt_cache_retention": "in_memory", "prompt_cache_key": "session-1"},
    )  # fmt: skip
    assert warm.output == [] and warm.usage.output_tokens == 0 and warm.usage.input_tokens > 8
    after = chat(http, [{"role": "user", "content": prompt}], prompt_cache_key="session-1",
                 prompt_cache_retention="24h")  # fmt: skip
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] >= warm.usage.input_tokens - 4


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": 5}, "input"),
        ({"model": MODEL, "input": []}, "input must not be empty"),
        ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x"}]}]}, "takes no images"),
        ({"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "file_id": "file-1"}]}]}, "file_id"),
        ({"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_file", "file_id": "file-1"}]}]}, "input_file"),
        ({"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, "no stored"),
        ({"model": MODEL, "input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "prompt_cache_retention": "forever"}, "retention"),
        ({"model": MODEL, "input": "x", "tool_choice": "required"}, "tool_choice needs tools"),
        ({"model": MODEL, "input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ],
)  # fmt: skip
def test_hostile_responses_are_400(http, body, words):
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


# ------------------------------------------------------------------ without a server
def test_anthropic_usage_splits_the_prompt_by_what_retention_wrote():
    """cache_read: served from the cache; cache_creation: what a request with
    breakpoints computed and had retained (retained_tokens less what it read)."""
    from radixserve.http.anthropic_schema import MessagesRequest
    from radixserve.http.generation import Generation
    from radixserve.http.messages import _MessageFormat, chat_request
    from radixserve.sampling_params import SamplingParams

    def usage(system, served):
        body = MessagesRequest.model_validate(
            {
                "model": MODEL,
                "max_tokens": 4,
                "system": system,
                "messages": [{"role": "user", "content": "hi"}],
            }  # fmt: skip
        )
        gen = Generation(None, None, SamplingParams(max_tokens=4))  # type: ignore[arg-type]
        gen.choices[0].usage = served
        state = SimpleNamespace(tool_call_parser=None)
        return _MessageFormat(state, body, chat_request(body), gen).usage()  # type: ignore[arg-type]

    served = {"prompt_tokens": 100, "completion_tokens": 4, "cached_tokens": 40,
              "retained_tokens": 96}  # fmt: skip
    marked = [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]
    assert usage(marked, served) == {"input_tokens": 4, "cache_creation_input_tokens": 56,
                                     "cache_read_input_tokens": 40, "output_tokens": 4}  # fmt: skip
    # The hint was not applied (a cap, or an eviction policy without retention).
    assert usage(marked, {**served, "retained_tokens": 0})["cache_creation_input_tokens"] == 0
    # No breakpoint: nothing is written under retention, whatever is cached.
    plain = usage("s", {**served, "retained_tokens": 0})
    assert plain["input_tokens"] == 60 and plain["cache_creation_input_tokens"] == 0
    # The longest TTL among the breakpoints becomes the retention hint.
    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 4,
            "system": marked,
            "tools": [
                {
                    "name": "f",
                    "input_schema": {"type": "object"},
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                }
            ],
            "messages": [{"role": "user", "content": "hi"}],
        }  # fmt: skip
    )
    assert chat_request(body).sampling(4).cache_retention == (50, 3600.0)


def test_the_response_store_is_bounded_by_count_and_age(monkeypatch):
    from radixserve.http import response_store
    from radixserve.http.response_store import ResponseStore

    now = [1000.0]
    monkeypatch.setattr(response_store.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_responses=2, max_age_s=60.0)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], None)
    assert len(store) == 2 and store.get("r0", None) is None  # the oldest went first
    assert store.get("r1", None) is not None and store.get("r1", "tenant") is None
    now[0] += 61.0
    assert store.get("r2", None) is None and len(store) == 0 and store.chars == 0  # too old
    # The size bound: conversations' JSON text in all.
    small = ResponseStore(max_chars=100)
    one = [{"role": "user", "content": "x" * 40}]  # 73 characters of JSON
    small.put("a", one, None)
    small.put("b", one, None)
    assert small.get("a", None) is None and small.get("b", None) is not None
    small.put("huge", [{"role": "user", "content": "x" * 200}], None)  # never kept
    assert small.get("huge", None) is None and small.get("b", None) is not None


@pytest.mark.timeout(300)
def test_fuzzed_bodies_on_both_routes_are_4xx_never_5xx(http):
    """Valid Messages and Responses bodies with one to three fields replaced by
    hostile values (``test_fuzz.WILD``), truncated, or not JSON objects: a success or
    a 4xx in the route's own error shape; the server serves afterwards."""
    import random

    from tests.http.test_fuzz import WILD

    rng = random.Random(2027)
    messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    responses = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
    fields = {
        # max_tokens stays small (a huge one is valid and slow): its bounds are tested above
        "/v1/messages": ["model", "messages", "system", "tools", "tool_choice", "stop_sequences",
                         "top_k", "stream", "metadata", "thinking", "cache_salt"],
        "/v1/responses": ["model", "input", "instructions", "tools", "tool_choice", "store",
                          "previous_response_id", "prompt_cache_key",
                          "prompt_cache_retention", "stream", "text", "include"],
    }  # fmt: skip
    refused = 0
    for _ in range(80):
        path = rng.choice(sorted(fields))
        body = dict(messages if path == "/v1/messages" else responses)
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(fields[path])] = rng.choice(WILD)
        text = json.dumps(body)
        if rng.random() < 0.15:
            text = text[: rng.randint(0, len(text))]
        r = http.post(path, content=text, headers={"content-type": "application/json"})
        assert r.status_code < 500, (path, text[:200], r.text[:300])
        if r.status_code >= 400:
            refused += 1
            err = r.json()
            message = err["error"]["message"]
            assert (err.get("type") == "error") == (path == "/v1/messages") and message
    assert refused > 25
    ok = http.post("/v1/messages", json=messages)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2


def test_metrics_show_what_retention_holds_and_refuses():
    """The scheduler's retention stats (a pool under the priority policy, one hint
    applied, one past the tenant's cap) reach /metrics."""
    from prometheus_client import generate_latest

    from radixserve.http.metrics import Metrics
    from radixserve.sampling_params import SamplingParams
    from tests.scheduler.test_scheduler import make, run

    sched, worker = make(num_pages=64, page_size=4, radix_eviction_policy="priority",
                         max_retained_share=0.25)  # fmt: skip
    for i in range(2):  # 10 pages each: the second would take the tenant past 16
        hint = SamplingParams(max_tokens=1, temperature=0.0, cache_retention=[50, 60.0])
        sched.add_request(f"r{i}", [10 + i] * 40, hint)
        run(sched, worker)
    metrics = Metrics("m")
    metrics._apply(sched.stats())
    text = generate_latest(metrics.registry).decode()
    for scope, value in (("total", 10), ("max_tenant", 10), ("cap_tenant", 16),
                         ("cap_total", 51)):  # fmt: skip
        assert f'radixserve:retained_pages{{model_name="m",scope="{scope}"}} {value}.0' in text
    assert 'radixserve:retention_clipped_total{model_name="m"} 1.0' in text


def test_anthropics_api_key_header_opens_the_routes():
    from radixserve.http.auth import Keys
    from radixserve.http.errors import HTTPError

    keys = Keys(api_key="k1", admin_key="k2")
    for headers in ({"x-api-key": "k1"}, {"x-api-key": "k2"}, {"authorization": "Bearer k1"}):
        keys.check(SimpleNamespace(headers=headers))  # type: ignore[arg-type]
    for headers in ({"x-api-key": "nope"}, {"x-api-key": ""}, {}):
        with pytest.raises(HTTPError) as e:
            keys.check(SimpleNamespace(headers=headers))  # type: ignore[arg-type]
        assert e.value.status == 401
    with pytest.raises(HTTPError):  # the admin routes need the admin key
        keys.check(SimpleNamespace(headers={"x-api-key": "k1"}), admin=True)  # type: ignore[arg-type]

"""SGLang's native API and the tokenizer routes on the shared HTTP server.

``/generate``'s greedy outputs equal the in-process Engine's (texts, token ids, usage),
whole, batched and streamed (the cumulative stream events end with the whole answer);
its logprobs equal ``/v1/completions``'; each route's request and response carry the
fields SGLang's (and, for ``/tokenize``, ``/detokenize``, ``/reset_prefix_cache``,
vLLM's) documentation gives them; bad bodies are 400s naming the field.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from radixserve import SamplingParams
from radixserve.http.sglang_schema import GenerateRequest
from tests.http.conftest import MODEL
from tests.serving.conftest import engine  # noqa: F401  (a shared fixture)

MAX = 8
GREEDY = {"max_new_tokens": MAX, "temperature": 0, "ignore_eos": True}
META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
        "e2e_latency"}  # fmt: skip


@pytest.fixture
def http(http_server):
    with httpx.Client(base_url=http_server.http_url, timeout=120) as c:
        yield c


def _want(engine, prompts, **extra):  # noqa: F811
    return engine.generate(prompts, SamplingParams(max_tokens=MAX, temperature=0,
                                                   ignore_eos=True, **extra))  # fmt: skip


def test_generate_equals_the_engine(http, engine, zmq_client):  # noqa: F811
    prompts = ["The quick brown fox", "Prefix caching saves"]
    want = _want(engine, prompts)
    r = http.post("/generate", json={"text": prompts[0], "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    one = r.json()
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert (one["text"], one["output_ids"]) == (want[0].text, want[0].token_ids)
    meta = one["meta_info"]
    assert set(meta) == META
    assert meta["finish_reason"] == {"type": "length", "length": MAX}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (want[0].usage.prompt_tokens, MAX)
    assert meta["id"].startswith("http-")
    # A batch: a list, one item per prompt; token ids as prompts; a rid per item.
    r = http.post("/generate", json={"text": prompts, "sampling_params": GREEDY, "rid": "b"})
    batch = r.json()
    assert [(b["text"], b["meta_info"]["id"]) for b in batch] == [
        (want[0].text, "b_0"), (want[1].text, "b_1")]  # fmt: skip
    ids = want[1].token_ids[:5]
    [want_ids] = engine.generate([ids], SamplingParams(max_tokens=MAX, temperature=0,
                                                       ignore_eos=True))  # fmt: skip
    r = http.post("/generate", json={"input_ids": [ids], "sampling_params": [GREEDY]})
    [by_ids] = r.json()
    assert by_ids["output_ids"] == want_ids.token_ids
    assert by_ids["meta_info"]["prompt_tokens"] == 5
    # The second time, the prompt comes from the prefix cache.
    again = http.post("/generate", json={"text": prompts[0], "sampling_params": GREEDY}).json()
    assert again["meta_info"]["cached_tokens"] > 0


def test_generate_stops_with_sglang_finish_reasons(http, engine):  # noqa: F811
    [free] = _want(engine, ["Stop here"])
    stop_id = free.token_ids[2]
    params = {**GREEDY, "stop_token_ids": [stop_id]}
    r = http.post("/generate", json={"text": "Stop here", "sampling_params": params}).json()
    assert r["output_ids"] == free.token_ids[:3]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # Per-prompt sampling params, n differing: items in prompt order, streamed with index.
    body = {"text": ["Stop here", "a b"], "stream": True,
            "sampling_params": [{**GREEDY, "n": 2}, GREEDY]}  # fmt: skip
    with http.stream("POST", "/generate", json=body) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
    finals = {e["index"]: e["output_ids"] for e in events if e["meta_info"]["finish_reason"]}
    assert finals == {0: free.token_ids, 1: free.token_ids, 2: _want(engine, ["a b"])[0].token_ids}
    # n > 1: a list of n samples (greedy: equal).
    r = http.post("/generate", json={"text": "Stop here", "sampling_params": {**GREEDY, "n": 2}})
    assert [x["output_ids"] for x in r.json()] == [free.token_ids] * 2


def test_streamed_events_reassemble_the_whole_answer(http, engine):  # noqa: F811
    [want] = _want(engine, ["Streaming text"])
    body = {"text": "Streaming text", "sampling_params": GREEDY, "stream": True,
            "return_logprob": True}  # fmt: skip
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x.removeprefix("data: ")) for x in lines[:-1]]
    assert len(events) > 1
    # SGLang streams cumulatively: each event's text extends the previous one.
    pieces, seen = [], ""
    for e in events:
        assert e["text"].startswith(seen)
        pieces.append(e["text"][len(seen) :])
        seen = e["text"]
    assert "".join(pieces) == want.text
    last = events[-1]
    assert last["output_ids"] == want.token_ids
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": MAX}
    assert last["meta_info"]["prompt_tokens"] == want.usage.prompt_tokens
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    assert len(last["meta_info"]["output_token_logprobs"]) == MAX
    whole = http.post("/generate", json={**body, "stream": False}).json()
    assert whole["text"] == last["text"]
    streamed = last["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in whole["meta_info"]["output_token_logprobs"]] == [e[1] for e in streamed]
    np.testing.assert_allclose(
        [e[0] for e in whole["meta_info"]["output_token_logprobs"]],
        [e[0] for e in streamed],
        atol=1e-9,
    )
    # A batch streams each item with its index.
    body = {"text": ["a b", "c d"], "sampling_params": GREEDY, "stream": True}
    with http.stream("POST", "/generate", json=body) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
    finals = {e["index"]: e["text"] for e in events if e["meta_info"]["finish_reason"]}
    assert finals == {i: w.text for i, w in enumerate(_want(engine, ["a b", "c d"]))}


def test_logprobs_equal_completions(http, base_url):
    prompt = "Score these words"
    ref = httpx.post(
        base_url + "/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 2,
            "echo": True,
            "ignore_eos": True,
        },  # fmt: skip
        timeout=120,
    ).json()["choices"][0]["logprobs"]
    body = {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 4},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "return_text_in_logprobs": True}  # fmt: skip
    meta = http.post("/generate", json=body).json()["meta_info"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    assert [e[2] for e in entries] == ref["tokens"]
    assert entries[0][0] is None and meta["input_top_logprobs"][0] is None
    np.testing.assert_allclose([e[0] for e in entries[1:]], ref["token_logprobs"][1:], atol=1e-9)
    for top, want in zip(meta["input_top_logprobs"][1:] + meta["output_top_logprobs"],
                         ref["top_logprobs"][1:]):  # fmt: skip
        assert len(top) == 2
        texts = [t[2] for t in top]
        for lp, _, text in top:  # OpenAI's shape maps text to logprob: skip texts two share
            if texts.count(text) == 1:
                assert want[text] == pytest.approx(lp, abs=1e-9)
    # From a later start: the lists begin there (the cache serves the prompt before it).
    meta = http.post("/generate", json={**body, "logprob_start_len": 2}).json()["meta_info"]
    assert [e[2] for e in meta["input_token_logprobs"]] == ref["tokens"][2 : len(entries) - 4]
    np.testing.assert_allclose(
        [e[0] for e in meta["input_token_logprobs"]],
        ref["token_logprobs"][2 : len(entries) - 4],
        atol=1e-9,
    )
    # Without return_text_in_logprobs the text is null; without logprob_start_len no prompt.
    body.update(return_text_in_logprobs=False, logprob_start_len=-1, top_logprobs_num=0)
    meta = http.post("/generate", json=body).json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and "output_top_logprobs" not in meta
    assert [e[2] for e in meta["output_token_logprobs"]] == [None] * 4


@pytest.mark.parametrize(
    "body, words",
    [
        ({"sampling_params": GREEDY}, "exactly one of text or input_ids"),
        ({"text": "x", "input_ids": [1]}, "exactly one of text or input_ids"),
        ({"text": "x", "sampling_params": {"max_new_token": 3}}, "max_new_token"),
        ({"text": "x", "sampling_params": {"temperature": "0"}}, "temperature"),
        ({"text": "x", "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
        ({"text": "x", "sampling_params": {"no_stop_trim": True}}, "no_stop_trim"),
        ({"text": "x", "image_data": "cat.png"}, "takes no images"),  # a text model
        ({"text": ["a", "b"], "sampling_params": [GREEDY]}, "sampling_params has 1 entries"),
        ({"text": ["a", "b"], "rid": ["r", "r"]}, "rid"),
        ({"text": "x", "top_logprobs_num": 2}, "need return_logprob"),
        ({"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= 'a'"}}, "at most one"),
        ({"text": "x", "sampling_params": {"top_p": 3}}, "top_p"),
        ({"text": [], "sampling_params": GREEDY}, "empty"),
    ],
)
def test_bad_generate_bodies_are_400s_naming_the_field(http, body, words):
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


def test_info_health_and_admin_routes(http, http_server):
    info = http.get("/get_model_info").json()
    assert {"model_path", "tokenizer_path", "is_generation"} <= set(info)
    assert info["is_generation"] is True
    for route in ("/get_server_info", "/server_info"):
        server = http.get(route).json()
        assert server["served_model_name"] == MODEL
        assert {"model_path", "context_length", "page_size", "max_total_num_tokens", "version",
                "internal_states"} <= set(server)  # fmt: skip
        assert {"running", "waiting", "pages_cached"} <= set(server["internal_states"][0])
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").json() == {"status": "ok"}
    assert http.post("/flush_cache").status_code == 200
    assert "freed_pages" in http.post("/reset_prefix_cache").json()
    assert http.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
    assert http.post("/abort_request", json={}).status_code == 400


@pytest.mark.parametrize(
    "prompts, abort", [("long", {"rid": "to-abort"}), (["long", "longer"], {"abort_all": True})]
)
def test_abort_request_ends_generate_requests(http, http_server, zmq_client, prompts, abort):
    import threading

    long = {**GREEDY, "max_new_tokens": 400}
    body = {"text": prompts, "rid": "to-abort", "sampling_params": long}
    out = {}
    t = threading.Thread(target=lambda: out.update(r=http.post("/generate", json=body).json()))
    t.start()
    with httpx.Client(base_url=http_server.http_url, timeout=60) as admin:
        while t.is_alive():
            assert admin.post("/abort_request", json=abort).status_code == 200
            t.join(0.05)
    items = out["r"] if isinstance(out["r"], list) else [out["r"]]
    assert len(items) == (len(prompts) if isinstance(prompts, list) else 1)
    for item in items:
        assert item["meta_info"]["finish_reason"]["type"] == "abort"
        assert item["meta_info"]["completion_tokens"] < 400


def test_tokenize_and_detokenize_in_both_dialects(http, zmq_client):
    text = "Hello radix tree"
    ids = zmq_client.tokenize(text)
    r = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r == {"tokens": ids, "count": len(ids), "max_model_len": 512, "token_strs": None}
    batch = http.post("/tokenize", json={"prompt": [text, "x"]}).json()  # SGLang's batch
    assert batch["tokens"][0] == ids and batch["count"] == [len(ids), len(batch["tokens"][1])]
    chat = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": chat}).json()  # vLLM's chat form
    assert r["tokens"] == zmq_client.tokenize(messages=chat)
    back = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back == {"text": zmq_client.detokenize(ids), "prompt": zmq_client.detokenize(ids)}
    assert text in back["text"]
    many = http.post("/detokenize", json={"tokens": [ids, ids]}).json()
    assert many["text"] == [back["text"]] * 2
    # Bad bodies name the field; a token outside the vocabulary is the tokenizer's 400.
    for bad, words in [
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "return_token_strs": True}, "return_token_strs"),
        ({}, "exactly one of prompt or messages"),
    ]:
        r = http.post("/tokenize", json=bad)
        assert r.status_code == 400 and words in r.json()["error"]["message"]
    r = http.post("/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert http.post("/detokenize", json={"model": "other", "tokens": [1]}).status_code == 404


def test_generate_request_schema_maps_sglang_names():
    body = GenerateRequest.model_validate(
        {
            "text": "x",
            "sampling_params": {
                "max_new_tokens": None,
                "min_new_tokens": 2,
                "sampling_seed": 7,
                "json_schema": '{"type": "object"}',
                "top_k": -1,
            },
        }  # fmt: skip
    )
    [plan] = body.plans(context_len=99)
    sp = plan.sampling
    assert (sp.max_tokens, sp.min_tokens, sp.seed, sp.top_k) == (99, 2, 7, -1)
    assert sp.structured.kind == "json_schema"
    assert GenerateRequest.model_validate({"text": "x"}).plans(99)[0].sampling.max_tokens == 128
    # A gateway re-serializing SGLang's whole GenerateReqInput: fields at their
    # defaults are dropped, a field that asks for something is still refused.
    gateway = {"text": "x", "return_hidden_states": False, "background": False,
               "no_logs": False, "lora_path": None, "session_params": {}, "model": "m"}  # fmt: skip
    assert GenerateRequest.model_validate(gateway).model == "m"
    with pytest.raises(ValueError, match="return_hidden_states"):
        GenerateRequest.model_validate({"text": "x", "return_hidden_states": True})
    # SGLang's frontend sends an empty stop_regex list with every gen: it means none.
    empty = {"text": ["x", "y"], "sampling_params": {"stop_regex": []}, "priority": [3, -1]}
    plans = GenerateRequest.model_validate(empty).plans(99)
    assert [p.sampling.priority for p in plans] == [3, -1]


def test_the_sglang_frontends_requests(http, engine, zmq_client):  # noqa: F811
    """What ``sglang.lang``'s RuntimeEndpoint (``sgl.function`` programs) sends: its
    model lookup, cache flush, prefix caching, ``gen`` with every field its sampling
    parameters carry, and ``select``'s choice scoring."""
    assert "model_path" in http.get("/get_model_info").json()
    assert http.post("/flush_cache", json={"empty_cache": True}).status_code == 200
    prefix = "Q: Is a radix tree a trie? A:"
    cached = http.post("/generate", json={"text": prefix, "sampling_params": {"max_new_tokens": 0}})
    meta = cached.json()["meta_info"]
    assert cached.json()["text"] == "" and meta["completion_tokens"] == 0
    prompt_len = meta["prompt_tokens"]
    # gen: the frontend's sampling fields, unset ones as it sends them.
    params = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
              "max_new_tokens": MAX, "min_new_tokens": 0, "n": 1, "stop": [],
              "stop_token_ids": [], "stop_regex": None, "temperature": 0, "top_p": 1.0,
              "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
              "ignore_eos": True, "regex": None, "json_schema": None}  # fmt: skip
    r = http.post("/generate", json={"text": prefix, "sampling_params": params})
    assert r.json()["text"] == _want(engine, [prefix])[0].text
    # select: each choice's prompt scored from two tokens before the shared prefix's end.
    choices = [" yes", " no"]
    start = max(prompt_len - 2, 0)
    body = {"text": [prefix + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "return_text_in_logprobs": True,
            "logprob_start_len": start}  # fmt: skip
    items = http.post("/generate", json=body).json()
    assert isinstance(items, list), items
    for choice, item in zip(choices, items):
        got = item["meta_info"]["input_token_logprobs"]
        want = zmq_client.generate(prefix + choice, max_tokens=0, prompt_logprobs=0,
                                   logprob_start_len=start).prompt_logprobs[start:]  # fmt: skip
        assert [(e[1], e[2]) for e in got] == [(w.token_id, w.text) for w in want]
        np.testing.assert_allclose([e[0] for e in got], [w.logprob for w in want], atol=1e-9)
        assert item["meta_info"]["output_token_logprobs"] == []


FUZZ_BODIES = 150
WILD = [
    None, True, -1, 0, 1, 21, 2**31, 2**63, -(2**64), 1e308, "", "x" * 300, [], [None], [[]],
    [[1, 2], "a"], {}, {"max_new_tokens": "3"}, [{"n": 0}], {"json_schema": "{"},
    {"regex": "("}, {"stop": [1]}, {"top_k": 2**40}, list(range(40)), [-3, 10**12], "auto",
]  # fmt: skip
FIELDS = {
    "/generate": ["text", "input_ids", "sampling_params", "rid", "return_logprob",
                  "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                  "stream", "cache_salt", "lora_path"],
    "/tokenize": ["prompt", "messages", "add_special_tokens", "model", "return_token_strs"],
    "/detokenize": ["tokens", "skip_special_tokens", "model"],
    "/abort_request": ["rid", "abort_all"],
}  # fmt: skip
BASES = {
    "/generate": {"text": "fuzz", "sampling_params": {"max_new_tokens": 2}},
    "/tokenize": {"prompt": "fuzz"},
    "/detokenize": {"tokens": [1, 2]},
    "/abort_request": {"rid": "nothing"},
}


def test_hostile_bodies_get_4xx_never_500(http, zmq_client):
    import random

    rng = random.Random(3407)
    statuses: dict[int, int] = {}
    for _ in range(FUZZ_BODIES):
        path = rng.choice(sorted(FIELDS))
        body = dict(BASES[path])
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS[path])] = rng.choice(WILD)
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body, r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"]
    assert statuses.get(400, 0) > FUZZ_BODIES // 3, statuses  # the hostile bodies were refused

"""Tool calls in free output (``tool_choice: "auto"``), read by each ``--tool-call-parser``.

Without a server: outputs written in each model family's documented format (content
before the calls, several calls, calls cut short, text that only looks like a call) are
read into the expected content and calls, whole and streamed in pieces of every size,
and the streamed deltas reassemble to the whole answer. With the shared server (started
with ``hermes``): the tiny model's output, constrained to each format by a regex, is read
back into the call the regex let it choose; chat with ``tool_choice: "auto"`` returns
those calls (streamed and not, equal), plain content when the model writes none, and
without a parser "auto" stays a 400.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from radixserve.cli import build_parser
from radixserve.http.openai_schema import ChatCompletionRequest
from radixserve.http.tool_parsers import PARSERS, AutoToolReader
from tests.http.conftest import MODEL, TOOL_CALL_PARSER

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "metric": {"type": "boolean"}, "hours": {"type": "array"}},
    "required": ["city"],
}  # fmt: skip
TOOLS = {"get_weather": WEATHER, "ping": None}
W1 = {"city": "Rome", "days": 3}
W2 = {"city": "Oslo", "days": 1}

# (parser, output, content, calls as (name, arguments)): each family's format as its
# model card and chat template document it.
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>',
     None, [("get_weather", W1)]),
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>',
     "Let me check.\n", [("get_weather", W1), ("get_weather", W2)]),
    ("hermes", "The weather is <b>sunny</b> and <tool> is a word.", "The weather is <b>sunny</b> and <tool> is a word.", []),
    ("hermes", "<tool_call>\nnot json at all", "<tool_call>\nnot json at all", []),
    ("hermes", '<tool_call>\n{"name": "ping"}\n</tool_call>', None, [("ping", {})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}', None, [("get_weather", W1)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}', None, [("get_weather", W1), ("get_weather", W2)]),
    ("llama3_json", "Rome is sunny {today}.", "Rome is sunny {today}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}]', None, [("get_weather", W1), ("get_weather", W2)]),
    ("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 3}', "Sure. ", [("get_weather", W1)]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Rome", "days": 3}[TOOL_CALLS]get_weather{"city": "Oslo", "days": 1}',
     None, [("get_weather", W1), ("get_weather", W2)]),
    ("mistral", "No [TOOL] here.", "No [TOOL] here.", []),
    # [TOOL_CALLS] is a control token, left out of generated text: the array alone.
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}]', None, [("get_weather", W1)]),
    ("mistral", "[1, 2] are numbers.", "[1, 2] are numbers.", []),
    ("mistral", '[{"a": 1}] is JSON.', '[{"a": 1}] is JSON.', []),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", None, [("get_weather", W1)]),
    ("qwen3_xml", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
     "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
     "I'll look.\n", [("get_weather", {"city": "New York", "metric": True, "hours": [1, 2]})]),
    ("qwen3_xml", "<tool_call>\n<function=ping>\n</function>\n</tool_call>", None, [("ping", {})]),
]  # fmt: skip


def read_whole(parser: str, text: str, parallel: bool = True) -> dict:
    return AutoToolReader(PARSERS[parser](TOOLS), parallel).message(text)


def read_streamed(parser: str, text: str, size: int) -> tuple[str | None, list[list]]:
    """Content and calls (id, name, arguments) put together from the deltas."""
    reader = AutoToolReader(PARSERS[parser](TOOLS))
    content, calls = "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        delta = reader.delta(piece, final=k == len(pieces) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:  # a call opens with its id, type and whole name
                assert d["index"] == len(calls) and d["type"] == "function"
                calls.append([d["id"], d["function"]["name"], ""])
            calls[d["index"]][2] += d["function"]["arguments"]
    return content or None, calls


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_each_format_is_read_whole_and_streamed_alike(parser, text, content, calls):
    whole = read_whole(parser, text)
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in whole.get("tool_calls", [])]  # fmt: skip
    assert got == calls
    assert whole["content"] == (content if calls else text)
    for size in (1, 2, 3, 7, len(text)):
        streamed_content, streamed = read_streamed(parser, text, size)
        assert streamed_content == (content if calls else text), size
        assert [(name, args) for _, name, args in streamed] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls", [])
        ], size


def test_parser_details():
    # Only the first call when parallel_tool_calls is false.
    text = CASES[1][1]
    assert len(read_whole("hermes", text, parallel=False)["tool_calls"]) == 1
    # Mistral's templates need 9-character ids; the others are OpenAI's call_ ids.
    [call] = read_whole("mistral", 'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')[
        "tool_calls"
    ]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    assert read_whole("hermes", CASES[0][1])["tool_calls"][0]["id"].startswith("call_")
    # A call cut short (max_tokens) is a call with the arguments so far.
    cut = CASES[0][1][:60]
    [call] = read_whole("hermes", cut)["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert CASES[0][1].find(call["function"]["arguments"]) > 0
    # Streamed content never shows the beginning of a marker it later turns out to be.
    reader = AutoToolReader(PARSERS["hermes"](TOOLS))
    assert reader.delta("Hi <tool_", final=False) == {"content": "Hi "}
    # qwen3_xml types values by the tool's schema; an unknown parameter stays text.
    xml = "<tool_call><function=get_weather><parameter=days>x</parameter><parameter=z>7</parameter></function></tool_call>"  # fmt: skip
    args = json.loads(read_whole("qwen3_xml", xml)["tool_calls"][0]["function"]["arguments"])
    assert args == {"days": "x", "z": "7"}


def test_the_flag_offers_every_parser():
    [action] = [a for a in build_parser()._subparsers._group_actions[0].choices["launch"]._actions
                if a.dest == "tool_call_parser"]  # fmt: skip
    assert set(action.choices) == set(PARSERS)


def test_auto_is_refused_without_a_parser():
    body = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
        }  # fmt: skip
    )
    assert "--tool-call-parser" in body.unsupported()
    assert body.unsupported("hermes") is None
    assert body.auto_calling("hermes") is not None and body.auto_calling(None) is None


# -------------------------------------------------------------- with the server
CITY, DAYS = "(Rome|Paris|Oslo)", "[1-7]"
CALL = r'\{"name": "get_weather", "(arguments|parameters)": \{"city": "CITY", "days": DAYS\}\}'
# Each format as a regex whose blanks the tiny model fills: a constrained call.
FORMATS = {
    "hermes": r"(Sure\. )?<tool_call>\n" + CALL.replace("(arguments|parameters)", "arguments")
    + r"\n</tool_call>",
    "llama3_json": CALL.replace("(arguments|parameters)", "parameters"),
    "mistral": r"\[TOOL_CALLS\]\[" + CALL.replace("(arguments|parameters)", "arguments") + r"\]",
    "qwen3_xml": r"<tool_call>\n<function=get_weather>\n<parameter=city>\nCITY\n</parameter>\n"
    r"<parameter=days>\nDAYS\n</parameter>\n</function>\n</tool_call>",
}  # fmt: skip
FORMATS = {k: v.replace("CITY", CITY).replace("DAYS", DAYS) for k, v in FORMATS.items()}
CHAT = [{"role": "user", "content": "Weather in Rome?"}]
TOOL_DEFS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture
def http(http_server):
    with httpx.Client(base_url=http_server.http_url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_the_tiny_models_constrained_calls_round_trip(http, parser):
    body = {"model": MODEL, "prompt": "Weather?", "max_tokens": 300, "temperature": 0.8,
            "seed": 5, "regex": FORMATS[parser]}  # fmt: skip
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert re.fullmatch(FORMATS[parser], text), text
    [call] = read_whole(parser, text)["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather"
    assert args["city"] in text and f"{args['days']}" in text and set(args) == {"city", "days"}
    assert read_streamed(parser, text, 3)[1][0][1:] == [
        "get_weather",
        call["function"]["arguments"],
    ]


def test_chat_auto_reads_the_servers_format_streamed_and_whole(http):
    assert TOOL_CALL_PARSER == "hermes"
    body = {"model": MODEL, "messages": CHAT, "tools": TOOL_DEFS, "tool_choice": "auto",
            "max_tokens": 300, "temperature": 0, "regex": FORMATS["hermes"]}  # fmt: skip
    whole = http.post("/v1/chat/completions", json=body).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    args = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []))
    names = [t["function"]["name"] for d in deltas for t in d.get("tool_calls", []) if "id" in t]
    assert (content or None, names, args) == (
        choice["message"]["content"], ["get_weather"], call["function"]["arguments"])  # fmt: skip
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # No call written: plain content, finish_reason as usual.
    free = http.post("/v1/chat/completions", json={**body, "regex": "[a-z ]{5,20}"}).json()
    choice = free["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["message"]["content"]
    assert choice["finish_reason"] == "stop"

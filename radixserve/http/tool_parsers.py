"""Tool calls read out of free output (``tool_choice: "auto"``), in a model's own format.

``radixserve launch --tool-call-parser NAME`` picks the format, with vLLM's names:

| name | the model writes | models |
|---|---|---|
| ``hermes`` | ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``, repeated | Hermes, Qwen2.5, Qwen3 |
| ``llama3_json`` | ``{"name": N, "parameters": {...}}`` as its whole answer (after ``<|python_tag|>`` when that token is kept), several separated by ``;`` | Llama 3.1-3.3 |
| ``mistral`` | ``[TOOL_CALLS]`` then ``[{"name": N, "arguments": {...}}, ...]`` (or, newer, ``N[ARGS]{...}`` or ``N{...}``, repeated); the array alone when the marker, a control token, was left out of the text | Mistral |
| ``qwen3_xml`` | ``<tool_call><function=N><parameter=P>value</parameter>...</function></tool_call>`` | Qwen3-Coder |

Text before the first call is ``content``; a call's arguments are JSON text (the
model's own for the JSON formats; for ``qwen3_xml``, each parameter's value converted by
the type the tool's schema gives it, as vLLM does).

A parser reads the output so far, again on each new piece, into two things: how much of
it is surely content (a suffix that may begin the call marker is held back), and the
calls found after the marker, each with its name once complete and the arguments' text
so far. Each call's arguments only ever grow by appending, so ``AutoToolReader`` can
stream them as OpenAI does (the call's ``index``, ``id``, ``type`` and ``name`` first,
then pieces of ``arguments``), and the whole answer is the same reader given the whole
text at once: streamed and whole always agree. A call whose name never completes is not
a call: when the output ends without one, everything from the marker on is content.
"""

from __future__ import annotations

import json
import string
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

_JSON = json.JSONDecoder()
_SPACE = " \t\r\n"


@dataclass
class Call:
    """One call as far as the output shows it."""

    name: str | None  # None until the name is complete
    arguments: str  # the arguments' JSON text so far (a prefix of the final one)


class ToolParser(ABC):
    """One model family's tool-call format; ``tools`` maps a function's name to its
    parameters schema."""

    name: ClassVar[str]

    def __init__(self, tools: dict[str, Any] | None = None) -> None:
        self.tools = tools or {}

    @abstractmethod
    def split(self, text: str, final: bool) -> tuple[int, int | None]:
        """``(c, r)``: ``text[:c]`` is content for sure; the calls' text starts at
        ``r`` (None: no call so far)."""

    @abstractmethod
    def calls(self, region: str) -> list[Call]:
        """The calls in ``region``, the text from ``split``'s ``r`` on."""

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def _marker_split(text: str, marker: str, final: bool) -> tuple[int, int | None]:
    """Content runs up to ``marker``; a suffix that may begin it is held back."""
    at = text.find(marker)
    if at >= 0:
        return at, at + len(marker)
    if final:
        return len(text), None
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k, None
    return len(text), None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _scan_object(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None] | None:
    """The top-level fields of the JSON object at ``text[i:]`` (after blanks) as
    ``key -> (start, end)`` spans of their values (``end`` None: the value goes on
    past the text), and the object's end (None: incomplete). None when no object
    starts there."""
    i = _skip_space(text, i)
    if i >= len(text):
        return {}, None
    if text[i] != "{":
        return None
    fields: dict[str, tuple[int, int | None]] = {}
    i += 1
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            return fields, None
        if text[i] == "}":
            return fields, i + 1
        if text[i] == ",":
            i += 1
            continue
        if text[i] != '"':
            return None
        try:
            key, i = _JSON.raw_decode(text, i)
        except ValueError:
            return fields, None  # the key goes on
        i = _skip_space(text, i)
        if i >= len(text):
            return fields, None
        if text[i] != ":":
            return None
        i = _skip_space(text, i + 1)
        if i >= len(text):
            return fields, None
        try:
            _, end = _JSON.raw_decode(text, i)
        except ValueError:
            fields[key] = (i, None)
            return fields, None
        fields[key] = (i, end)
        i = end


def _json_call(text: str, i: int, arg_keys: tuple[str, ...]) -> tuple[Call, int | None] | None:
    """The call ``{"name": N, "arguments": {...}}`` at ``text[i:]`` and where it ends."""
    scanned = _scan_object(text, i)
    if scanned is None:
        return None
    fields, end = scanned
    name = None
    span = fields.get("name")
    if span is not None and span[1] is not None:
        value = json.loads(text[span[0] : span[1]])
        name = value if isinstance(value, str) else None
    arguments = ""
    key = next((k for k in arg_keys if k in fields), None)
    if key is not None:
        start, stop = fields[key]
        arguments = text[start:stop] if stop is not None else text[start:]
    elif end is not None:
        arguments = "{}"  # a complete call without arguments takes none
    return Call(name, arguments), end


class HermesParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> tuple[int, int | None]:
        return _marker_split(text, self.OPEN, final)

    def calls(self, region: str) -> list[Call]:
        out = []
        for segment in region.split(self.OPEN):
            close = segment.find(self.CLOSE)
            body = segment if close < 0 else segment[:close]
            found = _json_call(body, 0, ("arguments",))
            if found is not None:
                out.append(found[0])
        return out


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def split(self, text: str, final: bool) -> tuple[int, int | None]:
        start = _skip_space(text, 0)
        rest = text[start:]
        if rest.startswith(self.TAG):
            return 0, start + len(self.TAG)
        if rest.startswith("{"):
            return 0, start
        if not final and (not rest or self.TAG.startswith(rest)):
            return 0, None  # undecided: blanks, or the tag's beginning
        return len(text), None

    def calls(self, region: str) -> list[Call]:
        out, i = [], 0
        while True:
            i = _skip_space(region, i)
            if region[i : i + 1] == ";":
                i += 1
                continue
            if i >= len(region):
                return out
            found = _json_call(region, i, ("parameters", "arguments"))
            if found is None:
                return out
            out.append(found[0])
            if found[1] is None:
                return out
            i = found[1]


class MistralParser(ToolParser):
    name = "mistral"
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
    _ID_CHARS = string.ascii_letters + string.digits

    def split(self, text: str, final: bool) -> tuple[int, int | None]:
        # [TOOL_CALLS] is a control token in Mistral's vocabularies, which generated text
        # leaves out: an answer that opens with a JSON array of objects is read as calls
        # too (with no named call in it, it is content after all).
        start = _skip_space(text, 0)
        if text.find(self.MARK) < 0 and text[start : start + 1] == "[":
            after = _skip_space(text, start + 1)
            if text[after : after + 1] == "{":
                return 0, start
            if after == len(text) and not final:
                return 0, None  # undecided
        return _marker_split(text, self.MARK, final)

    def call_id(self) -> str:
        # Mistral's chat templates take ids of exactly 9 letters and digits.
        rand = uuid.uuid4().int
        return "".join(self._ID_CHARS[(rand >> (6 * k)) % 62] for k in range(9))

    def calls(self, region: str) -> list[Call]:
        out: list[Call] = []
        for segment in region.split(self.MARK):
            start = _skip_space(segment, 0)
            if segment[start : start + 1] == "[":
                out += self._array(segment, start + 1)
            elif start < len(segment):
                out += self._named(segment[start:])
        return out

    def _array(self, text: str, i: int) -> list[Call]:
        out = []
        while True:
            i = _skip_space(text, i)
            if text[i : i + 1] == ",":
                i += 1
                continue
            if i >= len(text) or text[i] == "]":
                return out
            found = _json_call(text, i, ("arguments",))
            if found is None:
                return out
            out.append(found[0])
            if found[1] is None:
                return out
            i = found[1]

    def _named(self, text: str) -> list[Call]:
        """``N[ARGS]{...}`` or ``N{...}``."""
        brace = text.find("{")
        args_at = text.find(self.ARGS)
        if args_at >= 0 and (brace < 0 or args_at < brace):
            name, start = text[:args_at], args_at + len(self.ARGS)
        elif brace >= 0:
            name, start = text[:brace], brace
        else:
            return []  # the name goes on
        start = _skip_space(text, start)
        try:
            _, end = _JSON.raw_decode(text, start)
            arguments = text[start:end]
        except ValueError:
            arguments = text[start:]
        return [Call(name.strip(), arguments)]


class Qwen3XmlParser(ToolParser):
    name = "qwen3_xml"
    OPEN, FUNCTION, FUNCTION_END = "<tool_call>", "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"

    def split(self, text: str, final: bool) -> tuple[int, int | None]:
        return _marker_split(text, self.OPEN, final)

    def calls(self, region: str) -> list[Call]:
        out = []
        for segment in region.split(self.OPEN):
            call = self._function(segment)
            if call is not None:
                out.append(call)
        return out

    def _function(self, text: str) -> Call | None:
        at = text.find(self.FUNCTION)
        if at < 0:
            return None
        head = at + len(self.FUNCTION)
        close = text.find(">", head)
        if close < 0:
            return None  # the name goes on
        name = text[head:close].strip()
        body = text[close + 1 :]
        end = body.find(self.FUNCTION_END)
        if end >= 0:
            body = body[:end]
        schema = self.tools.get(name)
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        parts, i = [], 0
        while True:
            p = body.find(self.PARAMETER, i)
            if p < 0:
                break
            key_end = body.find(">", p)
            stop = body.find(self.PARAMETER_END, key_end + 1) if key_end >= 0 else -1
            if stop < 0:
                break  # the parameter goes on: it is sent once complete
            key = body[p + len(self.PARAMETER) : key_end].strip()
            value = body[key_end + 1 : stop]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            typed = _typed(value, properties.get(key))
            parts.append(f"{json.dumps(key)}: {json.dumps(typed, ensure_ascii=False)}")
            i = stop + len(self.PARAMETER_END)
        arguments = "{" + ", ".join(parts) + ("}" if end >= 0 else "")
        return Call(name, arguments)


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type asks for (the text itself
    when it does not convert)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if not isinstance(kind, str) or kind == "string":
        return value
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
        if kind == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        if kind == "null" and value.strip().lower() in ("null", "none"):
            return None
        return json.loads(value)  # object, array
    except (ValueError, KeyError):
        return value


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, Qwen3XmlParser)
}


@dataclass
class _Sent:
    id: str
    name: str
    arguments: str = ""


class AutoToolReader:
    """One choice's free output read into OpenAI's chat deltas with ``parser``: content,
    then ``tool_calls``. The interface of ``tools.ToolCallReader``; with
    ``parallel=False`` only the first call is kept."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser, self.parallel = parser, parallel
        self.text = ""
        self.content = ""  # sent so far
        self.sent: list[_Sent] = []

    @property
    def is_call(self) -> bool:
        return bool(self.sent)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The chat delta for ``text``, the output's next piece (``final``: its last);
        ``{}`` while nothing can be sent yet."""
        self.text += text
        content_end, region = self.parser.split(self.text, final)
        calls = [] if region is None else self.parser.calls(self.text[region:])
        calls = [c for c in calls if c.name is not None][: None if self.parallel else 1]
        if final and region is not None and not calls and not self.sent:
            content_end = len(self.text)  # a marker but no call: it was all content
        out: dict[str, Any] = {}
        if content_end > len(self.content):
            piece = self.text[len(self.content) : content_end]
            self.content += piece
            out["content"] = piece
        deltas = [d for d in (self._call_delta(i, c) for i, c in enumerate(calls)) if d]
        if deltas:
            out["tool_calls"] = deltas
        return out

    def _call_delta(self, index: int, call: Call) -> dict[str, Any] | None:
        if index == len(self.sent):
            sent = _Sent(self.parser.call_id(), call.name or "", call.arguments)
            self.sent.append(sent)
            return {
                "index": index,
                "id": sent.id,
                "type": "function",
                "function": {"name": sent.name, "arguments": call.arguments},
            }
        sent = self.sent[index]
        if not call.arguments.startswith(sent.arguments) or call.arguments == sent.arguments:
            return None  # nothing new (arguments only grow)
        piece = call.arguments[len(sent.arguments) :]
        sent.arguments = call.arguments
        return {"index": index, "function": {"arguments": piece}}

    def message(self, text: str) -> dict[str, Any]:
        """The whole output ``text`` as a chat message's content and tool_calls."""
        self.delta(text, final=True)
        if not self.sent:
            return {"role": "assistant", "content": self.content}
        calls = [
            {"id": s.id, "type": "function", "function": {"name": s.name, "arguments": s.arguments}}
            for s in self.sent
        ]
        return {"role": "assistant", "content": self.content or None, "tool_calls": calls}


@dataclass(frozen=True)
class AutoToolCalling:
    """``tool_choice: "auto"`` with a parser: the output is free, each choice's text is
    read by its own ``AutoToolReader``."""

    parser: str
    tools: dict[str, Any]
    parallel: bool = True

    def reader(self) -> AutoToolReader:
        return AutoToolReader(PARSERS[self.parser](self.tools), self.parallel)

"""Function tools as constrained output: a request's tools and tool_choice become one JSON
schema, and the completion that schema produces becomes OpenAI's ``tool_calls``.

Here the model is made to call a tool, by constraining the completion (docs/structured.md),
whatever its own tool-call format; ``tool_choice: "auto"`` instead reads calls out of free
output in the model's format (``tool_parsers.py``, with ``--tool-call-parser``):

- ``tool_choice: {"type": "function", "function": {"name": F}}``: the completion is F's
  arguments, a JSON object following F's ``parameters``.
- ``tool_choice: "required"``: the completion is ``{"name": N, "arguments": {...}}``,
  one object of ``anyOf`` the tools, N each tool's name (a ``const``) and ``arguments``
  that tool's ``parameters``. Each tool's schema moves to the root's ``$defs`` under its
  name, its own ``$ref`` pointers rewritten to follow it there.

Either way a choice makes exactly one call. JSON is generated compactly with properties
in schema order, so a "required" completion starts with ``{"name": "N", "arguments": ``
(tool names are ``[a-zA-Z0-9_-]``: nothing to escape) and ends with ``}``: what lies
between is the arguments' text, streamed as it comes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.sampling_params import StructuredOutput
from radixserve.structured import JSON_SEPARATORS

# OpenAI: a function without parameters takes an empty parameter list.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
# Keywords whose values are JSON data, not schemas: a "$ref" inside them is no pointer.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# How a "required" completion starts: {"name": "N", "arguments": (compact JSON).
_ITEM_SEP, _KEY_SEP = JSON_SEPARATORS
_NAME_PREFIX = f'{{"name"{_KEY_SEP}"'
_ARGUMENTS_PREFIX = f'"{_ITEM_SEP}"arguments"{_KEY_SEP}'


def moved_refs(schema: Any, base: str) -> Any:
    """``schema`` with each local ``$ref`` (``#...``) rewritten as if the schema's root
    were at the JSON pointer ``base`` (``#/$defs/F``) of a larger schema."""
    if isinstance(schema, list):
        return [moved_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = moved_refs(value, base)
    return out


def required_call_schema(functions: dict[str, dict[str, Any] | bool]) -> dict[str, Any]:
    """The schema of one call of any of ``functions`` (name -> parameters schema):
    ``{"name": N, "arguments": {...}}``."""
    defs = {name: moved_refs(params, f"#/$defs/{name}") for name, params in functions.items()}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{name}"}},
            "required": ["name", "arguments"],
        }
        for name in functions
    ]
    return {"anyOf": calls, "$defs": defs}


@dataclass(frozen=True)
class ToolCalling:
    """How a request's completions become tool calls: ``name`` is the function
    tool_choice named (the completion is its arguments), or None for "required" (the
    completion names the function); ``schema`` constrains the completion."""

    schema: dict[str, Any] | bool
    name: str | None = None

    @classmethod
    def named(cls, name: str, parameters: dict[str, Any] | bool) -> ToolCalling:
        return cls(parameters, name)

    @classmethod
    def required(cls, functions: dict[str, dict[str, Any] | bool]) -> ToolCalling:
        return cls(required_call_schema(functions))

    @property
    def structured(self) -> StructuredOutput:
        return StructuredOutput.json(self.schema)

    def reader(self) -> ToolCallReader:
        return ToolCallReader(self.name)


class ToolCallReader:
    """Reads one choice's completion, piece by piece, into OpenAI's chat deltas: the
    call (id, type, name) once its name is known, then the arguments' text.

    A completion without the call's shape (one cut short before its name ended) is
    content instead, all of it.
    """

    def __init__(self, name: str | None) -> None:
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.name = name  # known from the start when tool_choice named the function
        self.arguments = ""  # the arguments' text sent so far
        self.content: str | None = None  # the completion, when it is no call
        self._pending = ""  # read, not yet sent
        self._wrapped = False  # the arguments sit in {"name": N, "arguments": ...}
        self._opened = False  # the call's first delta was sent

    @property
    def is_call(self) -> bool:
        return self.content is None

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The chat delta for ``text``, the completion's next piece (``final``: its
        last); ``{}`` while nothing can be sent yet."""
        if self.content is not None:
            self.content += text
            return {"content": text} if text else {}
        self._pending += text
        if self.name is None and not self._read_name(final):
            return {"content": self.content} if self.content else {}
        args = self._pending
        if self._wrapped and (not final or args.endswith("}")):
            args = args[:-1]  # the wrapper's closing brace, or what may be it
        self._pending = self._pending[len(args) :]
        self.arguments += args
        if self._opened and not args:
            return {}
        return {"tool_calls": [self._call_delta(args)]}

    def _read_name(self, final: bool) -> bool:
        """Take ``{"name": "N", "arguments": `` off the pending text: True once done.
        False while it may still come, or (``content`` set) when it cannot."""
        text = self._pending
        header = _NAME_PREFIX
        if text.startswith(_NAME_PREFIX):
            quote = text.find('"', len(_NAME_PREFIX))
            if quote >= 0:
                header = text[:quote] + _ARGUMENTS_PREFIX
                if text.startswith(header):
                    self.name = text[len(_NAME_PREFIX) : quote]
                    self._pending, self._wrapped = text[len(header) :], True
                    return True
            elif not final:
                return False  # the name goes on
        if final or not header.startswith(text):
            self.content, self._pending = text, ""
        return False

    def _call_delta(self, args: str) -> dict[str, Any]:
        if self._opened:
            return {"index": 0, "function": {"arguments": args}}
        self._opened = True
        return {
            "index": 0,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": args},
        }

    def message(self, text: str) -> dict[str, Any]:
        """The whole completion ``text`` as a chat message's content and tool_calls."""
        self.delta(text, final=True)
        if not self.is_call:
            return {"role": "assistant", "content": self.content}
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}

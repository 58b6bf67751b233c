"""A choice's output as content blocks: text, and tool calls with their arguments.

The chat deltas a tool-call reader makes (``tools.ToolCallReader`` for constrained
calls, ``tool_parsers.AutoToolReader`` for ``tool_choice: "auto"``; content, then
``tool_calls``) become blocks, and the events that build them: a block starts, grows
(text, or a call's arguments' JSON text), stops. Anthropic's Messages API sends these
events as they are (``messages.py``); OpenAI's Responses API names them its own way
(``responses.py``).
"""

from __future__ import annotations

import json
from typing import Any

from radixserve.http.tool_parsers import AutoToolReader
from radixserve.http.tools import ToolCallReader

Event = tuple[str, dict[str, Any]]


class ContentBlocks:
    """A choice's output read into Anthropic content blocks: the chat deltas its tool-call
    reader makes (content, then ``tool_calls``) become text and ``tool_use`` blocks and
    the stream events that build them. The whole answer is the same reader given the
    whole text, so streamed and whole always agree."""

    def __init__(self, reader: ToolCallReader | AutoToolReader | None) -> None:
        self.reader = reader
        self.blocks: list[dict[str, Any]] = []
        self.arguments: list[str] = []  # each block's tool-call arguments' text so far
        self.open = False  # the last block is still being written
        self._by_call: dict[int, int] = {}  # a tool call's index -> its block's

    def feed(self, text: str, final: bool) -> list[Event]:
        """The stream events for the output's next piece ``text``."""
        if self.reader is None:
            delta: dict[str, Any] = {"content": text} if text else {}
        else:
            delta = self.reader.delta(text, final)
        events: list[Event] = []
        if delta.get("content"):
            if not (self.open and self.blocks[-1]["type"] == "text"):
                events += self._start({"type": "text", "text": ""})
            self.blocks[-1]["text"] += delta["content"]
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                events += self._start(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": call["function"]["name"],
                        "input": {},
                    }  # fmt: skip
                )
                self._by_call[call["index"]] = len(self.blocks) - 1
            at = self._by_call[call["index"]]
            piece = call["function"]["arguments"]
            if piece:
                self.arguments[at] += piece
                events.append(self._delta({"type": "input_json_delta", "partial_json": piece}, at))
        if final and self.open:
            events.append(self._stop())
        return events

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = [self._stop()] if self.open else []
        self.blocks.append(block)
        self.arguments.append("")
        self.open = True
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        index = len(self.blocks) - 1
        events.append(("content_block_start", {"index": index, "content_block": start}))
        return events

    def _delta(self, delta: dict[str, Any], at: int | None = None) -> Event:
        index = len(self.blocks) - 1 if at is None else at
        return "content_block_delta", {"index": index, "delta": delta}

    def _stop(self) -> Event:
        self.open = False
        return "content_block_stop", {"index": len(self.blocks) - 1}

    def content(self) -> list[dict[str, Any]]:
        """The blocks as a whole message gives them (each call's ``input`` parsed; a
        call cut short, unparseable, has an empty ``input``)."""
        out = []
        for block, arguments in zip(self.blocks, self.arguments, strict=True):
            if block["type"] == "tool_use":
                try:
                    value = json.loads(arguments) if arguments else {}
                except ValueError:
                    value = {}
                block = {**block, "input": value if isinstance(value, dict) else {}}
            out.append(block)
        return out

    @property
    def is_call(self) -> bool:
        return self.reader is not None and self.reader.is_call

    def chat_message(self) -> dict[str, Any]:
        """The output as the assistant's chat message (the tool calls with their ids),
        as a later turn sends it back."""
        text = "".join(b["text"] for b in self.blocks if b["type"] == "text")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [
            {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": a}}
            for b, a in zip(self.blocks, self.arguments, strict=True)
            if b["type"] == "tool_use"
        ]
        if calls:
            message["tool_calls"] = calls
        return message

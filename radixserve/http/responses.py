"""OpenAI's Responses API: ``POST /v1/responses``.

A request is served as the chat request it maps onto (``responses_schema``), through
the same machinery as ``/v1/chat/completions``: chat template, sampling, tool calls,
generation. The answer is a ``response`` object whose ``output`` holds a ``message``
item (one ``output_text`` part) and a ``function_call`` item per tool call;
``usage.input_tokens_details.cached_tokens`` counts the prompt tokens served from the
prefix cache. ``max_output_tokens: 0`` only prefills: it warms the prompt's prefix in
the cache and returns its usage, with no output.

Continuations: a response made with ``store`` (the default) is kept in the front's
``ResponseStore`` (``response_store.py``): its conversation as chat messages, the
output included, so that a later request naming it as ``previous_response_id`` continues it. The continued prompt
begins with the earlier one's tokens, so it is served from the prefix cache. The store
is bounded by count, size and age (the oldest goes first); a response past a bound, one
made with ``store: false``, or one made under another ``cache_salt`` is a 400 not found.

A stream is OpenAI's event sequence, each event with its ``sequence_number``:
``response.created``, ``response.in_progress``, per output item
``response.output_item.added``, then for a message ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, for a call ``response.function_call_arguments.delta``
..., ``response.function_call_arguments.done``, then ``response.output_item.done``;
last ``response.completed`` (or ``response.incomplete`` when ``max_output_tokens`` cut
it short, ``response.failed`` when the server failed it).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from radixserve import protocol as P
from radixserve.client import ServerError
from radixserve.http.completions import _refused, answer, check, parse
from radixserve.http.content_blocks import ContentBlocks, Event
from radixserve.http.errors import HTTPError, from_validation
from radixserve.http.generation import Generation
from radixserve.http.openai_schema import ChatCompletionRequest
from radixserve.http.responses_schema import ResponsesRequest
from radixserve.http.state import FrontState


async def responses(state: FrontState, request: Request) -> Response:
    body = await parse(state, request, ResponsesRequest)
    why = body.unsupported()
    if why is not None:
        raise HTTPError(400, why)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id, body.cache_salt)
        if stored is None:
            raise HTTPError(
                400,
                f"no stored response {body.previous_response_id[:64]!r}: it was made with "
                "store false, under another cache_salt, or is no longer kept",
                "previous_response_id",
                "previous_response_not_found",
            )
        history = stored.messages
    try:
        chat = ChatCompletionRequest.model_validate(body.chat_body(history))
    except ValidationError as e:
        raise from_validation(e) from None
    lora = await check(state, chat)
    try:
        sampling = chat.sampling(
            body.max_output_tokens if body.max_output_tokens is not None else state.max_context_len
        )
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    messages = chat.messages_as_dicts()
    gen = Generation(
        state.client,
        state.metrics,
        sampling,
        messages=messages,
        tools=chat.tools_as_dicts(),
        cache_salt=chat.cache_salt,
        lora=lora,
        cache_key=chat.prompt_cache_key,
    )
    fmt = _ResponseFormat(state, body, chat, gen, messages)
    return await answer(state, request, [gen], fmt, body.stream)


class _ResponseFormat:
    """The ``response`` object, whole or as its event stream (``completions.answer``)."""

    def __init__(
        self,
        state: FrontState,
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        gen: Generation,
        messages: list[dict[str, Any]],
    ) -> None:
        self.state, self.body, self.chat, self.gen = state, body, chat, gen
        # The conversation to store, without this request's instructions.
        self.history = messages[1:] if body.instructions else messages
        self.calling = chat.tool_calling() or chat.auto_calling(state.tool_call_parser)
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.item_ids: dict[int, str] = {}  # a content block's output item id

    def _blocks(self) -> ContentBlocks:
        return ContentBlocks(None if self.calling is None else self.calling.reader())

    def usage(self) -> dict[str, Any]:
        u = self.gen.usage
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        }

    def _item_id(self, index: int, block: dict[str, Any]) -> str:
        prefix = "fc_" if block["type"] == "tool_use" else "msg_"
        return self.item_ids.setdefault(index, prefix + uuid.uuid4().hex)

    def _item(self, index: int, block: dict[str, Any], arguments: str, status: str):
        if block["type"] == "tool_use":
            return {
                "type": "function_call",
                "id": self._item_id(index, block),
                "call_id": block["id"],
                "name": block["name"],
                "arguments": arguments,
                "status": status,
            }
        parts = [_text_part(block["text"])] if status != "in_progress" else []
        return {
            "type": "message",
            "id": self._item_id(index, block),
            "status": status,
            "role": "assistant",
            "content": parts,
        }

    def _status(self) -> str:
        reason = self.gen.choices[0].finish_reason
        if reason in (None, "abort", "error"):
            return "failed" if reason == "error" else "in_progress"
        return "incomplete" if reason == "length" and self.body.max_output_tokens else "completed"

    def _response(self, blocks: ContentBlocks | None, status: str) -> dict[str, Any]:
        output = []
        if blocks is not None:
            output = [
                self._item(i, b, a, "completed")
                for i, (b, a) in enumerate(zip(blocks.blocks, blocks.arguments, strict=True))
            ]
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.state.served_model_name,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "prompt_cache_retention": body.prompt_cache_retention,
            "store": body.store,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": _tool_choice(body),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": self.usage() if status in ("completed", "incomplete") else None,
        }

    def _finish(self, blocks: ContentBlocks) -> dict[str, Any]:
        status = self._status()
        if self.body.store and status in ("completed", "incomplete"):
            messages = [*self.history, blocks.chat_message()]
            self.state.responses.put(self.id, messages, self.body.cache_salt)
        return self._response(blocks, status)

    def whole(self) -> dict[str, Any]:
        blocks = self._blocks()
        blocks.feed("".join(self.gen.choices[0].text), final=True)
        return self._finish(blocks)

    async def sse(
        self, first: tuple[int, P.Chunk], rest: AsyncIterator[tuple[int, P.Chunk]]
    ) -> AsyncIterator[str]:
        seq = iter(range(1 << 62))

        def event(name: str, **data: Any) -> str:
            payload = {"type": name, "sequence_number": next(seq), **data}
            return f"event: {name}\ndata: {json.dumps(payload)}\n\n"

        yield event("response.created", response=self._response(None, "in_progress"))
        yield event("response.in_progress", response=self._response(None, "in_progress"))
        blocks = self._blocks()
        try:
            pending: tuple[int, P.Chunk] | None = first
            while pending is not None:
                _, chunk = pending
                for e in blocks.feed(chunk.text, final=chunk.finish_reason is not None):
                    for name, data in self._events(blocks, e):
                        yield event(name, **data)
                pending = await anext(rest, None)
        except ServerError as e:
            error = _refused(self.state, e)
            failed = self._response(None, "failed")
            failed["error"] = {"code": "server_error", "message": error.message}
            yield event("response.failed", response=failed)
            return
        finally:
            await rest.aclose()
        response = self._finish(blocks)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield event(done, response=response)

    def _events(self, blocks: ContentBlocks, e: Event) -> list[tuple[str, dict[str, Any]]]:
        """Responses' events for one content-block event."""
        kind, data = e
        index = data["index"]
        block = blocks.blocks[index]
        at = {"output_index": index, "item_id": self._item_id(index, block)}
        call = block["type"] == "tool_use"
        if kind == "content_block_start":
            item = self._item(index, block, "", "in_progress")
            out = [("response.output_item.added", {"output_index": index, "item": item})]
            if not call:
                part = {"content_index": 0, "part": _text_part("")}
                out.append(("response.content_part.added", {**at, **part}))
            return out
        if kind == "content_block_delta":
            delta = data["delta"]
            if call:
                return [("response.function_call_arguments.delta",
                         {**at, "delta": delta["partial_json"]})]  # fmt: skip
            text = {"content_index": 0, "delta": delta["text"], "logprobs": []}
            return [("response.output_text.delta", {**at, **text})]
        item = self._item(index, block, blocks.arguments[index], "completed")
        if call:
            args = {"name": block["name"], "arguments": blocks.arguments[index]}
            out = [("response.function_call_arguments.done", {**at, **args})]
        else:
            text = {"content_index": 0, "text": block["text"], "logprobs": []}
            part = {"content_index": 0, "part": _text_part(block["text"])}
            out = [("response.output_text.done", {**at, **text}),
                   ("response.content_part.done", {**at, **part})]  # fmt: skip
        out.append(("response.output_item.done", {"output_index": index, "item": item}))
        return out


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()

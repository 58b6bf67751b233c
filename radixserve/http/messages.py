"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A Messages request is served as the chat request it maps onto (``anthropic_schema``):
the same chat template, sampling, tool-call handling (constrained calls for ``any`` and
``tool``, the server's ``--tool-call-parser`` for ``auto``) and generation machinery as
``/v1/chat/completions``, so greedy text is the same for the same conversation. Only
the answer's shape differs: content blocks (``text``, ``tool_use``), ``stop_reason``,
and Anthropic's usage and event stream.

Usage: ``cache_read_input_tokens`` are the prompt tokens served from the prefix cache
(every request may hit it, as on the other routes); ``cache_creation_input_tokens``
those a request with ``cache_control`` breakpoints computed and had retained (fewer
when the retention caps clipped its hint, 0 on a server without the ``priority``
eviction policy); ``input_tokens`` the rest of the prompt. The three add
up to the prompt.

A stream is Anthropic's event sequence: ``message_start``, ``ping``, then per content
block ``content_block_start`` / ``content_block_delta`` (``text_delta`` or
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop reason and
the whole usage) and ``message_stop``; a failure after the stream began is an
``error`` event. Errors are Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` (``anthropic_error``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from radixserve import protocol as P
from radixserve.client import ServerError
from radixserve.http.anthropic_schema import CountTokensRequest, MessagesRequest
from radixserve.http.completions import _refused, answer, check, parse
from radixserve.http.content_blocks import ContentBlocks
from radixserve.http.errors import HTTPError, from_validation
from radixserve.http.generation import Generation
from radixserve.http.openai_schema import ChatCompletionRequest
from radixserve.http.state import FrontState

#: Anthropic's error types by status.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(e: HTTPError) -> JSONResponse:
    """The error ``e`` in Anthropic's shape, with its status."""
    return JSONResponse(_error_body(e), status_code=e.status)


def _error_body(e: HTTPError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request serving ``body`` (a 400 for what the server cannot serve)."""
    why = body.unsupported()
    if why is not None:
        raise HTTPError(400, why)
    try:
        return ChatCompletionRequest.model_validate(body.chat_body())
    except ValidationError as e:
        raise from_validation(e) from None


async def messages(state: FrontState, request: Request) -> Response:
    body = await parse(state, request, MessagesRequest)
    chat = chat_request(body)
    lora = await check(state, chat)
    try:
        sampling = chat.sampling(body.max_tokens)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    gen = Generation(
        state.client,
        state.metrics,
        sampling,
        messages=chat.messages_as_dicts(),
        tools=chat.tools_as_dicts(),
        cache_salt=chat.cache_salt,
        lora=lora,
        cache_key=chat.prompt_cache_key,
    )
    return await answer(state, request, [gen], _MessageFormat(state, body, chat, gen), body.stream)


async def count_tokens(state: FrontState, request: Request) -> dict[str, int]:
    """``{"input_tokens": n}``: the prompt's tokens as ``/v1/messages`` would compute them."""
    body = (await parse(state, request, CountTokensRequest)).as_messages_request()
    chat = chat_request(body)
    await check(state, chat)
    try:
        ids = await state.client.tokenize(
            messages=chat.messages_as_dicts(), tools=chat.tools_as_dicts()
        )
    except ServerError as e:
        raise _refused(state, e) from None
    return {"input_tokens": len(ids)}


# --------------------------------------------------------------------- answers
class _MessageFormat:
    """Anthropic's message, whole or as its event stream (for ``completions.answer``)."""

    def __init__(
        self, state: FrontState, body: MessagesRequest, chat: ChatCompletionRequest, gen: Generation
    ) -> None:
        self.state, self.body, self.gen = state, body, gen
        self.calling = chat.tool_calling() or chat.auto_calling(state.tool_call_parser)
        self.id = "msg_" + uuid.uuid4().hex
        self.retains = body.retention_seconds() is not None

    def _blocks(self) -> ContentBlocks:
        return ContentBlocks(None if self.calling is None else self.calling.reader())

    def usage(self) -> dict[str, int]:
        u = self.gen.choices[0].usage or {}
        prompt, cached = u.get("prompt_tokens", 0), u.get("cached_tokens", 0)
        written = max(u.get("retained_tokens", 0) - cached, 0) if self.retains else 0
        return {
            "input_tokens": prompt - cached - written,
            "cache_creation_input_tokens": written,
            "cache_read_input_tokens": cached,
            "output_tokens": self.gen.usage["completion_tokens"],
        }

    def _stop(self, blocks: ContentBlocks) -> tuple[str | None, str | None]:
        """``(stop_reason, stop_sequence)`` of the finished choice."""
        c = self.gen.choices[0]
        if c.finish_reason == "length":
            return "max_tokens", None
        if c.finish_reason != "stop":
            return None, None  # aborted or failed: no reason of Anthropic's fits
        if blocks.is_call:
            return "tool_use", None
        stops = self.body.stop_sequences or []
        if stops and not (c.token_ids and c.token_ids[-1] in self.state.eos_token_ids):
            # A stop string ended it (the tokenizer trims it). Which one is known only
            # when one was given.
            return "stop_sequence", stops[0] if len(stops) == 1 else None
        return "end_turn", None

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]):
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.state.served_model_name,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self.usage(),
        }

    def whole(self) -> dict[str, Any]:
        blocks = self._blocks()
        blocks.feed("".join(self.gen.choices[0].text), final=True)
        return self._message(blocks.content(), self._stop(blocks))

    async def sse(
        self, first: tuple[int, P.Chunk], rest: AsyncIterator[tuple[int, P.Chunk]]
    ) -> AsyncIterator[str]:
        start = self._message([], (None, None))
        start["usage"] = {"input_tokens": 0, "output_tokens": 0}  # known at the end
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        blocks = self._blocks()
        try:
            pending: tuple[int, P.Chunk] | None = first
            while pending is not None:
                _, chunk = pending
                for name, data in blocks.feed(chunk.text, final=chunk.finish_reason is not None):
                    yield _event(name, data)
                pending = await anext(rest, None)
        except ServerError as e:
            yield _event("error", _error_body(_refused(self.state, e)))
            return
        finally:
            await rest.aclose()
        reason, sequence = self._stop(blocks)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield _event("message_delta", {"delta": delta, "usage": self.usage()})
        yield _event("message_stop", {})


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

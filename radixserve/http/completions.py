"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI requests in, OpenAI answers out.

A request becomes one ``Generation`` per prompt (OpenAI lets ``/v1/completions`` take a
batch of prompts; choice ``i`` of prompt ``p`` is answered as index ``p * n + i``).

Streaming answers wait for the first chunk before sending headers, so a request the
server refuses (a prompt longer than the context, say) is still a plain 400. After that
every chunk is one server-sent event; a failure mid-stream is an ``{"error": ...}``
event; the stream always ends with ``data: [DONE]``.

Tools, when given, reach the chat template (the model sees their definitions in its
prompt), whatever ``tool_choice`` is. With a tool_choice that makes the model call one,
each chat choice's completion is read as one tool call (``tools.py``): its message has
``tool_calls`` and no content, and its finish_reason is ``tool_calls``; streamed, the
call's id and name come first, then the arguments' text as it is generated. With
``tool_choice: "auto"`` on a server started with ``--tool-call-parser``, the output is
free and read by that parser (``tool_parsers.py``): content, then any calls the model
wrote in its own format, streamed the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from radixserve import protocol as P
from radixserve.client import ConnectionLost, RequestTimeout, ServerError
from radixserve.http.errors import HTTPError, from_validation
from radixserve.http.generation import Choice, Generation, Outcome
from radixserve.http.logprobs import chat_logprobs, completion_logprobs
from radixserve.http.openai_schema import ChatCompletionRequest, CompletionRequest
from radixserve.http.state import FrontState
from radixserve.http.tool_parsers import AutoToolCalling, AutoToolReader
from radixserve.http.tools import ToolCalling, ToolCallReader
from radixserve.sampling_params import SamplingParams

T = TypeVar("T")
Body = TypeVar("Body", bound=BaseModel)
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is there


class ClientGone(Exception):
    """The HTTP client disconnected; its request was aborted."""


async def parse(state: FrontState, request: Request, cls: type[Body]) -> Body:
    limit = state.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused before it is read
        raise HTTPError(413, f"the body has {declared} bytes; this server accepts {limit}")
    data = await request.body()
    state.large_bodies.read(len(data))
    if len(data) > limit:
        raise HTTPError(413, f"the body has {len(data)} bytes; this server accepts {limit}")
    try:
        return cls.model_validate_json(data)
    except ValidationError as e:
        raise from_validation(e) from None


#: How long the front waits for the server's list of LoRA adapters.
LORA_LIST_TIMEOUT_S = 30.0


async def adapter_of(state: FrontState, model: str) -> str | None:
    """The LoRA adapter ``model`` names (None: the base model, by its served names), as
    vLLM picks adapters by ``model``; 404 for a name the server does not serve. The
    front keeps the names it last saw and asks the server again for one it does not
    know (an adapter unloaded since is refused by the scheduler: a 400)."""
    if state.serves(model):
        return None
    if model not in state.lora_names:
        try:
            loras = await state.client.list_lora_adapters(timeout=LORA_LIST_TIMEOUT_S)
        except (ServerError, RequestTimeout) as e:
            raise HTTPError(503, f"the server did not answer: {e}") from None
        state.lora_names = {a["name"] for a in loras}
    if model not in state.lora_names:
        raise HTTPError(404, f"the model {model!r} does not exist", "model", "model_not_found")
    return model


async def check(state: FrontState, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request's LoRA adapter (None: the base model), once the body is one the
    front serves (else an HTTPError)."""
    lora = await adapter_of(state, body.model)
    chat = isinstance(body, ChatCompletionRequest)
    why = body.unsupported(state.tool_call_parser) if chat else body.unsupported()
    if why is not None:
        raise HTTPError(400, why)
    return lora


def _sampling(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, state: FrontState
) -> SamplingParams:
    try:
        # No max_tokens: generate until EOS or the end of the context.
        return body.sampling(max_tokens if max_tokens is not None else state.max_context_len)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


async def completions(state: FrontState, request: Request) -> Response:
    body = await parse(state, request, CompletionRequest)
    lora = await check(state, body)
    sp = _sampling(body, body.max_tokens, state)
    outcome = Outcome(state.metrics)  # shared: a refused batch counts one error
    gens = []
    for p in body.prompts():
        kind = "prompt" if isinstance(p, str) else "input_ids"
        gens.append(
            Generation(
                state.client,
                state.metrics,
                sp,
                cache_salt=body.cache_salt,
                echo=body.echo,
                lora=lora,
                outcome=outcome,
                cache_key=body.prompt_cache_key,
                **{kind: p},
            )  # fmt: skip
        )
    if not gens:
        raise HTTPError(400, "prompt must not be an empty list", "prompt")
    return await _respond(state, request, body, gens, chat=False)


async def chat_completions(state: FrontState, request: Request) -> Response:
    body = await parse(state, request, ChatCompletionRequest)
    lora = await check(state, body)
    sp = _sampling(body, body.max_new_tokens, state)
    gen = Generation(
        state.client,
        state.metrics,
        sp,
        messages=body.messages_as_dicts(),
        tools=body.tools_as_dicts(),
        cache_salt=body.cache_salt,
        lora=lora,
        cache_key=body.prompt_cache_key,
    )
    return await _respond(state, request, body, [gen], chat=True)


# --------------------------------------------------------------------- answers
async def _respond(
    state: FrontState,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    gens: list[Generation],
    chat: bool,
) -> Response:
    return await answer(state, request, gens, _Format(state, body, gens, chat), body.stream)


async def answer(
    state: FrontState,
    request: Request,
    gens: list[Generation],
    fmt: Any,
    stream: bool,
    on_end: Callable[[], None] | None = None,
) -> Response:
    """Run ``gens`` and answer in ``fmt``'s dialect (``whole()`` for one JSON answer;
    ``sse(first, events)`` for a stream): the OpenAI routes' and SGLang's alike.
    ``on_end`` is called once the request has ended, however it ended (for a stream:
    once the stream is over)."""
    streaming = False
    try:
        if not stream:
            try:
                await _unless_disconnected(request, _all(_drain(g) for g in gens))
            except ServerError as e:
                raise _refused(state, e) from None
            return JSONResponse(fmt.whole())
        events = _merge(gens)
        try:
            first = await _unless_disconnected(request, anext(events))
        except ServerError as e:
            await events.aclose()
            raise _refused(state, e) from None
        except BaseException:
            await events.aclose()
            raise
        response = _EventStream(fmt.sse(first, events), on_end, media_type="text/event-stream")
        streaming = True
        return response
    finally:
        if on_end is not None and not streaming:
            on_end()


def _refused(state: FrontState, e: ServerError) -> HTTPError:
    # While stopping, the tokenizer fails every request in flight: that is a 503, not the
    # client's fault; over the front's requests in flight is a 429; past the request's own
    # request_timeout a 408 (the client's deadline); the front's link to the server lost
    # (the tokenizer died or stopped answering heartbeats) a 503; otherwise the server
    # refused the request's content, unless it says the fault was its own (500).
    message = str(e)
    if state.draining or isinstance(e, ConnectionLost):
        return HTTPError(503, message)
    if message.startswith(P.TOO_MANY_IN_FLIGHT):
        return HTTPError(429, message)
    if message.startswith(P.REQUEST_TIMED_OUT):
        return HTTPError(408, message, "request_timeout", "request_timeout")
    return HTTPError(500 if message.startswith(P.SERVER_FAILED) else 400, message)


class _Format:
    """OpenAI's JSON for completions or chat, whole or as stream chunks."""

    def __init__(self, state: FrontState, body: Any, gens: list[Generation], chat: bool) -> None:
        self.state, self.body, self.gens, self.chat = state, body, gens, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n = body.n
        self.echo = not chat and body.echo
        self.logprobs = body.logprobs if chat else body.logprobs is not None
        self._offsets: dict[int, int] = {}  # streamed text_offset so far, by choice
        self.calling: ToolCalling | AutoToolCalling | None = None
        if chat:  # a constrained call, else with tool_choice "auto" calls in free output
            self.calling = body.tool_calling() or body.auto_calling(state.tool_call_parser)
        self._readers: dict[int, ToolCallReader | AutoToolReader] = {}  # by choice

    def _head(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.state.served_model_name,  # the first name, whichever was asked
        }

    def usage(self) -> dict[str, Any]:
        totals = [g.usage for g in self.gens]
        prompt = sum(u["prompt_tokens"] for u in totals)
        completion = sum(u["completion_tokens"] for u in totals)
        out = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u["cached_tokens"] for u in totals)},
        }
        explains = [u["explain"] for u in totals if "explain" in u]
        if explains:  # ``explain``: one per prompt, in order
            out["explain"] = explains if len(totals) > 1 else explains[0]
        return out

    def whole(self) -> dict[str, Any]:
        choices = []
        for p, gen in enumerate(self.gens):
            for c in gen.choices:
                text = "".join(c.text)
                out: dict[str, Any] = {"index": p * self.n + c.index}
                finish = c.finish_reason
                if self.calling is not None:
                    reader = self.calling.reader()
                    out["message"] = reader.message(text)
                    finish = _call_finish(reader, finish)
                elif self.chat:
                    out["message"] = {"role": "assistant", "content": text}
                else:
                    out["text"] = (c.prompt_text or "") + text if self.echo else text
                out.update(logprobs=self._whole_logprobs(gen, c), finish_reason=finish)
                if self.body.return_token_ids:
                    out["token_ids"] = list(c.token_ids)
                choices.append(out)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": self.usage()}

    def _whole_logprobs(self, gen: Generation, c: Choice) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return chat_logprobs(c.logprobs)
        prompt = (gen.prompt_logprobs or []) if self.echo else []
        return completion_logprobs(prompt + c.logprobs)

    async def sse(
        self, first: tuple[int, P.Chunk], rest: AsyncIterator[tuple[int, P.Chunk]]
    ) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        usage_field = {"usage": None} if self.body.include_usage else {}

        def event(choices: list[dict[str, Any]], **extra: Any) -> str:
            data = {**self._head(obj), "choices": choices, **usage_field, **extra}
            return f"data: {json.dumps(data)}\n\n"

        if self.chat:  # OpenAI opens each choice with the assistant's role, one per event
            for i in range(len(self.gens) * self.n):
                role = {"role": "assistant", "content": "" if self.calling is None else None}
                yield event([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
        try:
            pending: tuple[int, P.Chunk] | None = first
            while pending is not None:
                p, chunk = pending
                delta = self._delta(p * self.n + chunk.index, chunk)
                if delta is not None:
                    yield event([delta])
                pending = await anext(rest, None)
            if self.body.include_usage:
                yield event([], usage=self.usage())
        except ServerError as e:
            yield _refused(self.state, e).sse()
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"

    def _delta(self, index: int, chunk: P.Chunk) -> dict[str, Any] | None:
        """Choice ``index``'s event for ``chunk``; None when it has nothing to send."""
        out: dict[str, Any] = {"index": index}
        finish = chunk.finish_reason
        if self.calling is not None:
            reader = self._readers.setdefault(index, self.calling.reader())
            out["delta"] = reader.delta(chunk.text, final=finish is not None)
            finish = _call_finish(reader, finish)
            text = bool(out["delta"])
        elif self.chat:
            out["delta"] = {"content": chunk.text} if chunk.text else {}
            text = bool(chunk.text)
        else:
            echo = chunk.prompt_text if self.echo and chunk.prompt_text else ""
            out["text"] = echo + chunk.text
            text = bool(out["text"])
        ids = self.body.return_token_ids and chunk.token_ids
        lps = self.logprobs and (chunk.logprobs or chunk.prompt_logprobs)
        if not (text or ids or lps or finish is not None):
            return None
        out.update(logprobs=self._delta_logprobs(index, chunk), finish_reason=finish)
        if self.body.return_token_ids:
            out["token_ids"] = list(chunk.token_ids)
        return out

    def _delta_logprobs(self, index: int, chunk: P.Chunk) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        entries = chunk.logprobs or []
        if self.chat:
            return chat_logprobs(entries)
        if self.echo and chunk.prompt_logprobs:
            entries = chunk.prompt_logprobs + entries
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + sum(len(e[1]) for e in entries)
        return completion_logprobs(entries, offset)


def _call_finish(reader: ToolCallReader | AutoToolReader, reason: str | None) -> str | None:
    # A completed call ends its choice with "tool_calls", as OpenAI's do.
    return "tool_calls" if reason == "stop" and reader.is_call else reason


class _EventStream(StreamingResponse):
    """Closes its body however the response ends, so a request whose client left is
    aborted now (the body's ``finally`` closes the generation streams); then calls
    ``on_end``."""

    def __init__(
        self, content: AsyncIterator[str], on_end: Callable[[], None] | None, **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[union-attr]
            finally:
                if self.on_end is not None:
                    self.on_end()


# ------------------------------------------------------------- async plumbing
async def _drain(gen: Generation) -> None:
    async for _ in gen.chunks():
        pass


async def _all(jobs: Any) -> None:
    """Run the jobs together; the first failure cancels the others (aborting them)."""
    tasks = [asyncio.ensure_future(j) for j in jobs]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # A failed task holds its exception, whose traceback holds this frame: without
        # this the request's body lived on in that cycle until the next full collection.
        tasks.clear()


async def _merge(gens: list[Generation]) -> AsyncIterator[tuple[int, P.Chunk]]:
    """The chunks of every generation, tagged with its prompt's index, as they come."""
    if len(gens) == 1:
        stream = gens[0].chunks()
        try:
            async for chunk in stream:
                yield 0, chunk
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, P.Chunk] | BaseException | None] = asyncio.Queue()

    async def pump(p: int, gen: Generation) -> None:
        try:
            async for chunk in gen.chunks():
                queue.put_nowait((p, chunk))
            queue.put_nowait(None)
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, job: Awaitable[T]) -> T:
    """``await job``, unless the HTTP client goes away first: then cancel it (which aborts
    its requests) and raise ClientGone. Starlette only notices a disconnect on its own
    while streaming, so a request answered in one piece watches for it here."""
    task = asyncio.ensure_future(job)
    watch = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    try:
        return task.result()
    finally:
        del task  # no cycle through the exception's traceback (see ``_all``)


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)

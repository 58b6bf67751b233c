"""Where requests go: radixserve's ZeroMQ ``AsyncClient``, an OpenAI-compatible
HTTP server (``/v1/completions``, streamed as server-sent events), or an
in-process ``Engine``.

All send the prompt as token ids (the OpenAI API accepts ``prompt`` as a list
of integers), greedy, with ``ignore_eos`` so every answer has exactly
``max_tokens`` tokens, and stream, so the runner can time each token. What comes
back is a series of ``StreamEvent``s, the last one carrying ``usage``.

A structured request (``structured`` not None) is sent without ``ignore_eos``:
it ends when its grammar does (a JSON object complete), within ``max_tokens``.
radixserve's backends set ``SamplingParams.structured``; the OpenAI backend
sends a ``response_format`` (``json_schema`` or ``json_object``).

A scored request (``logprob_start_len`` not None) also asks for the prompt's
logprobs from that position on; they come back in one event's
``prompt_logprobs``. The OpenAI backend cannot send such requests yet.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.results import Usage
from radixserve.sampling_params import SamplingParams, StructuredOutput


@dataclass
class StreamEvent:
    text: str
    token_ids: list[int] | None  # None: this backend does not say which tokens
    usage: Usage | None = None  # set on the last event
    cached_known: bool = True  # False: the server did not report cached tokens
    finish_reason: str | None = None
    # Scored requests: each prompt position's logprob (None where not scored).
    prompt_logprobs: list[float | None] | None = None


@dataclass
class ServerInfo:
    model: str
    page_size: int
    max_context_len: int | None = None


class Backend(Protocol):
    name: str

    async def info(self) -> ServerInfo: ...

    def stream(
        self,
        input_ids: Sequence[int],
        max_tokens: int,
        logprob_start_len: int | None = None,
        structured: StructuredOutput | None = None,
        priority: int = 0,
        retention: tuple[int, float] | None = None,
    ) -> AsyncIterator[StreamEvent]: ...

    async def reset_cache(self) -> bool:
        """Empty the server's prefix cache; False when this backend cannot."""
        ...

    async def stats(self) -> dict[str, Any] | None: ...

    async def dashboard(self) -> dict[str, Any] | None:
        """The server's dashboard figures (the cache's tree among them); None when
        this backend cannot ask for them."""
        ...

    async def close(self) -> None: ...


class RadixserveBackend:
    """radixserve's own ZeroMQ client: exact token ids back, and cache control."""

    name = "radixserve"
    scores = True

    def __init__(self, endpoint: str, timeout: float = 600.0) -> None:
        from radixserve.client import AsyncClient

        self.endpoint = endpoint
        self.client = AsyncClient(endpoint, timeout=timeout)

    async def info(self) -> ServerInfo:
        h = await self.client.health()
        return ServerInfo(str(h["model"]), int(h["page_size"]), int(h["max_context_len"]))

    async def stream(
        self,
        input_ids: Sequence[int],
        max_tokens: int,
        logprob_start_len: int | None = None,
        structured: StructuredOutput | None = None,
        priority: int = 0,
        retention: tuple[int, float] | None = None,
    ) -> AsyncIterator[StreamEvent]:
        async for chunk in self.client.generate_stream(
            input_ids=list(input_ids),
            sampling_params=_bench_sampling(
                max_tokens, logprob_start_len, structured, priority, retention
            ),
        ):
            usage = Usage(**chunk.usage) if chunk.usage else None
            yield StreamEvent(
                chunk.text,
                list(chunk.token_ids),
                usage,
                True,
                chunk.finish_reason,
                _wire_logprobs(chunk.prompt_logprobs),
            )

    async def reset_cache(self) -> bool:
        await self.client.flush_cache()
        return True

    async def stats(self) -> dict[str, Any] | None:
        return dict(await self.client.stats())

    async def dashboard(self) -> dict[str, Any] | None:
        return await self.client.dashboard()

    async def close(self) -> None:
        self.client.close()


class OpenAIBackend:
    """Any OpenAI-compatible server (radixserve's HTTP front, vLLM, SGLang).

    Cached tokens come from ``usage.prompt_tokens_details.cached_tokens`` (vLLM
    reports them with ``--enable-prompt-tokens-details``); output token ids from
    ``choices[0].token_ids`` when the server returns them (the body asks with
    ``"return_token_ids": true``, which vLLM and radixserve honour), else the
    runner re-tokenizes the text.

    ``prompt_text``: for servers that take no token ids (llama-cpp-python's), each
    prompt is sent as this function's text of its ids (the server tokenizes it again).

    A scored request is sent whole (not streamed) with ``echo``, ``logprobs: 0``
    and radixserve's ``logprob_start_len``: the prompt's ``token_logprobs`` come
    back first. A server without that extra scores the whole prompt (and, as
    OpenAI's API has no start position, recomputes it).
    """

    name = "openai"
    scores = True

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        page_size: int = 1,
        extra_body: dict[str, Any] | None = None,
        timeout: float = 600.0,
        api_key: str | None = None,
        prompt_text: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.page_size = page_size
        # return_token_ids: vLLM's extension, also served by radixserve's front; with
        # it, a later turn's prompt holds exactly the tokens the server generated.
        self.extra_body = {"ignore_eos": True, "return_token_ids": True, **(extra_body or {})}
        self.http = httpx.AsyncClient(timeout=timeout, headers=headers)
        self.prompt_text = prompt_text
        #: Such servers (llama-cpp-python's) stream no usage: the runner counts the tokens.
        self.usage_optional = prompt_text is not None

    async def info(self) -> ServerInfo:
        if self.model is None:
            r = await self.http.get(f"{self.base_url}/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return ServerInfo(model=self.model, page_size=self.page_size)

    async def stream(
        self,
        input_ids: Sequence[int],
        max_tokens: int,
        logprob_start_len: int | None = None,
        structured: StructuredOutput | None = None,
        priority: int = 0,
        retention: tuple[int, float] | None = None,
    ) -> AsyncIterator[StreamEvent]:
        if logprob_start_len is not None:
            yield await self._score(input_ids, max_tokens, logprob_start_len)
            return
        body = {
            "model": self.model,
            "prompt": self.prompt_text(input_ids) if self.prompt_text else list(input_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        if structured is not None:
            body["response_format"] = response_format(structured)
            body["ignore_eos"] = False
        if priority:  # vLLM's field; a server without priority scheduling may refuse it
            body["priority"] = priority
        if retention is not None:
            body["cache_retention"] = list(retention)
        async with self.http.stream("POST", f"{self.base_url}/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:500]
                raise RuntimeError(f"HTTP {r.status_code} from {self.base_url}: {detail}")
            async for obj in sse_objects(r.aiter_lines()):
                yield event_from_openai(obj)

    async def _score(
        self, input_ids: Sequence[int], max_tokens: int, logprob_start_len: int
    ) -> StreamEvent:
        body = {
            "model": self.model,
            "prompt": list(input_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "echo": True,
            "logprobs": 0,
            "logprob_start_len": logprob_start_len,
            **self.extra_body,
        }
        r = await self.http.post(f"{self.base_url}/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code} from {self.base_url}: {r.text[:500]}")
        obj = r.json()
        event = event_from_openai(obj)
        choice = obj["choices"][0]
        event.text = ""  # the echoed prompt is not output; the ids say what was generated
        event.prompt_logprobs = choice["logprobs"]["token_logprobs"][: len(input_ids)]
        return event

    async def reset_cache(self) -> bool:
        return False  # no standard endpoint: start each run from a fresh server

    async def stats(self) -> dict[str, Any] | None:
        return None

    async def dashboard(self) -> dict[str, Any] | None:
        return None

    async def close(self) -> None:
        await self.http.aclose()


async def sse_objects(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's ``data:`` lines, until ``data: [DONE]``.

    Comments (``:``), ``event:``/``id:`` fields and blank separators are skipped;
    an ``error`` object in the stream raises."""
    async for raw in lines:
        line = raw.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        obj = json.loads(data)
        if "error" in obj:
            raise RuntimeError(f"the server reported an error: {obj['error']}")
        yield obj


def event_from_openai(obj: dict[str, Any]) -> StreamEvent:
    """One ``text_completion`` chunk → a StreamEvent (text, ids if given, usage if given)."""
    choices = obj.get("choices") or []
    choice = choices[0] if choices else {}
    ids = choice.get("token_ids")
    usage = None
    cached_known = True
    if obj.get("usage"):
        u = obj["usage"]
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        cached_known = cached is not None
        usage = Usage(
            prompt_tokens=int(u.get("prompt_tokens") or 0),
            completion_tokens=int(u.get("completion_tokens") or 0),
            cached_tokens=int(cached or 0),
        )
    return StreamEvent(
        text=choice.get("text") or "",
        token_ids=None if ids is None else [int(t) for t in ids],
        usage=usage,
        cached_known=cached_known,
        finish_reason=choice.get("finish_reason"),
    )


def response_format(so: StructuredOutput) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a JSON constraint (``strict``: nothing but the
    schema's properties, as radixserve generates them)."""
    if so.kind == "json_schema":
        schema = json.loads(so.spec)
        return {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": schema, "strict": True},
        }
    if so.kind == "json_object":
        return {"type": "json_object"}
    raise ValueError(f"the OpenAI API has no response_format for a {so.kind} constraint")


def _bench_sampling(
    max_tokens: int,
    logprob_start_len: int | None,
    structured: StructuredOutput | None = None,
    priority: int = 0,
    retention: tuple[int, float] | None = None,
) -> SamplingParams:
    """Greedy; ``max_tokens`` exactly, or for a structured request until its grammar
    ends; a scored request asks for prompt logprobs from ``logprob_start_len``;
    ``priority`` and ``retention`` (``cache_retention``) as ``--priority-mix`` set them."""
    score = {}
    if logprob_start_len is not None:
        score = {"prompt_logprobs": 1, "logprob_start_len": logprob_start_len}
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=structured is None,
        structured=structured,
        priority=priority,
        cache_retention=retention,
        **score,
    )


def _wire_logprobs(entries: list | None) -> list[float | None] | None:
    """The logprob of each position of the public ``[id, text, logprob, top]`` entries."""
    if entries is None:
        return None
    return [None if e is None or e[2] is None else float(e[2]) for e in entries]


class EngineBackend:
    """An in-process ``Engine``, stepped on the event loop: requests sent in the same
    instant share a step, as on a server. One step blocks the loop while it runs, so
    every request of a step sees its chunks at the step's end.

    Uses the Engine's scheduler, runner and tokenizer directly (the Engine's own
    ``generate`` is synchronous)."""

    name = "engine"
    scores = True

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._ids = 0
        self._queues: dict[tuple[str, int], Any] = {}
        self._driver: Any = None

    async def info(self) -> ServerInfo:
        i = self.engine.runner.info()
        return ServerInfo(str(self.engine.config.model), int(i.page_size), int(i.max_context_len))

    async def stream(
        self,
        input_ids: Sequence[int],
        max_tokens: int,
        logprob_start_len: int | None = None,
        structured: StructuredOutput | None = None,
        priority: int = 0,
        retention: tuple[int, float] | None = None,
    ) -> AsyncIterator[StreamEvent]:
        import asyncio

        from radixserve.tokenizer.output import OutputStream

        sp = _bench_sampling(max_tokens, logprob_start_len, structured, priority, retention)
        eng = self.engine
        ids = eng.inputs.to_ids(input_ids=list(input_ids))
        eng.inputs.check_sampling(sp)
        eng.scheduler.check_request(ids, sp)
        self._ids += 1
        rid = f"bench-{self._ids}"
        queue: asyncio.Queue[tuple[Any, Any] | BaseException] = asyncio.Queue()
        self._queues[(rid, 0)] = (OutputStream(eng.tokenizer, ids, (), eng.texts), queue)
        eng.scheduler.add_request(rid, ids, sp)
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        while True:
            ev = await queue.get()
            if isinstance(ev, BaseException):
                raise ev
            yield ev
            if ev.usage is not None:
                return

    async def _drive(self) -> None:
        import asyncio

        sched, runner = self.engine.scheduler, self.engine.runner
        await asyncio.sleep(0)  # let every request sent in this instant in first
        try:
            while sched.has_work():
                for out in sched.step(runner.step):
                    self._dispatch(out)
                await asyncio.sleep(0)  # let replies be read and new requests in
        except Exception as e:  # fail every request in flight, not the run
            for _, queue in self._queues.values():
                queue.put_nowait(e)
            self._queues.clear()

    def _dispatch(self, out: Any) -> None:
        entry = self._queues.get((out.rid, out.index))
        if entry is None:
            return
        stream, queue = entry
        if out.finish_reason == "error":  # the request failed (e.g. its grammar rejected a token)
            del self._queues[(out.rid, out.index)]
            queue.put_nowait(RuntimeError(out.error or "the request failed"))
            return
        done = out.finish_reason is not None
        text = stream.add(out.token_ids, done, out.logprobs, out.prompt_logprobs)
        usage = None
        if done:
            del self._queues[(out.rid, out.index)]
            usage = Usage(out.prompt_tokens, len(stream.token_ids), out.cached_tokens)
        prompt_lps = _wire_logprobs(stream.prompt_logprobs) if out.prompt_logprobs else None
        queue.put_nowait(
            StreamEvent(text, list(out.token_ids), usage, True, out.finish_reason, prompt_lps)
        )

    async def reset_cache(self) -> bool:
        self.engine.flush_cache()
        return True

    async def stats(self) -> dict[str, Any] | None:
        return dict(self.engine.stats())

    async def dashboard(self) -> dict[str, Any] | None:
        return self.engine.dashboard()

    async def close(self) -> None:
        pass  # the Engine outlives the backend: its owner closes it

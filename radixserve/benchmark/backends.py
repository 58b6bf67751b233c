"""Where requests go: radixserve's ZeroMQ ``AsyncClient``, or an OpenAI-compatible
HTTP server (``/v1/completions``, streamed as server-sent events).

Both send the prompt as token ids (the OpenAI API accepts ``prompt`` as a list
of integers), greedy, with ``ignore_eos`` so every answer has exactly
``max_tokens`` tokens, and stream, so the runner can time each token. What comes
back is a series of ``StreamEvent``s, the last one carrying ``usage``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from radixserve.results import Usage


@dataclass
class StreamEvent:
    text: str
    token_ids: list[int] | None  # None: this backend does not say which tokens
    usage: Usage | None = None  # set on the last event
    cached_known: bool = True  # False: the server did not report cached tokens
    finish_reason: str | None = None


@dataclass
class ServerInfo:
    model: str
    page_size: int
    max_context_len: int | None = None


class Backend(Protocol):
    name: str

    async def info(self) -> ServerInfo: ...

    def stream(self, input_ids: Sequence[int], max_tokens: int) -> AsyncIterator[StreamEvent]: ...

    async def reset_cache(self) -> bool:
        """Empty the server's prefix cache; False when this backend cannot."""
        ...

    async def stats(self) -> dict[str, Any] | None: ...

    async def close(self) -> None: ...


class RadixserveBackend:
    """radixserve's own ZeroMQ client: exact token ids back, and cache control."""

    name = "radixserve"

    def __init__(self, endpoint: str, timeout: float = 600.0) -> None:
        from radixserve.client import AsyncClient

        self.endpoint = endpoint
        self.client = AsyncClient(endpoint, timeout=timeout)

    async def info(self) -> ServerInfo:
        h = await self.client.health()
        return ServerInfo(str(h["model"]), int(h["page_size"]), int(h["max_context_len"]))

    async def stream(self, input_ids: Sequence[int], max_tokens: int) -> AsyncIterator[StreamEvent]:
        async for chunk in self.client.generate_stream(
            input_ids=list(input_ids), max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            usage = Usage(**chunk.usage) if chunk.usage else None
            yield StreamEvent(chunk.text, list(chunk.token_ids), usage, True, chunk.finish_reason)

    async def reset_cache(self) -> bool:
        await self.client.flush_cache()
        return True

    async def stats(self) -> dict[str, Any] | None:
        return dict(await self.client.stats())

    async def close(self) -> None:
        self.client.close()


class OpenAIBackend:
    """Any OpenAI-compatible server (radixserve's HTTP front, vLLM, SGLang).

    Cached tokens come from ``usage.prompt_tokens_details.cached_tokens`` (vLLM
    reports them with ``--enable-prompt-tokens-details``); output token ids from
    ``choices[0].token_ids`` when the server returns them (the body asks with
    ``"return_token_ids": true``, which vLLM and radixserve honour), else the
    runner re-tokenizes the text.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        page_size: int = 1,
        extra_body: dict[str, Any] | None = None,
        timeout: float = 600.0,
        api_key: str | None = None,
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

    async def info(self) -> ServerInfo:
        if self.model is None:
            r = await self.http.get(f"{self.base_url}/models")
            r.raise_for_status()
            self.model = r.json()["data"][0]["id"]
        return ServerInfo(model=self.model, page_size=self.page_size)

    async def stream(self, input_ids: Sequence[int], max_tokens: int) -> AsyncIterator[StreamEvent]:
        body = {
            "model": self.model,
            "prompt": list(input_ids),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra_body,
        }
        async with self.http.stream("POST", f"{self.base_url}/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:500]
                raise RuntimeError(f"HTTP {r.status_code} from {self.base_url}: {detail}")
            async for obj in sse_objects(r.aiter_lines()):
                yield event_from_openai(obj)

    async def reset_cache(self) -> bool:
        return False  # no standard endpoint: start each run from a fresh server

    async def stats(self) -> dict[str, Any] | None:
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

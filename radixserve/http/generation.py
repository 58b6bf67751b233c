"""One prompt's generation, as the HTTP front runs it through the tokenizer process.

Every request is streamed from the tokenizer, even when the HTTP client asked for one
JSON answer: the front then sees each token arrive, which is what the latency metrics
measure, and joining the text deltas gives exactly the tokenizer's final text.

Contract: whoever iterates ``Generation.chunks()`` either drains it or closes it
(``aclose``, or by cancellation); closing it early aborts the request in the scheduler,
so the KV of a client that went away is released at once.

Every generation goes to the tokenizer under an id of the front's own, never one an HTTP
client chose: all HTTP clients share the front's one tokenizer client, whose ids must be
unique, so a client's ``rid`` (SGLang's) is only the name the front knows it by.

The generations of one HTTP request share an ``Outcome``: a request the server refuses
or fails is counted once as ``error`` in ``requests_total``, whatever its number of
prompts and choices, and the choices its failure cut short are not counted again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from radixserve import protocol as P
from radixserve.client import AsyncClient, ServerError
from radixserve.http.metrics import Metrics
from radixserve.sampling_params import SamplingParams


@dataclass
class Choice:
    """What one sample produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    # Wire entries ([token id, text, logprob, top]) when logprobs were asked for.
    logprobs: list[list] = field(default_factory=list)
    prompt_text: str | None = None  # with echo


class Outcome:
    """How one HTTP request's generations ended, as the metrics count it (see above)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.failed = False

    def fail(self) -> None:
        """The server refused or failed one of the request's generations."""
        if not self.failed:
            self.failed = True
            self.metrics.finished("error", 0)


class Generation:
    """One prompt (text, token ids, or chat messages and the tools their template is
    given) with ``sampling.n`` choices."""

    def __init__(
        self,
        client: AsyncClient,
        metrics: Metrics,
        sampling: SamplingParams,
        *,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        cache_salt: str | None = None,
        echo: bool = False,
        rid: str | None = None,
        lora: str | None = None,
        outcome: Outcome | None = None,
        cache_key: str | None = None,
        images: list[str] | None = None,
    ) -> None:
        self.client, self.metrics, self.sampling = client, metrics, sampling
        self.outcome = outcome if outcome is not None else Outcome(metrics)
        self.inputs: dict[str, Any] = {
            "prompt": prompt,
            "input_ids": input_ids,
            "messages": messages,
            "tools": tools,
            "cache_salt": cache_salt,
            "echo": echo,
            "lora": lora,
            "cache_key": cache_key,  # routing only (prompt_cache_key)
            "images": images,
        }
        # Scored once per prompt (they come with choice 0's first chunk), shared by all n.
        self.prompt_logprobs: list | None = None
        # The id in the tokenizer client: the front's own, whatever the HTTP client asked.
        self.request_id = f"http-{uuid.uuid4().hex}"
        # The id the HTTP client knows it by: its own rid (SGLang's), else the same.
        self.rid = rid or self.request_id
        self.choices = [Choice(i) for i in range(sampling.n)]
        self.arrival = time.monotonic()

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def usage(self) -> dict[str, Any]:
        """prompt / completion / cached tokens, once every choice finished.

        The prompt is computed once for all n choices, so it is counted once (as OpenAI
        does); its cached tokens are those of choice 0, the one that computed the prompt.
        """
        first = self.choices[0].usage or {}
        out = {
            "prompt_tokens": first.get("prompt_tokens", 0),
            "completion_tokens": sum(
                (c.usage or {}).get("completion_tokens", 0) for c in self.choices
            ),
            "cached_tokens": first.get("cached_tokens", 0),
        }
        if "explain" in first:  # the request asked (``explain``): the cache's hit explained
            out["explain"] = first["explain"]
        return out

    async def chunks(self) -> AsyncIterator[P.Chunk]:
        """The tokenizer's chunks for every choice (each choice's last has finish_reason)."""
        stream = self.client.generate_stream(
            **self.inputs,
            sampling_params=self.sampling,
            request_id=self.request_id,
            timeout=None,  # the HTTP client decides how long to wait; leaving aborts
        )
        first_token: float | None = None
        last_token: dict[int, float] = {}
        outcome = "abort"  # unless the stream ends or the server fails the request
        try:
            async for chunk in stream:
                now = time.monotonic()
                choice = self.choices[chunk.index]
                if chunk.token_ids:
                    if first_token is None:
                        first_token = now
                        self.metrics.ttft.labels(self.metrics.model_name).observe(
                            now - self.arrival
                        )
                    elif chunk.index in last_token:
                        gap = now - last_token[chunk.index]
                        self.metrics.itl.labels(self.metrics.model_name).observe(gap)
                    last_token[chunk.index] = now
                choice.text.append(chunk.text)
                if chunk.logprobs:
                    choice.logprobs.extend(chunk.logprobs)
                if chunk.prompt_logprobs is not None:
                    self.prompt_logprobs = chunk.prompt_logprobs
                if chunk.prompt_text is not None:
                    choice.prompt_text = chunk.prompt_text
                choice.token_ids.extend(chunk.token_ids)
                choice.num_tokens += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    self._finish(choice, chunk.finish_reason, chunk.usage)
                yield chunk
            outcome = "done"
            e2e = time.monotonic() - self.arrival
            self.metrics.e2e.labels(self.metrics.model_name).observe(e2e)
        except ServerError:
            outcome = "error"
            raise
        finally:
            await stream.aclose()  # aborts the request unless it finished
            if outcome == "error":
                self.outcome.fail()
            if outcome != "done":
                # The request's one error is counted; the choices it cut short are not.
                counted = not self.outcome.failed
                for choice in self.choices:
                    if choice.finish_reason is None:
                        self._finish(choice, outcome, None, counted)

    def _finish(
        self, choice: Choice, reason: str, usage: dict[str, int] | None, counted: bool = True
    ) -> None:
        choice.finish_reason = reason
        choice.usage = usage
        completion = usage["completion_tokens"] if usage else choice.num_tokens
        self.metrics.finished(reason if counted else None, completion)
        if usage is not None and choice.index == 0:
            self.metrics.prompt(usage["prompt_tokens"])

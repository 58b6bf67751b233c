"""SGLang's native API on the HTTP front, and the tokenizer routes vLLM shares with it.

| route | answer |
|---|---|
| ``POST /generate`` | SGLang's: ``{"text", "output_ids", "meta_info"}`` per sample (a list for a batch or ``n > 1``) |
| ``GET /get_model_info`` | the model's path and kind, as SGLang reports them |
| ``GET /get_server_info``, ``/server_info`` | the server's options, limits and the scheduler's stats |
| ``GET /health_generate`` | 200 once one token went through the whole server |
| ``POST /abort_request`` | aborts a ``/generate`` request by its ``rid`` (or all of them) |
| ``POST /tokenize``, ``POST /detokenize`` | SGLang's and vLLM's shapes in one answer |

A ``/generate`` request runs as the OpenAI routes' do: one ``Generation`` per prompt
through the tokenizer process, so validation, stop strings, the prefix cache and ``n``
are the same. Each sample's ``meta_info`` has ``id`` (its ``rid``), ``finish_reason``
(SGLang's ``{"type": "length", "length": n}`` or ``{"type": "stop", "matched": m}``,
``m`` the EOS or stop token that ended it, or null for a stop string or a complete
constraint), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
``e2e_latency`` and, with ``return_logprob``, the logprob lists: each entry
``[logprob, token id, text or null]`` (text with ``return_text_in_logprobs``).

A ``rid`` is the name the HTTP client gives its request, not the id the front sends it
under (every HTTP client shares the front's one tokenizer client): a ``/generate`` whose
rid is already in flight is a 409, and the request in flight goes on.

Streaming is SGLang's default: every event carries the sample's whole text, ids and
logprobs so far (a client prints ``text[len(previous):]``), batches and ``n > 1`` add
``index``, and the stream ends with ``data: [DONE]``. ``prompt_tokens`` and
``cached_tokens`` are null until the sample's last event (the tokenizer reports them
when it finishes).

The tokenizer routes answer both dialects at once: ``/tokenize`` returns ``tokens``,
``count`` and ``max_model_len`` (both), ``token_strs`` (vLLM's, always null);
``/detokenize`` returns the text as ``text`` (SGLang's) and as ``prompt`` (vLLM's).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve import protocol as P
from radixserve.client import ServerError
from radixserve.http.completions import (
    _drain,
    _refused,
    answer,
    parse,
)
from radixserve.http.errors import HTTPError, short_text
from radixserve.http.generation import Choice, Generation, Outcome
from radixserve.http.logprobs import FLOOR
from radixserve.http.sglang_schema import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    Plan,
    TokenizeRequest,
)
from radixserve.http.state import FrontState
from radixserve.sampling_params import SamplingParams

HEALTH_TIMEOUT_S = 30.0


# ------------------------------------------------------------------ /generate
async def generate(state: FrontState, request: Request) -> Response:
    body = await parse(state, request, GenerateRequest)
    if body.model is not None and not state.serves(body.model):
        raise HTTPError(404, f"the model {body.model!r} does not exist", "model", "model_not_found")
    try:
        plans = body.plans(state.max_context_len)
    except ValueError as e:
        raise HTTPError(400, str(e)) from None
    outcome = Outcome(state.metrics)  # shared: a refused batch counts one error
    gens = [
        Generation(
            state.client,
            state.metrics,
            plan.sampling,
            prompt=plan.prompt,
            input_ids=plan.input_ids,
            cache_salt=plan.cache_salt,
            rid=plan.rid,
            outcome=outcome,
            images=plan.images,
        )
        for plan in plans
    ]
    if len({g.rid for g in gens}) < len(gens):
        raise HTTPError(400, "each prompt of a batch needs its own rid", "rid")
    fmt = _Format(state, body, plans, gens)
    # A rid names one request in flight: a second one is refused, the first goes on.
    # (Checked and taken with no await between, so two requests cannot both take it.)
    for g in gens:
        if g.rid in state.sglang_requests:
            raise HTTPError(409, f"rid {short_text(g.rid)!r} is already in flight", "rid",
                            "rid_in_use")  # fmt: skip
    state.sglang_requests.update((g.rid, g) for g in gens)

    def release() -> None:
        for g in gens:
            if state.sglang_requests.get(g.rid) is g:
                del state.sglang_requests[g.rid]

    return await answer(state, request, gens, fmt, body.stream, on_end=release)


class _Format:
    """SGLang's JSON for each sample, whole or as stream events."""

    def __init__(
        self, state: FrontState, body: GenerateRequest, plans: list[Plan], gens: list[Generation]
    ) -> None:
        self.state, self.body, self.plans, self.gens = state, body, plans, gens
        # Prompt p's samples come at index first[p] on (n may differ by prompt).
        self.first = [sum(q.sampling.n for q in plans[:p]) for p in range(len(plans))]
        self.listed = body.is_batch or any(p.sampling.n > 1 for p in plans)

    def whole(self) -> dict[str, Any] | list[dict[str, Any]]:
        items = [
            self.item(plan, gen, c) for plan, gen in zip(self.plans, self.gens) for c in gen.choices
        ]
        return items if self.listed else items[0]

    def item(self, plan: Plan, gen: Generation, c: Choice) -> dict[str, Any]:
        usage = c.usage or {}
        meta: dict[str, Any] = {
            "id": gen.rid,
            "finish_reason": self._finish(plan, c),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": c.num_tokens,
            "cached_tokens": usage.get("cached_tokens"),
            "e2e_latency": time.monotonic() - gen.arrival,
        }
        if plan.return_logprob:
            meta.update(self._logprobs(plan, gen, c))
        return {"text": "".join(c.text), "output_ids": list(c.token_ids), "meta_info": meta}

    def _finish(self, plan: Plan, c: Choice) -> dict[str, Any] | None:
        reason = c.finish_reason
        if reason is None:
            return None
        if reason == "length":
            return {"type": "length", "length": c.num_tokens}
        if reason == "stop":
            last = c.token_ids[-1] if c.token_ids else None
            ends = set(plan.sampling.stop_token_ids) | set(self.state.eos_token_ids)
            return {"type": "stop", "matched": last if last in ends else None}
        return {"type": "abort", "message": f"the request ended: {reason}"}

    def _logprobs(self, plan: Plan, gen: Generation, c: Choice) -> dict[str, Any]:
        text = self.body.return_text_in_logprobs
        # The tokenizer gives every prompt position (null before the start); SGLang's
        # lists begin at logprob_start_len.
        start = plan.logprob_start_len
        prompt = (gen.prompt_logprobs or [])[start:] if start >= 0 else []
        out = {
            "input_token_logprobs": [_entry(e[2], e[0], e[1], text) for e in prompt],
            "output_token_logprobs": [_entry(e[2], e[0], e[1], text) for e in c.logprobs],
        }
        if plan.top_logprobs_num > 0:
            out["input_top_logprobs"] = [_top(e, text) for e in prompt]
            out["output_top_logprobs"] = [_top(e, text) for e in c.logprobs]
        return out

    async def sse(
        self, first: tuple[int, P.Chunk], rest: AsyncIterator[tuple[int, P.Chunk]]
    ) -> AsyncIterator[str]:
        try:
            pending: tuple[int, P.Chunk] | None = first
            while pending is not None:
                p, chunk = pending
                if chunk.text or chunk.token_ids or chunk.finish_reason is not None:
                    gen = self.gens[p]
                    item = self.item(self.plans[p], gen, gen.choices[chunk.index])
                    if self.listed:
                        item["index"] = self.first[p] + chunk.index
                    yield f"data: {json.dumps(item)}\n\n"
                pending = await anext(rest, None)
        except ServerError as e:
            yield _refused(self.state, e).sse()
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"


def _entry(lp: float | None, token: int, text: str, with_text: bool) -> list:
    return [None if lp is None else max(lp, FLOOR), token, text if with_text else None]


def _top(entry: list, with_text: bool) -> list | None:
    if entry[2] is None:  # a prompt position that was not scored
        return None
    return [_entry(t[2], t[0], t[1], with_text) for t in entry[3]]


# ------------------------------------------------------------- admin and info
async def abort_request(state: FrontState, request: Request) -> Response:
    body = await parse(state, request, AbortRequest)
    if body.abort_all:
        gens = list(state.sglang_requests.values())
    elif body.rid:  # a rid not in flight is ignored, as SGLang does
        gens = [state.sglang_requests[body.rid]] if body.rid in state.sglang_requests else []
    else:
        raise HTTPError(400, "give rid or abort_all=true", "rid")
    for g in gens:
        if not g.finished:
            await state.client.abort(g.request_id)  # the front's own id for it
    return Response(status_code=200)


async def health_generate(state: FrontState) -> dict[str, str]:
    """One token through the tokenizer, the scheduler and the worker (token id 0 is in
    every vocabulary)."""
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gen = Generation(state.client, state.metrics, one_token, input_ids=[0])
    try:
        await asyncio.wait_for(_drain(gen), HEALTH_TIMEOUT_S)
    except (ServerError, asyncio.TimeoutError) as e:
        raise HTTPError(503, f"the server could not generate: {e}") from None
    return {"status": "ok"}


def model_info(state: FrontState) -> dict[str, Any]:
    return dict(state.model_info)


def server_info(state: FrontState, stats: dict[str, Any]) -> dict[str, Any]:
    return {**state.server_args, "internal_states": [stats]}


# ----------------------------------------------------------- tokenizer routes
def _check_model(state: FrontState, model: str | None) -> None:
    if model is not None and not state.serves(model):
        raise HTTPError(404, f"the model {model!r} does not exist", "model", "model_not_found")


async def tokenize(state: FrontState, request: Request) -> dict[str, Any]:
    body = await parse(state, request, TokenizeRequest)
    _check_model(state, body.model)
    why = body.unsupported()
    if why is not None:
        raise HTTPError(400, why)
    try:
        if body.messages is not None:
            messages = [m.as_dict() for m in body.messages]
            ids: Any = await state.client.tokenize(
                messages=messages, add_generation_prompt=body.add_generation_prompt
            )
            count: Any = len(ids)
        else:
            special = body.add_special_tokens is not False
            texts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt or [])
            lists = [await state.client.tokenize(t, add_special_tokens=special) for t in texts]
            ids = lists[0] if isinstance(body.prompt, str) else lists
            count = len(ids) if isinstance(body.prompt, str) else [len(x) for x in lists]
    except ServerError as e:
        raise _refused(state, e) from None
    return {
        "tokens": ids,
        "count": count,
        "max_model_len": state.max_context_len,
        "token_strs": None,
    }


async def detokenize(state: FrontState, request: Request) -> dict[str, Any]:
    body = await parse(state, request, DetokenizeRequest)
    _check_model(state, body.model)
    one = not (body.tokens and isinstance(body.tokens[0], list))
    lists = [body.tokens] if one else body.tokens
    skip = body.skip_special_tokens
    try:
        texts = [
            await state.client.detokenize(ids, skip_special_tokens=skip)  # type: ignore[arg-type]
            for ids in lists
        ]
    except ServerError as e:
        raise _refused(state, e) from None
    text: Any = texts[0] if one else texts
    return {"text": text, "prompt": text}

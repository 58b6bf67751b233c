"""Send a workload through a backend and time every request.

Arrival: every root request at once (throughput), or roots spaced by
exponential gaps at ``rate`` requests/s (a Poisson process: latency under
load). A child (a conversation's next turn, a tree's branch) is sent as soon as
its parent finishes, or ``Node.delay`` seconds later (a root: after its arrival).
``max_concurrency`` bounds the requests in flight. ``retention=False`` leaves the
nodes' retention hints out (the agent workload's run without them).

Each request records, relative to the run's start: when it was sent, when each
streamed chunk with output arrived, and when it ended; the token ids sent and
received; the server's ``usage``. ``order`` is the send order, which the
offline-optimal hit rate replays.

Scored requests (``Node.score``) are sent with ``logprob_start_len`` at the
choice's start (``score_from="choice"``, the default) or 0 (``"whole"``: the
whole prompt scored, what a client without the start position must ask for);
the record keeps the logprob sum of the choice's tokens either way.

Structured requests (``Node.structured``) carry their constraint to the backend;
the record keeps the finish reason (``length``: cut before the object was complete).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.benchmark.backends import Backend
from radixserve.benchmark.workloads import Node, Workload
from radixserve.results import Usage


@dataclass
class RequestRecord:
    key: str
    order: int
    prompt_ids: list[int]
    max_tokens: int
    send_time: float
    chunk_times: list[float] = field(default_factory=list)
    end_time: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    usage: Usage | None = None
    cached_known: bool = True
    error: str | None = None
    group: str = ""  # Node.group
    finish_reason: str | None = None
    # Scored requests: where the choice starts, the logprob_start_len sent, and
    # the sum of the choice tokens' logprobs (None: not all of them came back).
    score_start: int | None = None
    logprob_start_len: int | None = None
    choice_logprob: float | None = None
    priority: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.usage is not None


@dataclass
class RunResult:
    records: list[RequestRecord]  # in send order
    duration: float
    not_sent: int  # children of failed requests


def arrival_times(n: int, rate: float | None, seed: int = 0) -> list[float]:
    """Send times of n roots: all 0 without a rate, else cumulative exponential gaps."""
    if rate is None or rate == float("inf"):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return [float(t) for t in np.cumsum(gaps) - gaps[0]]  # the first root goes at once


async def run(
    workload: Workload,
    backend: Backend,
    *,
    rate: float | None = None,
    max_concurrency: int | None = None,
    seed: int = 0,
    encode: Callable[[str], list[int]] | None = None,
    progress: bool = True,
    label: str = "",
    score_from: str = "choice",
    retention: bool = True,
) -> RunResult:
    """Run the workload once; ``encode`` turns output text into ids when the backend
    returns no ids (children's prompts need them). ``score_from``: "choice" or
    "whole", the ``logprob_start_len`` of scored requests (module docstring)."""
    from tqdm import tqdm

    if score_from not in ("choice", "whole"):
        raise ValueError(f"score_from must be choice or whole, got {score_from!r}")

    start = time.perf_counter()
    usage_optional = bool(getattr(backend, "usage_optional", False))
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    counter = itertools.count()
    records: list[RequestRecord] = []
    not_sent = 0
    bar = tqdm(
        total=workload.num_requests,
        desc=label or workload.name,
        unit="req",
        disable=not progress,
        leave=False,
    )

    def now() -> float:
        return time.perf_counter() - start

    async def one(node: Node, prompt: list[int]) -> RequestRecord:
        rec = RequestRecord(node.key, next(counter), prompt, node.max_tokens, now())
        rec.priority, rec.group = node.priority, node.group
        if node.score is not None:
            rec.score_start = node.score.start
            rec.logprob_start_len = node.score.start if score_from == "choice" else 0
        ids: list[int] | None = []
        try:
            stream = backend.stream(
                prompt,
                node.max_tokens,
                rec.logprob_start_len,
                structured=node.structured,
                priority=node.priority,
                retention=node.retention if retention else None,
            )
            async for ev in stream:
                if ev.text or ev.token_ids:
                    rec.chunk_times.append(now())
                rec.output_text += ev.text
                if ids is not None and ev.token_ids is not None:
                    ids += ev.token_ids
                elif ev.text:
                    ids = None  # text without ids: re-tokenize the whole answer below
                if ev.finish_reason is not None:
                    rec.finish_reason = ev.finish_reason
                if ev.usage is not None:
                    rec.usage, rec.cached_known = ev.usage, ev.cached_known
                if ev.prompt_logprobs is not None and rec.score_start is not None:
                    rec.choice_logprob = choice_sum(ev.prompt_logprobs, rec.score_start)
            if rec.usage is None and not (usage_optional and rec.finish_reason is not None):
                rec.error = "the stream ended without usage"
        except Exception as e:  # a failed request is reported, not fatal to the run
            rec.error = f"{type(e).__name__}: {e}"
        rec.end_time = now()
        if ids is None:
            ids = encode(rec.output_text) if encode else []
        rec.output_ids = ids
        if rec.usage is None and rec.error is None:
            # A server that streams no usage: the counts the client knows, no cache figure.
            rec.usage, rec.cached_known = Usage(len(prompt), len(ids)), False
        return rec

    async def send(node: Node, prompt: list[int]) -> None:
        nonlocal not_sent
        if node.delay > 0:
            await asyncio.sleep(node.delay)
        async with sem:
            rec = await one(node, prompt)
        records.append(rec)
        bar.update(1)
        if not rec.ok:
            not_sent += sum(1 for c in node.children for _ in c.walk())
            return
        history = prompt + rec.output_ids
        await asyncio.gather(*(send(c, history + c.tokens) for c in node.children))

    async def root(node: Node, at: float) -> None:
        await asyncio.sleep(max(0.0, at - now()))
        await send(node, list(node.tokens))

    times = arrival_times(len(workload.roots), rate, seed)
    try:
        await asyncio.gather(*(root(n, t) for n, t in zip(workload.roots, times)))
    finally:
        bar.close()
    records.sort(key=lambda r: r.order)
    return RunResult(records, now(), not_sent)


def choice_sum(prompt_logprobs: Sequence[float | None], start: int) -> float | None:
    """Sum of the logprobs of positions ``start..``: None when one is missing."""
    tail = prompt_logprobs[start:]
    if not tail or any(lp is None for lp in tail):
        return None
    return float(sum(tail))  # type: ignore[arg-type]


def pairs(records: Sequence[RequestRecord]) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) of every request sent, in send order (what the optimum replays)."""
    return [(r.prompt_ids, r.output_ids) for r in sorted(records, key=lambda r: r.order)]

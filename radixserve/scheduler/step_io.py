"""Between a request and the step: what the worker is sent for it (``step_req``),
what it sent back, by slot (``Returned``), where the scores go (``file_scores``), and
what the tokens it sampled mean for the request (``take_tokens``: appended, and
whether it finished).

Both read and update one request's own fields only (what it has been sent, which
prompt positions are scored), so the scheduler's step (``scheduler.py``) plans and
takes results without the per-request wire detail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.protocol import StepReq, StepResult
from radixserve.scheduler.images import real_ids
from radixserve.scheduler.request import Request

_NO_TOKENS = np.zeros(0, dtype=np.int32)


def step_req(
    req: Request,
    n: int,
    states: tuple[int, int, int, int, int] = (-1, 0, -1, 0, -1),
    window: tuple[int, np.ndarray] = (0, _NO_TOKENS),
) -> StepReq:
    """What the worker computes for ``req`` this step: ``n`` tokens from ``req.kv_len``
    (its drafts, ``req.spec.draft``, counted in and last), the pages it has not been sent
    (after cutting its table when a verification gave pages back), its sampling the
    first time, the prompt positions to score, and (hybrid models) the state
    snapshots to restore and save, ``(restore, save_at, save, save2_at, save2)``
    (``KVCacheManager.plan_states``), and (sliding layers) the window table entries
    to set, ``(start, pages)`` (``KVCacheManager.plan_window``)."""
    # Views, not copies: these ranges of a request's buffers never change
    # while it runs, and the worker consumes the step before the next one.
    new_pages = req.table[req.sent_pages : req.num_pages]
    req.sent_pages = req.num_pages
    sampling = None
    history = _NO_TOKENS
    if not req.announced:
        sampling = req.sampling.for_worker()
        req.announced = True
        if sampling.penalized or sampling.structured is not None:
            # Penalty counts start from it; a grammar replays the output.
            history = real_ids(req.tokens[: req.num_tokens], 0, req.images)
    start = req.kv_len
    keep_pages = -1
    if req.table_cut:  # a verification's rejected drafts gave pages back
        keep_pages = req.sent_pages - len(new_pages)
        req.table_cut = False
    k = len(req.spec.draft)
    n -= k  # the request's own tokens; its drafts follow them
    score_pos, score_ids = 0, _NO_TOKENS
    if req.score_next >= 0:
        # Prompt positions whose previous position this step computes.
        end = min(start + n + 1, req.prompt_len)
        if end > req.score_next:
            score_pos, score_ids = req.score_next, req.tokens[req.score_next : end]
            score_ids = real_ids(score_ids, score_pos, req.images)
            req.score_next = end if end < req.prompt_len else -1
    # The worker computes the real ids (an image's placeholder), never the key ids.
    ids = real_ids(req.tokens[start : start + n], start, req.images)
    if k:
        ids = np.concatenate([ids, req.spec.draft])
    return StepReq(
        req.slot,
        ids,
        start,
        new_pages,
        start + n == req.num_tokens and req.sampling.max_tokens > 0,
        sampling,
        req.prompt_len,
        history,
        score_pos,
        score_ids,
        req.lora if sampling is not None else 0,
        *states[:3],
        k,
        keep_pages,
        *window,
        state_save2_at=states[3],
        state_save2=states[4],
        images=list(req.images) if sampling is not None else [],
    )


@dataclass(eq=False)
class Returned:
    """What the worker returned for a step: the sampled tokens (one per sampling
    row, in row order) and the logprobs' entries, and by slot the tokens a grammar
    forced (jump-forward), the verified tokens of a request's drafts, and whether
    its grammar is complete (``terminated``). A bare token sequence (test doubles)
    carries the tokens only."""

    tokens: list[int]
    scores: list = field(default_factory=list)
    forced: dict[int, list[int]] = field(default_factory=dict)
    verified: dict[int, list[int]] = field(default_factory=dict)
    terminated: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, result: StepResult | np.ndarray | Sequence[int]) -> Returned:
        if not isinstance(result, StepResult):
            return cls(result.tolist() if isinstance(result, np.ndarray) else list(result))
        return cls(
            result.tokens.tolist(),
            result.scores,
            {f.slot: f.token_ids.tolist() for f in result.forced},
            {v.slot: v.token_ids.tolist() for v in result.verified},
            set(result.terminated.tolist()),
        )


def file_scores(batch: list[tuple[Request, int]], scores: list) -> dict[int, list]:
    """File the step's logprobs: prompt positions into their request's
    ``prompt_scores``; the sampled tokens' entries (one, or one per verified token)
    returned by request."""
    if not scores:
        return {}
    by_slot = {req.slot: req for req, _ in batch if req.slot is not None}
    sampled: dict[int, list] = {}
    for sc in scores:
        req = by_slot.get(sc.slot)
        if req is None:
            continue  # aborted after the step was planned
        entries = sc.entries()
        if sc.pos >= req.prompt_len:  # the token(s) sampled in this step
            sampled[id(req)] = entries
        elif req.prompt_scores is not None:
            req.prompt_scores[sc.pos : sc.pos + len(entries)] = entries
    return sampled


def take_tokens(
    req: Request, new: list[int], eos: frozenset[int], grammar_done: bool
) -> tuple[list[int], str | None]:
    """Append this step's tokens to ``req`` (the sampled one, or with jump-forward the
    grammar's forced tokens with or instead of it), never past ``max_tokens`` or the
    context and never past a stop token; return them and the finish reason ("stop",
    "length") or None while it goes on. ``grammar_done``: its grammar is complete."""
    sp = req.sampling
    room = min(sp.max_tokens - req.num_output, req.final_len - req.num_tokens)
    new = new[: max(room, 1)]
    reason = None
    for j, t in enumerate(new):
        if (t in eos and not sp.ignore_eos) or t in sp.stop_token_ids:
            new, reason = new[: j + 1], "stop"
            break
    for t in new:
        req.append_token(t)
    if reason is None and grammar_done:
        reason = "stop"
    if reason is None and (
        req.num_tokens - req.prompt_len >= sp.max_tokens or req.num_tokens >= req.final_len
    ):
        reason = "length"
    return new, reason

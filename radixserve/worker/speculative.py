"""Speculative decoding in the worker: verifying one request's drafts (docs/speculative.md).

The scheduler proposes drafts (``scheduler/speculative.py``); a step computes a
request's last real token and its ``k`` drafts as ``k + 1`` query rows over its
paged KV, and ``verify`` turns those rows' logits into the request's new tokens:

- row ``j`` gives the token after draft ``j`` (row 0: after the real token). Each
  row goes through the same processing as a plain step's row (``min_tokens``,
  ``logit_bias``, penalties: ``LogitsProcessor``), with the tokens accepted before
  it already counted, exactly as if they had been generated one step at a time;
- greedy: the token of row ``j`` is its argmax; draft ``j`` is accepted when it
  equals it. The output is the plain greedy output, token for token;
- sampling: standard speculative rejection sampling for a draft that is one token
  with probability 1 (n-gram and tree drafts are): draft ``d`` is accepted with
  probability ``p(d)`` (``p`` the row's filtered distribution, the one the sampler
  draws from), else the token is drawn from ``p`` without ``d``, renormalised. The
  token at that position is then distributed as ``p`` exactly: ``p(d)`` for ``d``,
  ``(1 - p(d)) * p(x) / (1 - p(d)) = p(x)`` for every other ``x``. The two uniforms
  come from the slot's seeded stream at the token's position (``Sampler.uniforms``),
  so a seeded request's output depends on its seed, its logits and its drafts only;
- verification stops at the first rejected draft: the tokens are the accepted drafts
  and the token sampled after them (``1 .. k + 1`` tokens).

Logprobs of the new tokens are those of the rows' raw logits, as in a plain step.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.worker.logits import LogitsProcessor
from radixserve.worker.sampler import Sampler, filtered_probs


def verify(
    rows: torch.Tensor,
    drafts: list[int],
    slot: int,
    first_pos: int,
    sampler: Sampler,
    processor: LogitsProcessor,
    record_last: bool = True,
) -> list[int]:
    """The new tokens of ``slot`` from ``rows`` [k + 1, vocab] (raw logits, float32 or
    float64, or masked by a grammar; not changed), ``drafts`` the ``k`` draft tokens,
    ``first_pos`` the position of the token row 0 gives. Counts the tokens in
    ``processor`` (the last one only with ``record_last``: jump-forward may replace it)."""
    k = len(drafts)
    if rows.shape[0] != k + 1:
        raise ValueError(f"slot {slot}: {rows.shape[0]} rows to verify {k} drafts")
    params = sampler.params(slot)
    if params.greedy and not processor.active([slot]):
        # No processing: every row's argmax at once.
        best = rows.argmax(dim=-1).tolist()
        a = 0
        while a < k and best[a] == drafts[a]:
            a += 1
        return best[: a + 1]
    out: list[int] = []
    for j in range(k + 1):
        pos = first_pos + j
        row = processor.apply(rows[j : j + 1].clone(), [slot], [pos])
        if params.greedy:
            token = int(row.argmax(dim=-1))
        elif j == k:
            token = int(sampler.sample(row, [slot], [pos])[0])  # the bonus: a plain sample
        else:
            token = _accept_or_resample(row, drafts[j], params, sampler.uniforms(slot, pos, 2))
        out.append(token)
        last = j == k or token != drafts[j]
        if record_last or not last:
            processor.record([slot], np.asarray([token], dtype=np.int32))
        if last:
            break
    return out


def _accept_or_resample(row: torch.Tensor, draft: int, params, uniforms: list[float]) -> int:
    """Rejection sampling of one point-mass draft: ``draft`` with probability
    ``p(draft)``, else a token drawn from ``p`` without it (``uniforms``: the
    acceptance test's and the redraw's)."""
    probs = filtered_probs(row, [params])[0]
    total = float(probs.sum())
    if uniforms[0] * total < float(probs[draft]):
        return draft
    probs[draft] = 0.0
    cdf = probs.cumsum(dim=0)
    choice = int(torch.searchsorted(cdf, uniforms[1] * cdf[-1:], right=True)[0])
    kept = torch.nonzero(probs > 0).flatten()
    # Never a token of probability 0 (possible only through rounding at the top of the cdf).
    return int(kept[-1]) if choice >= len(probs) or probs[choice] == 0 else choice

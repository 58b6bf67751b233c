"""Speculative decoding's drafts: what the scheduler proposes for a decoding request
to verify in its next step (docs/speculative.md). No torch: drafts are tokens.

Two drafters, chosen by ``speculative_algorithm``:

- ``ngram`` (prompt lookup): the longest suffix of the request's own tokens (prompt
  and output), at least ``min_match`` and at most ``NGRAM_MAX_MATCH`` tokens long,
  that occurred earlier in them; the tokens that followed its most recent earlier
  occurrence are the draft. Output that copies its context (quoting, editing,
  extracting) is drafted this way.
- ``radix``: what follows the request's whole token sequence in the radix tree
  (``PrefixCache.continuation``: the same prompt and output seen before, an agent
  loop replayed, a retried request), under the request's own ``cache_salt`` only, so
  a draft never carries another tenant's tokens; when the tree has nothing, ``ngram``.

Drafts are proposed for a request in DECODE with room for more than one new token:
after its one token without KV, or after the tokens a grammar forced (they are
computed in the step either way). Structured output drafts too: the worker, which
holds the grammar matchers, cuts the drafts its grammar rejects. A draft never
reaches past ``max_tokens`` or the context (``room - 1`` tokens at most, since the
step samples one more after the accepted drafts).

Adaptive drafting: per request, after every ``ADAPT_WINDOW`` draft tokens whose
acceptance rate was below ``ADAPT_MIN_RATE``, drafting pauses for a number of steps
that doubles each time (from ``ADAPT_PAUSE`` up to ``ADAPT_MAX_PAUSE``) and is reset
by a window that does well. For the whole step, nothing is drafted when more than
``max_batch`` requests decode (past the 32 rows the worker's one-call step takes, a
verification costs about as much as its accepted drafts save: docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixserve.scheduler.config import SPECULATIVE_ALGORITHMS as ALGORITHMS
from radixserve.scheduler.kv_cache import KVCacheManager
from radixserve.scheduler.request import NO_DRAFT, ReqStatus, Request
from radixserve.scheduler.step_io import take_tokens

NGRAM_MAX_MATCH = 8
ADAPT_WINDOW = 16
ADAPT_MIN_RATE = 0.25
ADAPT_PAUSE = 8
ADAPT_MAX_PAUSE = 256


def ngram_draft(
    tokens: np.ndarray, k: int, min_match: int, max_match: int = NGRAM_MAX_MATCH
) -> np.ndarray:
    """Prompt lookup: up to ``k`` tokens that followed the most recent earlier
    occurrence of the longest suffix of ``tokens`` (``min_match`` .. ``max_match``
    tokens long); empty when none is that long."""
    n = len(tokens)
    if k <= 0 or n <= min_match or min_match < 1:
        return NO_DRAFT
    # Earlier positions j where tokens[j] ends a copy of the suffix: start with the
    # last token and extend backwards while any candidate still matches.
    alive = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    length = 1
    for i in range(1, min(max_match, n - 1)):
        if not len(alive):
            break
        ok = alive[alive >= i]
        ok = ok[tokens[ok - i] == tokens[n - 1 - i]]
        if not len(ok):
            break
        alive, length = ok, i + 1
    if length < min_match or not len(alive):
        return NO_DRAFT
    j = int(alive[-1])  # the most recent of the longest
    return tokens[j + 1 : j + 1 + k]


class Drafter:
    """Proposes each step's drafts and keeps the counters of what was verified."""

    def __init__(
        self,
        algorithm: str,
        num_draft_tokens: int,
        min_match: int,
        max_batch: int,
        kv: KVCacheManager,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"speculative algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
            )
        self.algorithm = algorithm
        self.k = num_draft_tokens
        self.min_match = min_match
        self.max_batch = max_batch
        self.kv = kv  # its cache: the tree (wrapped by event recorders or tiers)
        self.draft_tokens = 0  # proposed and verified
        self.accepted_tokens = 0
        self.verifications = 0

    @property
    def enabled(self) -> bool:
        return self.algorithm != "off" and self.k > 0

    def propose(self, decoding: Sequence[Request]) -> bool:
        """Set the drafts (``req.spec.draft``) of every request in ``decoding`` (empty for most);
        whether any got one."""
        for req in decoding:
            req.spec.draft = NO_DRAFT
        if not self.enabled or len(decoding) > self.max_batch:
            return False
        any_draft = False
        for req in decoding:
            if req.spec.pause > 0:
                req.spec.pause -= 1
                continue
            room = min(req.sampling.max_tokens - req.num_output, req.final_len - req.num_tokens)
            k = min(self.k, room - 1)
            if k <= 0 or req.status is not ReqStatus.DECODE or req.num_tokens - req.kv_len < 1:
                continue
            req.spec.draft = self.draft(req, k)
            any_draft |= len(req.spec.draft) > 0
        return any_draft

    def drop(self, reqs: Sequence[Request]) -> None:
        """No drafts for ``reqs`` this step after all (pages are short)."""
        for req in reqs:
            req.spec.draft = NO_DRAFT

    def draft(self, req: Request, k: int) -> np.ndarray:
        """Up to ``k`` draft tokens for ``req`` by the configured algorithm."""
        tokens = req.tokens[: req.num_tokens]
        draft = NO_DRAFT
        if self.algorithm == "radix":
            draft = self.kv.cache.continuation(tokens, k, req.salt)
        if not len(draft):
            draft = ngram_draft(tokens, k, self.min_match)
        # An image's key ids (negative, scheduler/images.py) are no tokens to propose.
        keyed = np.flatnonzero(draft < 0)
        return draft[: keyed[0]] if len(keyed) else draft

    def take_verified(
        self,
        req: Request,
        tokens: list[int] | None,
        eos: frozenset[int],
        forced: list[int] | None = None,
        grammar_done: bool = False,
    ) -> tuple[list[int], str | None]:
        """Take a verification of ``req``'s drafts: ``tokens`` are the accepted drafts,
        then the token sampled after them, cut exactly at a stop token, ``max_tokens``
        or the context like any sampled tokens (``take_tokens``); return those taken
        and the finish reason. K/V now covers every token but the last (those past a
        cut included, which are no tokens: they are dropped with their pages); the
        pages past it go back to the allocator. With a grammar, ``forced``
        (jump-forward) replaces the sampled token: those tokens have no K/V yet."""
        drafts = len(req.spec.draft)
        if tokens is None or not 1 <= len(tokens) <= drafts + 1:
            raise ValueError(f"the worker verified no drafts for {req.rid!r}")
        accepted = len(tokens) - 1
        computed = req.kv_len + accepted  # the real token's K/V and the accepted drafts'
        run = tokens[:-1] + forced if forced else tokens
        new, reason = take_tokens(req, run, eos, grammar_done)
        self.record(req, drafts, accepted)
        req.spec.draft = NO_DRAFT
        req.kv_len = min(computed, req.num_tokens - 1)
        self.kv.trim(req)
        return new, reason

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """Count one verification of ``drafted`` tokens, ``accepted`` of them taken,
        and pause the request's drafting when its acceptance stays low."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.verifications += 1
        spec = req.spec
        spec.window_drafted += drafted
        spec.window_accepted += accepted
        if spec.window_drafted < ADAPT_WINDOW:
            return
        if spec.window_accepted < ADAPT_MIN_RATE * spec.window_drafted:
            spec.backoff = min(max(2 * spec.backoff, ADAPT_PAUSE), ADAPT_MAX_PAUSE)
            spec.pause = spec.backoff
        else:
            spec.backoff = 0
        spec.window_drafted = spec.window_accepted = 0

    def stats(self) -> dict[str, int]:
        return {
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_verifications": self.verifications,
        }

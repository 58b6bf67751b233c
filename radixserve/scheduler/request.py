"""A request as the scheduler sees it: tokens, state, and its KV bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from radixserve.protocol import ImageInput, OutputItem
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.cache_state import RequestCacheState
from radixserve.scheduler.prefix_cache import CacheNode

# Tokens of room a new request's buffers get beyond its prompt; they double from there.
INITIAL_ROOM = 64
NO_DRAFT = np.zeros(0, dtype=np.int32)  # no drafts (shared, never written)


def _grown(buf: np.ndarray, need: int, cap: int) -> np.ndarray:
    """A copy of ``buf`` with room for at least ``need`` entries: double, at most ``cap``."""
    new = np.zeros(min(max(need, 2 * len(buf)), max(cap, need)), dtype=buf.dtype)
    new[: len(buf)] = buf
    return new


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or retracted and queued again
    # Admitted (a slot, its pages), but some of its cached prefix is still being
    # copied up from the host or disk tier: it computes once every page arrived.
    LOADING = "loading"
    PREFILL = "prefill"  # holds a slot; computing its prompt (possibly in chunks)
    DECODE = "decode"  # holds a slot; one token per step
    FINISHED = "finished"  # stop / length / abort; its KV is released


@dataclass(eq=False, slots=True)
class SpecState:
    """A request's speculative decoding (``speculative.py``): the drafts of the step in
    flight (the tokens after ``tokens[:num_tokens]`` it verifies; they never enter
    ``tokens`` unverified), and the adaptive drafting's state."""

    draft: np.ndarray = field(default_factory=lambda: NO_DRAFT)
    window_drafted: int = 0  # draft tokens verified since the window began
    window_accepted: int = 0  # and accepted of them
    pause: int = 0  # steps left without drafts
    backoff: int = 0  # the last pause's length


@dataclass(eq=False, slots=True)
class RequestStats:
    """What a request reports of its service, fixed at its first admission."""

    queued_at: float = 0.0  # the scheduler's clock at arrival (queue time)
    cached_tokens: int = -1  # hit length at first admission (-1: not admitted yet)
    tier_hits: tuple[int, ...] = (0, 0, 0, 0)  # of those, by tier (pool, host, disk, store)
    # Prompt tokens its cache_retention hint holds (fewer when clipped at a retention
    # cap; 0: no hint, nothing fit, or an eviction policy without retention).
    retained_tokens: int = 0
    explain: dict | None = None  # the cache's explain at arrival (sampling.explain)


@dataclass(eq=False, slots=True)
class Request:
    """One sample of a client request (``n > 1`` makes n of these).

    Tokens live in an int32 buffer: ``tokens[:num_tokens]`` is the prompt
    followed by the sampled tokens. The buffer and the page table start small
    and grow (doubling, up to ``final_len``) as the request does, so a large
    ``max_tokens`` costs nothing until it is generated. KV exists for ``tokens[:kv_len]``;
    while running, ``kv_len < num_tokens`` (the last sampled token has no KV
    yet). The page table ``table[:num_pages]`` covers the KV (only
    ``KVCacheManager`` writes it); the first ``sent_pages`` entries are already
    known to the worker.

    KV ownership: ``locked_len`` tokens are on the cache path the request
    locks through ``node``; the cache owns their pages except the duplicates
    in ``dups`` (pages the request computed while another request cached the
    same tokens; with ``cache="none"``, every computed page), which the request
    frees when it releases its KV. Pages from ``locked_len // page_size`` on are
    the request's own.

    Prompt logprobs: ``score_next`` is the first prompt position still to be
    scored (-1: none). The logits of the position before it must be computed,
    so the request may match at most ``score_next - 1`` tokens in the cache
    (``match_len``); the entries collect in ``prompt_scores`` and go out with
    the first sampled token.
    """

    rid: str
    index: int
    prompt_len: int
    sampling: SamplingParams
    salt: str | None
    arrival: int
    tokens: np.ndarray
    num_tokens: int
    table: np.ndarray
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: str | None = None
    slot: int | None = None
    num_pages: int = 0
    sent_pages: int = 0
    kv_len: int = 0
    node: CacheNode | None = None
    locked_len: int = 0
    dups: list[np.ndarray] = field(default_factory=list)
    # The hit of its admission's match in each cache tier (L1 pool, L2 host, L3 disk;
    # pages promoted for it count in their tier even though it computes steps
    # later), in tokens; taken into ``stats.tier_hits`` at first admission.
    cached_by_tier: tuple[int, ...] = (0, 0, 0, 0)
    admitted: int = -1  # admission counter (retraction picks the newest)
    waited_steps: int = 0
    preemptions: int = 0  # times retracted for a request of a better priority
    announced: bool = False  # the worker has its sampling params
    final_len: int = 0  # the most tokens it can ever hold (prompt + max_tokens, capped)
    score_next: int = -1
    prompt_scores: list | None = None
    lora: int = 0  # its LoRA adapter's id (0: the base model; scheduler/lora.py)
    # The KV cache's own per-request record (recurrent-state snapshots, window pages):
    # only the cache side reads it (``cache_state.py``).
    cache_state: RequestCacheState = field(default_factory=RequestCacheState)
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding
    stats: RequestStats = field(default_factory=RequestStats)  # what it reports
    # The worker's page table for the slot is longer than ``sent_pages`` (pages past a
    # verification's accepted tokens were freed): the next step tells it to cut.
    table_cut: bool = False
    # Prefill/decode disaggregation (``disagg.py``): the prefill server to pull this
    # request's prompt KV from (None: computed here), and its pull while unanswered.
    kv_source: str | None = None
    remote: object = None
    # The prompt's images: their runs in ``tokens`` hold key ids (``images.py``).
    images: tuple[ImageInput, ...] = ()

    @classmethod
    def create(
        cls,
        rid: str,
        index: int,
        prompt: np.ndarray,
        sampling: SamplingParams,
        salt: str | None,
        arrival: int,
        final_len: int,
        table_pages: int,
    ) -> Request:
        """A waiting request that may grow to ``final_len`` tokens in ``table_pages`` pages.

        Its buffers hold the prompt and ``INITIAL_ROOM`` tokens of room to grow."""
        size = min(final_len, len(prompt) + INITIAL_ROOM)
        tokens = np.zeros(size, dtype=np.int32)
        tokens[: len(prompt)] = prompt
        table = np.zeros(min(table_pages, size), dtype=np.int32)
        req = cls(rid, index, len(prompt), sampling, salt, arrival, tokens, len(prompt), table)
        req.final_len = final_len
        # Scored once per request (sample 0): position 0 has no logprob.
        if sampling.prompt_logprobs is not None and index == 0:
            req.prompt_scores = [None] * len(prompt)
            first = max(sampling.logprob_start_len, 1)
            if first < len(prompt):
                req.score_next = first
        return req

    @property
    def match_len(self) -> int:
        """How many leading tokens may come from the cache: all but the last one
        (its logits give the next token), and none a prompt logprob needs."""
        n = self.num_tokens - 1
        return n if self.score_next < 0 else min(n, self.score_next - 1)

    def append_token(self, token: int) -> None:
        """Add a sampled token (growing the buffer when full)."""
        if self.num_tokens == len(self.tokens):
            self.tokens = _grown(self.tokens, self.num_tokens + 1, self.final_len)
        self.tokens[self.num_tokens] = token
        self.num_tokens += 1

    def table_room(self, num_pages: int) -> np.ndarray:
        """The page table, grown if needed to hold ``num_pages`` entries."""
        if num_pages > len(self.table):
            self.table = _grown(self.table, num_pages, max(num_pages, 2 * len(self.table)))
        return self.table

    @property
    def key(self) -> tuple[str, int]:
        return (self.rid, self.index)

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    def output(
        self,
        token_ids: list[int],
        logprobs: list | None = None,
        prompt_logprobs: list | None = None,
    ) -> OutputItem:
        """What the request produced now (``token_ids``), as the protocol carries it."""
        return OutputItem(
            self.rid,
            self.index,
            token_ids,
            self.finish_reason,
            self.prompt_len,
            self.num_output,
            max(self.stats.cached_tokens, 0),
            logprobs,
            prompt_logprobs,
            cached_tokens_by_tier=list(self.stats.tier_hits),
            retained_tokens=self.stats.retained_tokens,
            explain=self.stats.explain if self.finish_reason is not None else None,
        )

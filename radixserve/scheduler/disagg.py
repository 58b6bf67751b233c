"""Prefill/decode disaggregation, the schedulers' side
(docs/scale-out.md#prefilldecode-disaggregation).

A decode server's request that names a prefill server (``kv_source``) is admitted as
usual: its prefix is matched in the decode server's own tree and locked, and pages
are taken for the rest of its prompt. Its whole pages beyond the match, up to
``match_len`` (all but the last prompt token), are then **pulled**: ``DecodeSide``
sends a ``KVPull`` naming those pages to the prefill server, and the request is
LOADING (it holds its slot and pages and computes nothing) until the answer. The
prefill server (``PrefillSide``) computes the pulled tokens as a prefill-only
request (its own tree serves what it holds), locks the result in its tree, has its
worker write the pages the decode side lacks straight into the reserved pages
(``KVSend``, ``worker/kv_transfer.py``), and answers ``KVPushed``. The decode side
then counts the pages as computed and inserts them into its tree ("cache early"),
and the request prefills what is left (at least its last prompt token, whose
logits give the first token) and decodes: sampling, logprobs, grammars, ``n``,
priorities all happen on the decode server, as without disaggregation.

Who owns the reserved pages, and when (the decode side):

- from admission until the pull is answered, they are the request's own pages but
  are not in the tree, so nobody else reads them and nothing half-written is ever
  inserted;
- answered ``ok``: they hold the KV, ``cache_computed`` inserts them;
- answered with a failure: the prefill side writes nothing more, so the request keeps
  the pages and computes them itself (a local prefill);
- no answer within ``timeout`` seconds, or the request leaves (abort, finish by
  timeout, retraction) while pulling: a ``KVCancel`` goes out and the pages are
  **quarantined**, held by nobody, until the pull is answered (the prefill side
  answers a cancel once nothing of the pull is in flight) or ``quarantine`` seconds
  have passed (the prefill server is taken for gone); the request, if it still
  runs, gets fresh pages and prefills locally (requeued when the pool has none now).

The prefill side starts no write of a pull later than ``timeout`` seconds after the
pull reached it (``KVPull.expires_in``; its worker checks ``KVSend.deadline`` just
before writing), while the decode side holds the pages ``timeout + quarantine``
seconds at least: a write still in flight when the quarantine ends would have to
have taken ``quarantine`` seconds. So a transfer never hangs a request, never leaks
a page, and never writes into a page another request holds.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixserve.protocol import KVCancel, KVPull, KVPushed
from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.request import Request


@dataclass(eq=False)
class Pull:
    """One pull of the decode side: ``pages`` of ``req`` (its table's entries from
    ``first`` on) filled by the prefill server at ``source``; ``tokens`` are covered
    once they arrive. ``req`` is None once it let go (the pages are quarantined)."""

    rid: str
    req: Request | None
    source: str
    first: int
    pages: np.ndarray
    tokens: int
    started: float
    deadline: float


#: The pulls whose latencies the percentiles in ``stats`` are taken over.
LATENCY_WINDOW = 4096


@dataclass
class TransferStats:
    """What either side counts (``stats()``, the ``kv_transfer_*`` keys)."""

    pulls: int = 0
    pages_pulled: int = 0  # pages that arrived (decode) / were sent (prefill)
    pages_skipped: int = 0  # prompt pages the decode side held already: never sent
    failures: int = 0  # answered with a failure, or timed out
    timeouts: int = 0
    fallbacks: int = 0  # requests prefilled on the decode side after all
    # The latest arrived pulls' latencies (the percentiles), and all of them (the mean).
    seconds: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    seconds_total: float = 0.0
    arrived: int = 0
    bytes_per_page: int = 0  # one page of every layer

    def arrival(self, seconds: float) -> None:
        self.seconds.append(seconds)
        self.seconds_total += seconds
        self.arrived += 1

    def snapshot(self, prefix: str) -> dict[str, Any]:
        s = sorted(self.seconds)
        p = (lambda q: s[min(len(s) - 1, int(q * len(s)))]) if s else (lambda q: 0.0)
        return {
            f"{prefix}pulls": self.pulls,
            f"{prefix}pages_sent": self.pages_pulled,
            f"{prefix}pages_skipped": self.pages_skipped,
            f"{prefix}bytes_sent": self.pages_pulled * self.bytes_per_page,
            f"{prefix}bytes_skipped": self.pages_skipped * self.bytes_per_page,
            f"{prefix}failures": self.failures,
            f"{prefix}timeouts": self.timeouts,
            f"{prefix}fallbacks": self.fallbacks,
            f"{prefix}latency_mean": self.seconds_total / self.arrived if self.arrived else 0.0,
            f"{prefix}latency_p50": p(0.5),
            f"{prefix}latency_p99": p(0.99),
        }


class DecodeSide:
    """A decode server's pulls (module docstring). The scheduler's parts call it
    where a request's pages change hands: ``wants`` / ``start`` (admission),
    ``waiting`` (is it LOADING), ``detach`` (its KV is released), and each step
    ``expire``; the process delivers ``outbox`` and hands answers to ``answered``."""

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        descriptor: dict[str, Any],
        timeout: float,
        quarantine: float,
        clock: Callable[[], float],
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.descriptor = descriptor  # the worker's pool: session, layers, page_bytes, identity
        self.timeout = timeout
        self.quarantine = quarantine
        self.clock = clock
        self.pulls: dict[str, Pull] = {}
        self.outbox: list[tuple[str, KVPull | KVCancel]] = []  # (prefill endpoint, message)
        self.stats = TransferStats()
        self.stats.bytes_per_page = descriptor["page_bytes"] * len(descriptor["layers"])
        self._ids = itertools.count(1)
        # Set by the scheduler: what to do with a running request whose pull failed
        # and whose pages are quarantined (fresh pages, or back to the queue).
        self.regrow: Callable[[Request], None] = lambda req: None
        # Set by the scheduler: ``KVCacheManager.cache_computed``.
        self.cache_computed: Callable[[Request], None] = lambda req: None

    # ---------------------------------------------------------- admission
    def covered(self, req: Request) -> int:
        """The tokens a pull would leave computed: ``match_len`` in whole pages."""
        return req.match_len - req.match_len % self.page_size

    def wants(self, req: Request) -> bool:
        """Whether ``req``, its prefix matched (``kv_len``), pulls: it names a prefill
        server and at least one whole page is missing."""
        return (
            req.kv_source is not None
            and not req.lora
            and self.covered(req) - req.kv_len >= self.page_size
        )

    def start(self, req: Request) -> None:
        """Pull the pages after ``req``'s match (its table covers its prompt now)."""
        ps = self.page_size
        first, end = req.kv_len // ps, self.covered(req) // ps
        now = self.clock()
        pull = Pull(
            f"{next(self._ids)}:{req.rid}:{req.index}",
            req,
            req.kv_source,  # type: ignore[arg-type]
            first,
            req.table[first:end].copy(),
            end * ps,
            now,
            now + self.timeout,
        )
        self.pulls[pull.rid] = pull
        req.remote = pull
        d = self.descriptor
        self.outbox.append(
            (
                pull.source,
                KVPull(
                    pull.rid,
                    req.tokens[: pull.tokens].copy(),
                    req.salt,
                    first,
                    pull.pages,
                    d["session"],
                    list(d["layers"]),
                    d["page_bytes"],
                    d.get("identity", ""),
                    req.sampling.priority,
                    self.timeout,
                ),
            )
        )
        self.stats.pulls += 1
        self.stats.pages_skipped += first

    def waiting(self, req: Request) -> bool:
        """Whether ``req``'s pull is not answered yet (it stays LOADING)."""
        return req.remote is not None

    # ------------------------------------------------------------ answers
    def answered(self, msg: KVPushed) -> None:
        """The prefill side is done with pull ``msg.rid``: the pages arrived (``ok``:
        they are computed, and inserted into the tree) or will not (the request
        computes them itself); a quarantined pull's pages are free again."""
        pull = self.pulls.pop(msg.rid, None)
        if pull is None:
            return  # answered already, or the quarantine ended
        req = pull.req
        if req is None:
            self.allocator.free(pull.pages)
            return
        req.remote = None
        if not msg.ok:
            req.kv_source = None  # it prefills here, now and if it comes back
        if msg.ok:
            req.kv_len = pull.tokens
            self.cache_computed(req)
            self.stats.pages_pulled += len(pull.pages)
            self.stats.arrival(self.clock() - pull.started)
        else:
            self.stats.failures += 1
            self.stats.fallbacks += 1

    def expire(self) -> None:
        """Pulls past their deadline are given up (their requests prefill locally);
        quarantines past theirs end."""
        now = self.clock()
        for pull in [p for p in self.pulls.values() if p.deadline <= now]:
            if pull.req is None:  # the prefill side never answered: taken for gone
                del self.pulls[pull.rid]
                self.allocator.free(pull.pages)
                continue
            req = pull.req
            self.stats.timeouts += 1
            self.stats.failures += 1
            self.stats.fallbacks += 1
            self.detach(req)
            self.regrow(req)

    def detach(self, req: Request) -> None:
        """``req`` lets go of its pull (released, or given up): its reserved pages
        leave its table for the quarantine, and the prefill side is told."""
        pull: Pull = req.remote  # type: ignore[assignment]
        req.remote = None
        pull.req = None
        pull.deadline = self.clock() + self.quarantine
        # Nothing after its match was computed (it was LOADING): the pages past the
        # pulled ones are freed, its table ends at the match.
        first, n = pull.first, len(pull.pages)
        self.allocator.free(req.table[first + n : req.num_pages].copy())
        req.num_pages = first
        self.outbox.append((pull.source, KVCancel(pull.rid)))

    # --------------------------------------------------------- scheduler
    @property
    def busy(self) -> bool:
        """Pulls or messages outstanding: the scheduler keeps turning."""
        return bool(self.pulls or self.outbox)

    def quarantined_pages(self) -> int:
        return sum(len(p.pages) for p in self.pulls.values() if p.req is None)

    def take_outbox(self) -> list[tuple[str, KVPull | KVCancel]]:
        out, self.outbox = self.outbox, []
        return out

"""Prefill/decode disaggregation, the prefill server's side: ``PrefillSide``.

A decode server's ``KVPull`` becomes a prefill-only request of this scheduler (its
tree serves what it holds; ``max_tokens`` 0: computed, cached, done). When it is
computed, its pages are matched and locked in the tree and a ``KVSend`` goes to the
worker with the next step; when the worker reports it, the pages are unlocked and the
decode side is answered (``KVPushed``). A ``KVCancel`` aborts a pull still computing;
one being sent is answered once the send is over. The decode side, and who owns
which page when: ``disagg.py``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.protocol import KVPull, KVPushed, KVSend, KVSent, OutputItem
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.disagg import TransferStats


@dataclass(eq=False)
class Serving:
    """One pull the prefill side serves: its request ``rid`` computes ``pull``'s
    tokens; then its pages are locked (``node``) and sent under ``ticket``."""

    sender: bytes
    pull: KVPull
    rid: str
    deadline: float  # no send starts later (``KVPull.expires_in`` after it arrived)
    node: Any = None
    ticket: int = 0
    hit: int = 0
    cancelled: bool = False


class PrefillSide:
    """A prefill server's pulls (module docstring): each is a prefill-only request
    of the scheduler, then a ``KVSend`` of its worker, then an answer."""

    def __init__(self, scheduler: Any, identity: str) -> None:
        self.scheduler = scheduler  # the Scheduler: add, abort, its cache
        self.identity = identity
        # This machine's monotonic clock: the worker checks sends' deadlines by it.
        self.clock: Callable[[], float] = time.monotonic
        self.serving: dict[str, Serving] = {}  # by the scheduler's request id
        self._by_pull: dict[tuple[bytes, str], Serving] = {}
        self._by_ticket: dict[int, Serving] = {}
        self._sends: list[KVSend] = []
        self._tickets = itertools.count(1)
        self.outbox: list[tuple[bytes, KVPushed]] = []  # (decode side's identity, answer)
        self.stats = TransferStats()

    def pull(self, sender: bytes, msg: KVPull) -> None:
        """A decode side's pull: queued as a prefill-only request, or refused."""
        key = (sender, msg.rid)
        if key in self._by_pull:
            return  # a duplicate: the first is being served
        problem = self._problem(msg)
        if problem is not None:
            self.outbox.append((sender, KVPushed(msg.rid, False, problem)))
            return
        rid = f"kv-pull:{sender.hex()}:{msg.rid}"
        params = SamplingParams(max_tokens=0, priority=msg.priority)
        try:
            self.scheduler.add_request(rid, msg.input_ids, params, salt=msg.salt)
        except ValueError as e:
            self.outbox.append((sender, KVPushed(msg.rid, False, str(e))))
            return
        serving = Serving(sender, msg, rid, self.clock() + msg.expires_in)
        self.serving[rid] = serving
        self._by_pull[key] = serving
        self.stats.pulls += 1
        self.stats.bytes_per_page = msg.page_bytes * len(msg.dst_layers)

    def _problem(self, msg: KVPull) -> str | None:
        ps = self.scheduler.page_size
        n = len(msg.input_ids)
        if n == 0 or n % ps:
            return f"a pull covers whole pages of {ps} tokens, got {n} tokens"
        if not 0 <= msg.skip < n // ps or len(msg.dst_pages) != n // ps - msg.skip:
            return "a pull's destination pages do not match its tokens"
        if msg.kv_identity != self.identity:
            return (
                f"the decode server's KV layout ({msg.kv_identity}) is not this "
                f"server's ({self.identity})"
            )
        if not self.scheduler.kv.enabled:
            return "the prefill server runs with --cache none"
        return None

    def cancel(self, sender: bytes, rid: str) -> None:
        """The decode side gave pull ``rid`` up: stop computing it; once nothing of
        it is in flight, answer."""
        serving = self._by_pull.get((sender, rid))
        if serving is None:
            self.outbox.append((sender, KVPushed(rid, False, "unknown or finished pull")))
            return
        serving.cancelled = True
        if serving.ticket == 0:  # still computing: it ends here
            self.scheduler.abort_request(serving.rid)

    def take_outputs(self, outputs: list[OutputItem]) -> list[OutputItem]:
        """The step's outputs less those of pull requests, which end here: a
        computed pull's pages are locked and sent, a failed one is answered."""
        rest = []
        for out in outputs:
            serving = self.serving.get(out.rid)
            if serving is None:
                rest.append(out)
            elif out.finish_reason is not None:
                self._computed(serving, out)
        return rest

    def _computed(self, serving: Serving, out: OutputItem) -> None:
        del self.serving[serving.rid]
        pull = serving.pull
        if serving.cancelled or out.finish_reason != "length":
            self._answer(serving, False, out.error or f"the prefill ended: {out.finish_reason}")
            return
        if self.clock() > serving.deadline:
            self._answer(serving, False, "the pull expired before its pages were computed")
            return
        cache = self.scheduler.cache
        m = cache.match_prefix(pull.input_ids, pull.salt)
        if m.hit_len < len(pull.input_ids):  # evicted meanwhile cannot happen: same turn
            self._answer(serving, False, "the prefill's pages were not cached")
            return
        cache.lock(m.last_node)
        serving.node, serving.hit = m.last_node, out.cached_tokens
        serving.ticket = next(self._tickets)
        self._by_ticket[serving.ticket] = serving
        src = np.asarray(m.pages[pull.skip :], dtype=np.int32)
        self._sends.append(
            KVSend(
                serving.ticket,
                pull.session,
                src,
                pull.dst_pages,
                pull.dst_layers,
                pull.page_bytes,
                serving.deadline,
            )  # fmt: skip
        )

    def take_sends(self) -> list[KVSend]:
        sends, self._sends = self._sends, []
        return sends

    def sent(self, reports: list[KVSent]) -> None:
        """The worker's reports: unlock the pages, answer the decode side."""
        for report in reports:
            serving = self._by_ticket.pop(report.ticket, None)
            if serving is None:
                continue
            self.scheduler.cache.unlock(serving.node)
            if report.ok:
                self.stats.pages_pulled += len(serving.pull.dst_pages)
                self.stats.pages_skipped += serving.pull.skip
            self._answer(serving, report.ok, report.error)

    def _answer(self, serving: Serving, ok: bool, error: str = "") -> None:
        self._by_pull.pop((serving.sender, serving.pull.rid), None)
        if not ok:
            self.stats.failures += 1
        sent = len(serving.pull.dst_pages) if ok else 0
        self.outbox.append(
            (serving.sender, KVPushed(serving.pull.rid, ok, error, sent, serving.hit))
        )

    @property
    def busy(self) -> bool:
        return bool(self._by_ticket or self._sends or self.outbox)

    @property
    def in_flight(self) -> bool:
        """Sends the worker has not reported: steps must go on to hear of them."""
        return bool(self._by_ticket)

    def take_outbox(self) -> list[tuple[bytes, KVPushed]]:
        out, self.outbox = self.outbox, []
        return out

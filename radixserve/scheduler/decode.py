"""Decode growth and its reverse: which running requests grow a page this step, and
which are retracted or preempted to make room.

``DecodeManager`` plans a step's decode rows (``plan``): every running request past
its prefill (the chunked one aside) computes its next token, or the tokens a
grammar forced after its last one, and its drafts under speculative decoding
(``speculative.py``). Their pages are allocated together; when evicting unlocked
leaves cannot free enough, the drafts are dropped first, then the newest request
is retracted, until the rest fit (or, when retracting cannot help but copies in
flight lock pages, the decodes wait a step for them).

Under the priority policy it also makes room for the best waiting request before
anything is planned (``preempt``): running requests of a worse priority are
retracted, the chunked prefill first, then the worst and newest, until that
request fits.

A retracted request leaves the running set with its KV released into the tree
(unlocked) and goes back to the front of the queue (``Admission.requeue``), so it
resumes from the cache. It owns the retraction counters.
"""

from __future__ import annotations

from radixserve.scheduler.admission import Admission
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_cache import KVCacheManager
from radixserve.scheduler.request import ReqStatus, Request
from radixserve.scheduler.reserve import DecodeReserve
from radixserve.scheduler.running import RunningSet
from radixserve.scheduler.speculative import Drafter


class DecodeManager:
    """The step's decode rows and the retractions that make room (module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        running: RunningSet,
        admission: Admission,
        reserve: DecodeReserve,
        drafter: Drafter,
    ) -> None:
        self.config = config
        self.kv = kv
        self.running = running
        self.admission = admission
        self.reserve = reserve
        self.drafter = drafter
        self.num_retractions = 0  # every retraction, priority's included
        self.num_priority_preemptions = 0

    def plan(self) -> list[tuple[Request, int]]:
        """The step's decode rows, ``(request, tokens)``: its one token (or the tokens
        a grammar forced after the last one), then its drafts to verify. Pages first:
        allocate, evict, drop the drafts, then retract the newest."""
        drafted = self.drafter.propose(self.running.decoding())
        while True:
            decoding = self.running.decoding()
            if self.kv.grow_decodes(decoding):
                break
            if drafted:
                # Short of pages: the drafts go before any request is retracted.
                self.drafter.drop(decoding)
                drafted = False
                continue
            tiers = self.kv.tiers
            if not self._retractable() and tiers is not None and tiers.pages_loading:
                # Pages locked by copies in flight come back once they are reported:
                # the decodes wait a step rather than fail.
                self.drafter.drop(decoding)
                return []
            self._retract_newest()
        rows = [(r, r.num_tokens - r.kv_len + len(r.spec.draft)) for r in decoding]
        if rows:
            self.reserve.decay()
        return rows

    def preempt(self) -> None:
        """Under the priority policy: make room at once for the best waiting request
        (lowest ``priority``, then oldest). A worse request mid-way through a chunked
        prefill is retracted first (its chunk would take the step's token budget before
        any admission; it is admitted again after the better one, in the same step when
        budget is left, and resumes from its cached chunks); then, while the best one
        cannot be admitted (no free slot, or too few pages), running requests of a
        worse priority, worst and newest first. Their computed KV goes into the tree,
        so they resume from the cache; one preempted ``max_preemptions`` times is not
        preempted again."""
        waiting = self.admission.waiting
        if not waiting or not self.running:
            return
        best = min(waiting, key=lambda r: (r.sampling.priority, r.arrival))
        if not self.admission.grammar_ready(best):
            return  # its grammar is still compiling: room made now would go unused
        level = best.sampling.priority
        victims = [
            r
            for r in self.running
            if r.sampling.priority > level
            and r.preemptions < self.config.max_preemptions
            and r.status in (ReqStatus.PREFILL, ReqStatus.DECODE)
        ]
        chunked = self.running.chunked
        if chunked in victims and self.kv.enabled:
            # Without a cache its chunks would be computed again: it keeps its budget.
            victims.remove(chunked)
            self._preempt_one(chunked)
        victims.sort(key=lambda r: (r.sampling.priority, r.admitted), reverse=True)
        for victim in victims:
            if self.admission.fits(best):
                return
            self._preempt_one(victim)

    def _preempt_one(self, victim: Request) -> None:
        victim.preemptions += 1
        self.retract(victim)
        self.num_priority_preemptions += 1

    def retract(self, req: Request) -> None:
        """Send a running request back to the front of the queue; its computed KV
        stays in the tree, unlocked, so it resumes from there."""
        self.kv.release(req)
        self.running.remove(req)
        self.admission.requeue(req)
        self.num_retractions += 1

    def _retract_newest(self) -> None:
        """Send the most recently admitted running request back to the queue.

        Even a request running alone may be retracted: it can hold duplicates
        of pages the tree also holds for it (it computed a prefix while another
        request cached the same one), which the fit check in add_request cannot count.
        Retraction frees them; re-admitted, it matches its own KV in the tree.
        A lone request without such duplicates always fits (add_request checks);
        with ``cache="none"`` the cache holds no copy of anything.
        """
        if not self._retractable():
            raise RuntimeError("out of KV pages with a single running request")
        self.retract(self.running.newest())
        self.reserve.reset()  # reservations proved too optimistic

    def _retractable(self) -> bool:
        """Whether retracting can free pages (see ``_retract_newest``)."""
        running = self.running
        lone = len(running) == 1
        return bool(running) and not (lone and not (self.kv.enabled and running[0].dups))

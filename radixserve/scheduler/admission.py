"""Admission and its reverse: which waiting requests get a slot and pages in a
step, and which running ones give them back.

``Admission`` is the half of ``Scheduler`` (scheduler.py) that decides, within
a step's token budget and the pool's memory budget, who runs:

- decodes first (``_schedule_decodes``): every running request past its prefill
  grows by its next token's page when it crosses a page boundary (and by its
  drafts' pages under speculative decoding, ``speculative.py``); when evicting
  unlocked leaves cannot free enough, the drafts are dropped, then the newest
  request is retracted;
- the LOADING requests whose pages the cache tiers have delivered start their
  prefill (``_start_loaded``);
- waiting requests are admitted by policy (``_admit``) while the token budget,
  the pages (free + evictable, minus the running requests' reservations) and
  the slots allow; under the priority policy, running requests of a worse
  priority are preempted first for the best waiting one (``_preempt``).

A retracted or preempted request goes back to the front of the queue; its
computed KV stays in the tree, unlocked, so it resumes from the cache.

The state it works on (the queue, the running list, the slots, the counters) is
the Scheduler's: this class holds methods only and is not used on its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.scheduler.policy import order_waiting, shared_prefix_len
from radixserve.scheduler.request import ReqStatus, Request

if TYPE_CHECKING:
    from collections.abc import Callable

    from radixserve.scheduler.config import SchedulerConfig
    from radixserve.scheduler.grammars import Grammars
    from radixserve.scheduler.kv_cache import KVCacheManager
    from radixserve.scheduler.lora import LoraRegistry
    from radixserve.scheduler.reserve import DecodeReserve
    from radixserve.scheduler.speculative import Drafter
    from radixserve.scheduler.waiting import QueueTimes, WaitingQueue


class Admission:
    """The admission methods of ``Scheduler``; the attributes below are its."""

    config: SchedulerConfig
    page_size: int
    kv: KVCacheManager
    reserve: DecodeReserve
    grammars: Grammars
    loras: LoraRegistry
    drafter: Drafter
    waiting: WaitingQueue
    running: list[Request]
    chunked: Request | None
    _free_slots: list[int]
    _release: list[int]
    _admissions: int
    hit_tokens: int
    query_tokens: int
    tier_hit_tokens: list[int]
    num_retractions: int
    num_priority_preemptions: int
    queue_times: QueueTimes
    clock: Callable[[], float]

    def _fits(self, req: Request) -> bool:
        """Whether ``req`` could be admitted now, as ``_admit`` counts (a slot, its
        prompt's pages beyond its cached prefix, its decode reservation)."""
        if not self._free_slots:
            return False
        kv = self.kv
        hit = kv.peek(req) if kv.enabled else 0
        need = kv.pages_for(req.num_tokens) - hit // self.page_size
        final = kv.pages_for(req.final_len) - kv.pages_for(req.num_tokens)
        reserve = self.reserve.of(final)
        return need + reserve <= kv.available_pages - self.reserve.held(self.running, kv)

    def _preempt(self) -> None:
        """Under the priority policy: make room at once for the best waiting request
        (lowest ``priority``, then oldest). A worse request mid-way through a chunked
        prefill is retracted first (its chunk would take the step's token budget before
        any admission; it is admitted again after the better one, in the same step when
        budget is left, and resumes from its cached chunks); then, while the best one
        cannot be admitted (no free slot, or too few pages), running requests of a
        worse priority, worst and newest first. Their computed KV goes into the tree,
        so they resume from the cache; one preempted ``max_preemptions`` times is not
        preempted again."""
        if not self.waiting or not self.running:
            return
        best = min(self.waiting, key=lambda r: (r.sampling.priority, r.arrival))
        so = best.sampling.structured
        if so is not None and not self.grammars.ready(so.key):
            return  # its grammar is still compiling: room made now would go unused
        level = best.sampling.priority
        victims = [
            r
            for r in self.running
            if r.sampling.priority > level
            and r.preemptions < self.config.max_preemptions
            and r.status in (ReqStatus.PREFILL, ReqStatus.DECODE)
        ]
        chunked = self.chunked
        if chunked in victims and self.kv.enabled:
            # Without a cache its chunks would be computed again: it keeps its budget.
            victims.remove(chunked)
            self._preempt_one(chunked)
        victims.sort(key=lambda r: (r.sampling.priority, r.admitted), reverse=True)
        for victim in victims:
            if self._fits(best):
                return
            self._preempt_one(victim)

    def _preempt_one(self, victim: Request) -> None:
        victim.preemptions += 1
        self._retract(victim)
        self.num_priority_preemptions += 1

    def _schedule_decodes(self, batch: list[tuple[Request, int]]) -> None:
        decoding = [
            r for r in self.running if r is not self.chunked and r.status is ReqStatus.DECODE
        ]
        drafted = self.drafter.propose(decoding)  # speculative decoding's drafts
        while True:
            decoding = [
                r for r in self.running if r is not self.chunked and r.status is ReqStatus.DECODE
            ]
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
                return
            self._retract_newest()
        # One token each, or the tokens a grammar forced after the last one; then the
        # drafts to verify.
        batch.extend((r, r.num_tokens - r.kv_len + len(r.draft)) for r in decoding)

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
        self._retract(max(self.running, key=lambda r: r.admitted))
        self.reserve.reset()  # reservations proved too optimistic

    def _mark_divergences(self, rest: list[Request], in_flight: list[Request]) -> None:
        """Hybrid models: requests left waiting this step that share a prefix with a
        prompt being prefilled get a state snapshot where they part from it (the
        prefill saves it), as the held-back requests above do."""
        if self.kv.states is None or not in_flight:
            return
        ps = self.page_size
        for req in rest:
            shared = min(shared_prefix_len(req, in_flight), req.match_len)
            if shared >= self.config.shared_prefix_min_tokens:
                self.kv.mark_divergence(req, in_flight, shared - shared % ps)

    def _retract(self, req: Request) -> None:
        """Send a running request back to the front of the queue; its computed KV
        stays in the tree, unlocked, so it resumes from there."""
        self.running.remove(req)
        if req is self.chunked:
            self.chunked = None
        self.kv.release(req)
        self._free_slot(req)
        req.status = ReqStatus.WAITING
        req.announced = False
        self.waiting.appendleft(req)
        self.num_retractions += 1

    def _retractable(self) -> bool:
        """Whether retracting can free pages (see ``_retract_newest``)."""
        lone = len(self.running) == 1
        return bool(self.running) and not (lone and not (self.kv.enabled and self.running[0].dups))

    def _start_loaded(
        self, batch: list[tuple[Request, int]], budget: int, in_flight: list[Request]
    ) -> int:
        """Start the prefill of LOADING requests whose pages have all arrived, in
        admission order, within ``budget`` tokens; the budget left."""
        for req in self.running:
            if budget <= 0:
                break
            if req.status is not ReqStatus.LOADING or self.kv.loading(req):
                continue
            chunk = req.num_tokens - req.kv_len
            if chunk > budget:
                if self.chunked is not None:
                    continue
                chunk = budget
                self.chunked = req
            req.status = ReqStatus.PREFILL
            budget -= chunk
            batch.append((req, chunk))
            in_flight.append(req)
        return budget

    def _admit(
        self, batch: list[tuple[Request, int]], budget: int, in_flight: list[Request]
    ) -> int:
        """Admit waiting requests by policy within ``budget`` prompt tokens (and the
        pages and slots); the budget left. Under the priority policy a step prefills
        one level only, the best of those with prompt tokens to compute (the
        candidates come best first): a worse request's prompt would make the better
        one's first token wait for it."""
        cfg = self.config
        ps = self.page_size
        if not self.waiting:
            return budget
        candidates = order_waiting(self.waiting, self.kv, cfg)
        by_level = cfg.schedule_policy == "priority"
        top = min((r.sampling.priority for r in in_flight), default=None)
        reserved = self.reserve.held(self.running, self.kv)
        admitted: list[Request] = []
        skipped = 0
        adapters = {r.lora for r in self.running}
        for i, req in enumerate(candidates):
            if budget <= 0 or not self._free_slots:
                self._mark_divergences(candidates[i : i + cfg.max_admit_skips], in_flight)
                break
            if by_level and top is not None and req.sampling.priority > top:
                break  # the rest are of this level or worse: they prefill in a later step
            if not self.loras.fits(req.lora, adapters):
                continue  # --max-loras adapters run already: it waits for one to finish
            so = req.sampling.structured
            if so is not None and not self.grammars.ready(so.key):
                continue  # its grammar is still compiling: the others go on
            if self.kv.enabled and in_flight:
                # Hold it back while a prompt being prefilled shares a real prefix
                # with it that is not cached yet (in whole pages, the only part it
                # can ever hit): it will hit that prefix once the prefill is done.
                shared = shared_prefix_len(req, in_flight)
                sibling = any(f.rid == req.rid for f in in_flight)
                # peek only when it can matter: it walks the tree
                if shared >= (1 if sibling else cfg.shared_prefix_min_tokens) and (
                    shared - shared % ps > self.kv.peek(req)
                ):
                    # A hybrid model's prefill saves its state where they part.
                    point = min(shared, req.match_len)
                    self.kv.mark_divergence(req, in_flight, point - point % ps)
                    continue
            hit = self.kv.acquire_prefix(req)  # the pool's (L1) match
            need = self.kv.pages_missing(req, req.num_tokens)
            final_pages = self.kv.pages_missing(req, req.final_len) - need
            reserve = self.reserve.of(final_pages)
            if need + reserve > self.kv.available_pages - reserved:
                # Pass it over: a request that does not fit must not hold back
                # smaller ones behind it (it is tried again next step, first
                # once it has aged under lpm, and its reservation shrinks).
                self.kv.release_prefix(req)
                skipped += 1
                if skipped > cfg.max_admit_skips:
                    break
                continue
            # Pages the lower tiers hold come from the budget just checked.
            hit = self.kv.promote(req)
            loading = self.kv.loading(req)
            chunk = req.num_tokens - hit
            if chunk > budget and not loading:
                if self.chunked is not None:
                    self.kv.release_prefix(req)
                    break
                chunk = budget
            # The memory budget above counts evictable pages: this cannot fail. The
            # window pages of its first chunk (a model's sliding layers) can.
            if not self.kv.grow_window(req, chunk) or not self.kv.grow(req, req.num_tokens):
                self.kv.release_prefix(req)
                break
            reserved += reserve
            if req.cached_tokens < 0:
                req.cached_tokens = hit
                req.tier_hits = req.cached_by_tier
                self.hit_tokens += hit
                for i, n in enumerate(req.tier_hits):
                    self.tier_hit_tokens[i] += n
                self.query_tokens += req.prompt_len
                self.queue_times.observe(req.sampling.priority, self.clock() - req.queued_at)
            req.slot = self._free_slots.pop()
            req.admitted = self._admissions
            self._admissions += 1
            self.running.append(req)
            adapters.add(req.lora)
            admitted.append(req)
            if loading:
                req.status = ReqStatus.LOADING  # computes once its pages arrived
                continue
            req.status = ReqStatus.PREFILL
            budget -= chunk
            if chunk < req.num_tokens - req.kv_len:
                self.chunked = req
            in_flight.append(req)
            batch.append((req, chunk))
            if top is None or req.sampling.priority < top:
                top = req.sampling.priority
        for req in admitted:
            self.waiting.remove(req)
        for req in self.waiting:
            req.waited_steps += 1
        return budget

    def _free_slot(self, req: Request) -> None:
        if req.announced:  # a LOADING request's slot never reached the worker
            self._release.append(req.slot)
        self._free_slots.append(req.slot)
        req.slot = None

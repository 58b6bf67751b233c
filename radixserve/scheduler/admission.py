"""Admission, the prefill adder: which waiting requests enter a step, and every
prompt chunk the step computes.

``Admission`` owns the waiting queue and what admission counts (cache hits, queue
times). Each step, after the decodes took their rows (``decode.py``), ``plan``
fills the prefill budget, in order:

1. the chunked prefill in progress continues (under the priority policy, when a
   better request waits, only at the end and only if no better one prefills);
2. the LOADING requests whose pages the cache tiers have delivered start their
   prefill, in admission order (``_start_loaded``);
3. waiting requests are admitted by policy (``_admit``) while the token budget,
   the pages (free + evictable, minus the running requests' reservations) and
   the slots allow. A request is tried in steps: is it ready (its LoRA adapter
   fits the batch, its grammar compiled), is it held back (it shares a prefix
   not cached yet with a prompt of this step, or with a prompt whose pages a
   decode server is pulling: it waits and hits it), does
   it fit (its pool match, locked, and its pages; one that does not is passed
   over, up to ``max_admit_skips`` per step), then it is placed (promotion from
   the lower tiers, its first chunk's pages), counted and takes a slot.

A retracted or preempted request comes back to the front of the queue
(``requeue``); its computed KV stays in the tree, unlocked, so it resumes from
the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.grammars import Grammars
from radixserve.scheduler.kv_cache import KVCacheManager
from radixserve.scheduler.lora import LoraRegistry
from radixserve.scheduler.policy import order_waiting, shared_prefix_len
from radixserve.scheduler.request import ReqStatus, Request
from radixserve.scheduler.reserve import DecodeReserve
from radixserve.scheduler.running import RunningSet
from radixserve.scheduler.waiting import QueueTimes, WaitingQueue


@dataclass(eq=False)
class Prefills:
    """The prompt chunks of one step: ``(request, tokens)`` rows within ``budget``
    prompt tokens, and the requests whose prompts they are (``prompts``)."""

    budget: int
    rows: list[tuple[Request, int]] = field(default_factory=list)
    prompts: list[Request] = field(default_factory=list)

    def add(self, req: Request, chunk: int) -> None:
        self.rows.append((req, chunk))
        self.prompts.append(req)
        self.budget -= chunk


class Admission:
    """The waiting queue and the step's prefill rows (module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        running: RunningSet,
        reserve: DecodeReserve,
        grammars: Grammars,
        loras: LoraRegistry,
    ) -> None:
        self.config = config
        self.page_size = config.page_size
        self.kv = kv
        self.running = running
        self.reserve = reserve
        self.grammars = grammars
        self.loras = loras
        self.waiting = WaitingQueue()
        # Counted at each request's first admission (stats()).
        self.hit_tokens = 0
        self.query_tokens = 0
        self.tier_hit_tokens = [0, 0, 0, 0]  # hit_tokens by tier: pool, host, disk, store
        self.queue_times = QueueTimes()  # arrival to first admission, by priority

    def requeue(self, req: Request) -> None:
        """A retracted request goes back before every waiting one."""
        req.status = ReqStatus.WAITING
        req.announced = False
        self.waiting.appendleft(req)

    def grammar_ready(self, req: Request) -> bool:
        """Whether ``req`` has no grammar or the worker has compiled it."""
        so = req.sampling.structured
        return so is None or self.grammars.ready(so.key)

    def fits(self, req: Request) -> bool:
        """Whether ``req`` could be admitted now, as ``_admit`` counts (a slot, its
        prompt's pages beyond its cached prefix, its decode reservation)."""
        if not self.running.has_free_slot:
            return False
        kv = self.kv
        hit = kv.peek(req) if kv.enabled else 0
        need = kv.pages_for(req.num_tokens) - hit // self.page_size
        final = kv.pages_for(req.final_len) - kv.pages_for(req.num_tokens)
        reserve = self.reserve.of(final)
        return need + reserve <= kv.available_pages - self.reserve.held(self.running, kv)

    # ------------------------------------------------------------- the step
    def plan(self, budget: int, now: float) -> list[tuple[Request, int]]:
        """The step's prompt rows within ``budget`` tokens (steps 1-3 above); ``now``
        is the scheduler's clock (queue times)."""
        step = Prefills(budget)
        chunked = self.running.chunked
        defer = chunked is not None and self._better_waits(chunked)
        if chunked is not None and not defer:
            self._continue_chunk(chunked, step)
        self._start_loaded(step)
        if step.budget > 0:
            self._admit(step, now)
        if defer and self.running.chunked is chunked and step.budget > 0:
            level = chunked.sampling.priority
            if not any(r.sampling.priority < level for r in step.prompts):
                self._continue_chunk(chunked, step)
        return step.rows

    def _better_waits(self, chunked: Request) -> bool:
        """Under the priority policy a better waiting request is admitted before a
        worse chunk goes on (it goes on only if no better one prefills in the step)."""
        return (
            self.config.schedule_policy == "priority"
            and bool(self.waiting)
            and min(r.sampling.priority for r in self.waiting) < chunked.sampling.priority
        )

    def _continue_chunk(self, req: Request, step: Prefills) -> None:
        """The chunked prefill's next chunk, within the budget."""
        chunk = min(req.num_tokens - req.kv_len, step.budget)
        # Short of window pages (decodes took them): it waits a step.
        if self.kv.grow_window(req, chunk):
            step.add(req, chunk)

    def _start_loaded(self, step: Prefills) -> None:
        """Start the prefill of LOADING requests whose pages have all arrived, in
        admission order, within the budget."""
        for req in self.running:
            if step.budget <= 0:
                break
            if req.status is not ReqStatus.LOADING or self.kv.loading(req):
                continue
            self._count_store_hit(req)
            chunk = req.num_tokens - req.kv_len
            if chunk > step.budget:
                if self.running.chunked is not None:
                    continue
                chunk = step.budget
                self.running.chunked = req
            req.status = ReqStatus.PREFILL
            step.add(req, chunk)

    # ------------------------------------------------------------ admission
    def _admit(self, step: Prefills, now: float) -> None:
        """Admit waiting requests by policy within the budget (and the pages and
        slots). Under the priority policy a step prefills one level only, the best
        of those with prompt tokens to compute (the candidates come best first): a
        worse request's prompt would make the better one's first token wait for it."""
        cfg = self.config
        if not self.waiting:
            return
        candidates = order_waiting(self.waiting, self.kv, cfg)
        by_level = cfg.schedule_policy == "priority"
        top = min((r.sampling.priority for r in step.prompts), default=None)
        reserved = self.reserve.held(self.running, self.kv)
        admitted: list[Request] = []
        skipped = 0
        adapters = {r.lora for r in self.running}
        # A decode server's requests whose prompt pages are being pulled hold back the
        # ones that share them, as a prefill does: those then pull only the rest.
        pulling = [r for r in self.running if r.remote is not None]
        for i, req in enumerate(candidates):
            if step.budget <= 0 or not self.running.has_free_slot:
                self._mark_divergences(candidates[i : i + cfg.max_admit_skips], step.prompts)
                break
            if by_level and top is not None and req.sampling.priority > top:
                break  # the rest are of this level or worse: they prefill in a later step
            if not self._ready(req, adapters) or self._held_back(req, step.prompts + pulling):
                continue
            reserve = self._match(req, reserved)
            if reserve is None:
                # Passed over: a request that does not fit must not hold back smaller
                # ones behind it (it is tried again next step, first once it has aged
                # under lpm, and its reservation shrinks).
                skipped += 1
                if skipped > cfg.max_admit_skips:
                    break
                continue
            placed = self._place(req, step.budget)
            if placed is None:
                break
            hit, chunk, loading = placed
            reserved += reserve
            self._count_first_admission(req, hit, now)
            self.running.add(req)
            adapters.add(req.lora)
            admitted.append(req)
            if loading:
                req.status = ReqStatus.LOADING  # computes once its pages arrived
                if req.remote is not None:
                    pulling.append(req)
                continue
            req.status = ReqStatus.PREFILL
            if chunk < req.num_tokens - req.kv_len:
                self.running.chunked = req
            step.add(req, chunk)
            if top is None or req.sampling.priority < top:
                top = req.sampling.priority
        for req in admitted:
            self.waiting.remove(req)
        for req in self.waiting:
            req.waited_steps += 1

    def _ready(self, req: Request, adapters: set[int]) -> bool:
        """Whether ``req`` may run at all now: its LoRA adapter joins the batch within
        ``--max-loras`` (else it waits for one to finish) and its grammar compiled
        (else the others go on)."""
        return self.loras.fits(req.lora, adapters) and self.grammar_ready(req)

    def _held_back(self, req: Request, prompts: list[Request]) -> bool:
        """Hold ``req`` back while a prompt being prefilled shares a real prefix with
        it that is not cached yet (in whole pages, the only part it can ever hit): it
        will hit that prefix once the prefill is done. A hybrid model's prefill saves
        its state where they part."""
        if not (self.kv.enabled and prompts):
            return False
        ps = self.page_size
        shared = shared_prefix_len(req, prompts)
        sibling = any(f.rid == req.rid for f in prompts)
        # peek only when it can matter: it walks the tree
        if shared < (1 if sibling else self.config.shared_prefix_min_tokens) or (
            shared - shared % ps <= self.kv.peek(req)
        ):
            return False
        point = min(shared, req.match_len)
        self.kv.mark_divergence(req, prompts, point - point % ps)
        return True

    def _match(self, req: Request, reserved: int) -> int | None:
        """Match and lock ``req``'s prefix in the pool (L1) and judge its fit: its
        prompt's missing pages and its own reservation within the available pages
        less ``reserved``. Returns its reservation, or None (the match let go) when
        it does not fit."""
        kv = self.kv
        kv.acquire_prefix(req)
        need = kv.pages_missing(req, req.num_tokens)
        reserve = self.reserve.of(kv.pages_missing(req, req.final_len) - need)
        if need + reserve > kv.available_pages - reserved:
            kv.release_prefix(req)
            return None
        return reserve

    def _place(self, req: Request, budget: int) -> tuple[int, int, bool] | None:
        """Promote ``req``'s pages from the lower tiers (they come from the budget
        ``_match`` checked) and take the pages of its prompt and the window pages of
        its first chunk. Returns (hit, first chunk, LOADING), or None (its prefix
        let go) when admission stops here: its prompt would be a second chunked
        prefill, or the window pages are short."""
        kv = self.kv
        hit = kv.promote(req)
        # Its pages beyond the match come from a prefill server (disagg.py), or else
        # are asked of the shared KV store.
        pull = kv.remote is not None and kv.remote.wants(req)
        loading = pull or kv.loading(req) or kv.will_fetch(req)
        chunk = req.num_tokens - hit
        if chunk > budget and not loading:
            if self.running.chunked is not None:
                kv.release_prefix(req)
                return None
            chunk = budget
        # The memory budget counted evictable pages: grow cannot fail. The window
        # pages of its first chunk (a model's sliding layers) can.
        if not kv.grow_window(req, chunk) or not kv.grow(req, req.num_tokens):
            kv.release_prefix(req)
            return None
        if pull:
            kv.remote.start(req)  # type: ignore[union-attr]
        else:
            kv.fetch_from_store(req, counts=req.stats.cached_tokens < 0)
        return hit, chunk, loading

    def _count_first_admission(self, req: Request, hit: int, now: float) -> None:
        """Its cache hit and queue time, counted once (a retracted request admitted
        again counts nothing)."""
        stats = req.stats
        if stats.cached_tokens >= 0:
            return
        stats.cached_tokens = hit
        stats.tier_hits = req.cached_by_tier
        self.hit_tokens += hit
        for i, n in enumerate(stats.tier_hits):
            self.tier_hit_tokens[i] += n
        self.query_tokens += req.prompt_len
        self.queue_times.observe(req.sampling.priority, now - stats.queued_at)

    def _count_store_hit(self, req: Request) -> None:
        """A LOADING request's pages read from the shared store (they arrived, or
        some did not: it computes from the first missing one); counted as its hit
        when it was admitted the first time."""
        n, counts = self.kv.take_store_hit(req)
        if not (n and counts):
            return
        stats = req.stats
        stats.cached_tokens += n
        stats.tier_hits = (*stats.tier_hits[:3], stats.tier_hits[3] + n)
        self.hit_tokens += n
        self.tier_hit_tokens[3] += n

    def _mark_divergences(self, rest: list[Request], prompts: list[Request]) -> None:
        """Hybrid models: requests left waiting this step that share a prefix with a
        prompt being prefilled get a state snapshot where they part from it (the
        prefill saves it), as the held-back requests do."""
        if self.kv.states is None or not prompts:
            return
        ps = self.page_size
        for req in rest:
            shared = min(shared_prefix_len(req, prompts), req.match_len)
            if shared >= self.config.shared_prefix_min_tokens:
                self.kv.mark_divergence(req, prompts, shared - shared % ps)

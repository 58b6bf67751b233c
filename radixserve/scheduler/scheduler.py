"""The scheduler: continuous batching over the radix cache, one step at a time.

The lifecycle of a request:

    WAITING --admit--> PREFILL (chunks) --last chunk sampled--> DECODE --> FINISHED
     ^  |                   ^   |                                   |
     |  +-admit-> LOADING --+   |  (LOADING: pages copied up from the cache
     |              |           |   tiers, or pulled from a prefill server
     |              |           |   (disagg.py), have not all arrived; then PREFILL)
     +-- retract ---+-----------+-----------------------------------+

``Scheduler`` is composed of parts that own their state; it keeps the requests by
id, their deadlines and the outputs between steps, and runs the step:

- ``RunningSet`` (running.py): the running requests, their slots, the chunked prefill;
- ``DecodeManager`` (decode.py): the decode rows, which running requests grow a page
  and which are retracted (pages short) or preempted (priority);
- ``Admission`` (admission.py): the waiting queue and the prefill rows, which waiting
  requests enter the step and the chunks of every prompt;
- ``KVCacheManager`` (kv_cache.py): who owns which page; ``DecodeReserve``
  (reserve.py): the pages admission keeps for running requests' decodes;
- ``Drafter`` (speculative.py), ``Grammars`` (grammars.py), ``LoraRegistry``
  (lora.py): speculative decoding, structured output's grammars, LoRA adapters;
- ``CacheMonitor`` (monitor.py): the dashboard's history and figures; ``explain``
  (explain.py) reads the cache for one prompt, changing nothing.

Each step is lockstep with the worker: ``step(run)`` plans what the worker must
compute (a ``protocol.Step``), has ``run`` compute it and return the sampled
tokens, decides who finished, and returns the outputs, those of aborts and
timeouts since the last step included. Between steps the caller may add and abort
requests; it steps while ``has_work()``. A step, in order:

1. requests past their ``request_timeout`` fail;
2. under the priority policy, worse running requests make room for the best
   waiting one (``DecodeManager.preempt``);
3. every running request that is not mid-prefill decodes (``DecodeManager.plan``);
4. the prefill budget left (``prefill_budget``) goes to the chunked prefill, the
   LOADING requests whose pages arrived and the waiting requests admitted by
   policy (``Admission.plan``);
5. the step is built: each row's ``StepReq``, the slots released since the last
   step, grammars and LoRA adapters to load or drop, copies between cache tiers;
6. the worker runs it; its tokens are taken back, and requests finish.

Cache tiers (``tiered_cache.py``, docs/cache-tiers.md): a step also carries the
copies between tiers that planning caused, under a ticket; the worker reports
each ticket when its copies are done, possibly steps later. A request admitted
with pages promoted from the host or disk tier, or whose match reaches pages
another request's promotion is still filling, is LOADING: it holds its slot and
pages but computes nothing until every page of its match has arrived. While
tickets are in flight the scheduler keeps stepping (``has_work``), and a step with
nothing else to do lets the worker wait for the next ticket.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from radixserve.protocol import REQUEST_TIMED_OUT, ImageInput, OutputItem, Step, StepResult
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.admission import Admission
from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.disagg import DecodeSide
from radixserve.scheduler.disagg_prefill import PrefillSide
from radixserve.scheduler.explain import explain
from radixserve.scheduler.grammars import Grammars
from radixserve.scheduler.images import check_images, keyed_prompt
from radixserve.scheduler.kv_events import KVEventRecorder
from radixserve.scheduler.lora import LoraRegistry, check_salt, namespace
from radixserve.scheduler.monitor import CacheMonitor, dashboard_data
from radixserve.scheduler.radix_impl import build_kv_cache
from radixserve.scheduler.request import ReqStatus, Request
from radixserve.scheduler.reserve import DecodeReserve
from radixserve.scheduler.running import RunningSet
from radixserve.scheduler.speculative import Drafter
from radixserve.scheduler.step_io import Returned, file_scores, step_req, take_tokens
from radixserve.scheduler.waiting import QueueTimes, WaitingQueue

# What the worker returns for a step (a bare token sequence: test doubles), and the
# worker as ``step`` takes it.
WorkerResult = StepResult | np.ndarray | Sequence[int]
RunStep = Callable[[Step], WorkerResult]


class Scheduler:
    """Requests in, steps planned and run, outputs out (module docstring)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages, config.page_size)
        # The KV cache: the radix core with its components, the tiers around it.
        self.kv = build_kv_cache(self.allocator, config)
        self.cache = self.kv.cache
        # What the metrics label evictions with: "none" when nothing is cached.
        self.cache_policy = config.radix_eviction_policy if config.cache != "none" else "none"
        # The parts (module docstring).
        self.reserve = DecodeReserve(config)
        self.grammars = Grammars()  # structured output's, compiled by the worker
        self.loras = LoraRegistry(config.max_loras, config.loras)  # docs/lora.md
        self.drafter = Drafter(
            config.speculative_algorithm,
            config.speculative_num_draft_tokens,
            config.speculative_min_match,
            config.speculative_max_batch,
            self.kv,
        )
        self.running = RunningSet(config.max_running_requests)
        self.admission = Admission(
            config, self.kv, self.running, self.reserve, self.grammars, self.loras
        )
        self.decodes = DecodeManager(
            config, self.kv, self.running, self.admission, self.reserve, self.drafter
        )
        # The requests by id (every sample), until all their samples finished.
        self._requests: dict[str, list[Request]] = {}
        self._arrivals = 0
        self._eos = frozenset(config.eos_token_ids)
        # Per-request timeouts (``request_timeout``): (deadline, arrival, rid), earliest
        # first; ``clock`` is replaceable (tests).
        self.clock: Callable[[], float] = time.monotonic
        self._deadlines: list[tuple[float, int, str]] = []
        self._outputs: list[OutputItem] = []  # produced outside a step (aborts)
        self._batch: list[tuple[Request, int]] = []  # (request, tokens computed) of the step
        self._sampled: list[bool] = []  # which requests of the step in flight sample
        # Answers to LoRA loads: (the caller's tag, reply), for the caller to take.
        self.lora_replies: list[tuple] = []
        self.num_steps = 0
        self.num_timeouts = 0
        self.monitor = CacheMonitor(config.page_size)  # the dashboard's figures
        # Prefill/decode disaggregation (disagg.py): this server's side, if any.
        self.disagg: DecodeSide | PrefillSide | None = None
        # The worker's vision encoder: images encoded, and served from its cache.
        self.encoder_runs = 0
        self.encoder_hits = 0

    def serve_decode(self, descriptor: dict[str, Any], timeout: float, quarantine: float) -> None:
        """Be a decode server: requests with a ``kv_source`` pull their prompt's pages
        from that prefill server into this worker's pool (``descriptor``)."""
        self._check_disaggregation()
        clock = lambda: self.clock()  # noqa: E731 (the clock is replaceable: tests)
        side = DecodeSide(self.allocator, self.page_size, descriptor, timeout, quarantine, clock)
        side.regrow = self._pull_given_up
        side.cache_computed = self.kv.cache_computed
        self.disagg = self.kv.remote = side

    def serve_prefill(self, identity: str) -> None:
        """Be a prefill server: ``disagg.pull`` computes and sends a decode side's pages."""
        self._check_disaggregation()
        if not self.kv.enabled:
            raise ValueError("a prefill server sends pages out of its tree: --cache radix")
        self.disagg = PrefillSide(self, identity)

    def _check_disaggregation(self) -> None:
        if self.kv.windows is not None or self.kv.states is not None:
            raise ValueError(
                "--disaggregation moves full-attention pages only: not for a model with "
                "a sliding-window pool or recurrent states"
            )

    def _pull_given_up(self, req: Request) -> None:
        """A running request's pull timed out: it prefills here, on fresh pages, or
        waits in the queue for them."""
        req.kv_source = None
        if not self.kv.grow(req, req.num_tokens):
            self.decodes.retract(req)

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        rid: str,
        prompt_ids: np.ndarray | list[int],
        sampling: SamplingParams,
        salt: str | None = None,
        lora: str | None = None,
        kv_source: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> None:
        """Queue a request (``sampling.n`` samples), under the LoRA adapter named
        ``lora`` (None: the base model), its prompt holding ``images`` (their
        placeholder runs; keyed by content in the cache: ``images.py``); on a decode
        server, its prompt's KV pulled from the prefill server ``kv_source`` (a prompt
        with images is prefilled here: pulls carry token ids only). Raises ValueError on
        bad input."""
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if kv_source is not None and not isinstance(self.disagg, DecodeSide):
            raise ValueError("kv_source is for a decode server (--disaggregation decode)")
        prompt = self.check_request(prompt_ids, sampling)
        check_salt(salt)
        check_images(prompt, images)
        prompt = keyed_prompt(prompt, images)
        report = self._explain_arrival(prompt, salt, lora) if sampling.explain else None
        adapter = None
        if lora is not None:
            adapter = self.loras.lookup(lora)
            salt = namespace(salt, adapter.digest)  # the adapter's own cache namespace
        final_len = self._final_len(len(prompt), sampling)
        # Every sample is built before any is queued: a failure queues nothing.
        samples = []
        now = self.clock()
        for i in range(sampling.n):
            params = sampling
            if sampling.n > 1 and sampling.seed is not None:
                # One sample of n: validation checked seed + n - 1 fits already.
                params = replace(sampling, seed=sampling.seed + i, n=1)
            req = Request.create(
                rid,
                i,
                prompt,
                params,
                salt,
                self._arrivals,
                final_len,
                self.kv.pages_for(final_len),
            )
            self._arrivals += 1
            req.stats.queued_at = now
            req.stats.explain = report
            req.images = tuple(images)
            if adapter is not None:
                req.lora = adapter.id
            req.kv_source = None if images else kv_source
            samples.append(req)
        if adapter is not None:
            self.loras.acquire(adapter, len(samples))
        self.waiting.extend(samples)
        self._requests[rid] = samples
        if sampling.request_timeout is not None:
            heapq.heappush(
                self._deadlines, (self.clock() + sampling.request_timeout, self._arrivals, rid)
            )
        if sampling.structured is not None:
            self.grammars.use(sampling.structured, len(samples))

    def check_request(
        self, prompt_ids: np.ndarray | Sequence[int], sampling: SamplingParams
    ) -> np.ndarray:
        """The prompt as int32 if a request for it can ever run; else ValueError."""
        cfg = self.config
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise ValueError("the prompt is empty")
        if len(prompt) >= cfg.max_context_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the model's context is "
                f"{cfg.max_context_len}, leaving no room for output"
            )
        if sampling.prompt_logprobs is not None and sampling.logprob_start_len > len(prompt):
            raise ValueError(
                f"logprob_start_len is {sampling.logprob_start_len}; the prompt has "
                f"{len(prompt)} tokens"
            )
        need = self.kv.pages_for(self._final_len(len(prompt), sampling))
        if need > cfg.num_pages:
            raise ValueError(
                f"the request needs {need} KV pages (prompt {len(prompt)} + max_tokens "
                f"{sampling.max_tokens}) but the pool has {cfg.num_pages}"
            )
        return prompt

    def _final_len(self, prompt_len: int, sampling: SamplingParams) -> int:
        """The most tokens a request can hold: prompt + max_tokens, within the context."""
        return min(prompt_len + sampling.max_tokens, self.config.max_context_len)

    def abort_request(self, rid: str, reason: str = "abort", index: int | None = None) -> bool:
        """Finish ``rid`` now: every sample, or only sample ``index``.

        ``reason`` is "abort", or "stop" when the detokenizer saw a stop string.
        Computed KV stays cached. Returns False for an unknown (or finished) id.
        """
        samples = self._requests.get(rid)
        if samples is None:
            return False
        for req in samples:
            if req.status == ReqStatus.FINISHED or (index is not None and req.index != index):
                continue
            self._finish(req, reason)
            self._outputs.append(req.output([]))
        return True

    def has_work(self) -> bool:
        """Whether ``step`` has anything to do: requests waiting or running, outputs
        not handed over yet, or released slots and grammars the worker has not
        been told of."""
        return bool(
            self.waiting
            or self.running
            or self._outputs
            or self.running.num_releasing
            or self.grammars.news_pending
            or self.copies_pending
            or self.loras.busy
            or (self.disagg is not None and self.disagg.busy)
        )

    @property
    def copies_pending(self) -> bool:
        """Whether copies between cache tiers wait for a step or are in flight."""
        tiers = self.kv.tiers
        return tiers is not None and (tiers.has_copies or tiers.in_flight > 0)

    @property
    def only_copies_pending(self) -> bool:
        """No request queued or running, but copies between cache tiers still wait
        for a step or are in flight: step until this is False before a flush that
        must empty every tier, or an idle check."""
        return self.copies_pending and not (self.running or self.waiting)

    def request_ids(self) -> list[str]:
        """The ids of every request not finished yet (waiting or running)."""
        return list(self._requests)

    @property
    def waiting(self) -> WaitingQueue:
        return self.admission.waiting

    @property
    def chunked(self) -> Request | None:
        """The request whose prefill continues next step."""
        return self.running.chunked

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ----------------------------------------------------------------- step
    def step(self, run: RunStep) -> list[OutputItem]:
        """One step: plan it, ``run`` it (the worker: a Step in, a StepResult or
        just its sampled tokens out), and return every output since the last
        step (aborts and timeouts first).

        A step that only releases slots is run too, so the worker clears them;
        with nothing to compute or release, ``run`` is not called.
        """
        now = self.clock()
        self.monitor.tick(self)
        self._expire(now)  # requests past their timeout fail
        if isinstance(self.disagg, DecodeSide):
            self.disagg.expire()  # pulls past their deadline: prefilled here
        outputs, self._outputs = self._outputs, []  # aborts and failures since the last step
        step = self._build_step(self._plan(now))  # decode rows, then prompt chunks; the Step
        if step is not None:
            result = run(step)  # the worker
            self._copies_reported(step, result)  # cache tiers: copies done
            outputs += self._take_result(result)  # tokens taken back; who finished
        if isinstance(self.disagg, PrefillSide):  # pulls computed or sent: answered
            if step is not None and isinstance(result, StepResult):
                self.disagg.sent(result.kv_sent)
            outputs = self.disagg.take_outputs(outputs)
        return outputs

    def _expire(self, now: float) -> None:
        """End the requests whose ``request_timeout`` has passed (an error; KV released)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, rid = heapq.heappop(self._deadlines)
            samples = self._requests.get(rid)
            if samples is None:
                continue  # finished in time
            timeout = samples[0].sampling.request_timeout
            self.num_timeouts += 1
            self._outputs += self._fail(rid, f"{REQUEST_TIMED_OUT} after {timeout:g} s")

    def _plan(self, now: float) -> list[tuple[Request, int]]:
        """Who computes what this step: the decode rows, then the prompt chunks
        within the prefill budget they leave."""
        assert not self._batch, "the last step's tokens were not taken back"
        if self.config.schedule_policy == "priority":
            self.decodes.preempt()
        batch = self.decodes.plan()
        budget = self.prefill_budget(sum(n for _, n in batch))
        return batch + self.admission.plan(budget, now)

    def prefill_budget(self, decode_tokens: int) -> int:
        """The prompt tokens a step may compute when its decode rows (drafts
        included) carry ``decode_tokens`` tokens.

        With no decode, or ``decode_step_tokens`` 0, it is ``chunked_prefill_size``.
        Otherwise the step carries ``decode_step_tokens`` tokens in all: the prefill
        gets what the decodes leave, in whole pages, at least one page (a prompt
        always progresses) and at most ``chunked_prefill_size``.
        """
        cfg = self.config
        if decode_tokens == 0 or cfg.decode_step_tokens == 0:
            return cfg.chunked_prefill_size
        left = cfg.decode_step_tokens - decode_tokens
        ps = self.page_size
        return min(cfg.chunked_prefill_size, max(ps, left - left % ps))

    def _build_step(self, batch: list[tuple[Request, int]]) -> Step | None:
        """The step the worker runs for ``batch``; None when it has nothing to do."""
        release = self.running.take_released()
        submit, drop = self.grammars.take_news()
        load_loras, drop_loras = self.loras.take_step()
        # With nothing else to do, a step still goes out while a waiting request's
        # grammar compiles: the worker answers it when one is ready (or soon).
        compiling = self.grammars.compiling
        tiers = self.kv.tiers
        copies = tiers.take_copies() if tiers is not None else None
        # Copies in flight: a step goes out so the worker can report them (it waits
        # for the next one to finish when the step has nothing to compute).
        waiting_copies = tiers is not None and tiers.in_flight > 0
        # A prefill server's sends: a step carries them, and steps go on until reported.
        sends = []
        if isinstance(self.disagg, PrefillSide):
            waiting_copies = waiting_copies or self.disagg.in_flight
            sends = self.disagg.take_sends()
        idle = not (
            batch or release or submit or drop or compiling or waiting_copies or load_loras
            or drop_loras or sends
        )  # fmt: skip
        if idle and copies is None:
            return None
        self._batch = batch
        self.num_steps += 1
        kv = self.kv
        if kv.window is None:
            reqs = [step_req(r, n, kv.plan_states(r, n)) for r, n in batch]
        else:  # sliding layers' window pages (docs/models.md)
            reqs = [step_req(r, n, kv.plan_states(r, n), kv.plan_window(r, n)) for r, n in batch]
        self._sampled = [r.sample for r in reqs]
        return Step(
            reqs,
            np.asarray(release, dtype=np.int32),
            self.num_steps,
            submit,
            drop,
            [copies] if copies is not None else [],
            load_loras,
            drop_loras,
            self.kv.take_state_saves(),
            sends,
        )

    def _copies_reported(self, step: Step, result: WorkerResult) -> None:
        """The cache tiers learn that the step ran and which copies are done."""
        tiers = self.kv.tiers
        if tiers is None:
            return
        if step.copies:
            tiers.step_done()
        if isinstance(result, StepResult):
            tiers.copies_done(result.copies_done, result.store_missed)

    def _take_result(self, result: WorkerResult) -> list[OutputItem]:
        """Take the sampled tokens (and logprobs, and what the grammars made of
        them) of the last step; return what it produced."""
        batch, self._batch = self._batch, []
        sampled, self._sampled = self._sampled, []
        outputs = self._take_news(result, batch) if isinstance(result, StepResult) else []
        back = Returned.of(result)
        if len(back.tokens) != sum(sampled):
            raise ValueError(
                f"the worker returned {len(back.tokens)} tokens, expected {sum(sampled)}"
            )
        logprobs = file_scores(batch, back.scores)
        tokens = iter(back.tokens)
        for (req, n), samples in zip(batch, sampled):
            token = next(tokens) if samples else None
            out = self._advance(req, n, token, back, logprobs.get(id(req)))
            if out is not None:
                outputs.append(out)
        return outputs

    def _take_news(self, result: StepResult, batch: list[tuple[Request, int]]) -> list[OutputItem]:
        """The worker's news besides tokens: answers to LoRA loads, grammars compiled
        or failed (their waiting requests fail), and requests it failed."""
        outputs: list[OutputItem] = []
        self.lora_replies += self.loras.take_reports(result.loras)
        self.encoder_runs += result.encoder_runs
        self.encoder_hits += result.encoder_hits
        for key, message in self.grammars.take_result(result):
            rids = {
                r.rid
                for r in self.waiting
                if r.sampling.structured is not None and r.sampling.structured.key == key
            }
            for rid in sorted(rids):
                outputs += self._fail(rid, message)
        by_slot = {req.slot: req for req, _ in batch if req.slot is not None}
        for failure in result.failed:
            req = by_slot.get(failure.slot)
            if req is not None and req.status is not ReqStatus.FINISHED:
                outputs += self._fail(req.rid, failure.message)
        return outputs

    def _advance(
        self, req: Request, n: int, token: int | None, back: Returned, entries: list | None
    ) -> OutputItem | None:
        """``req`` computed ``n`` tokens in the step and sampled ``token`` (None: a
        non-final prefill chunk); ``entries``: the logprobs of what it sampled. Its
        output, or None when it has none (mid-prefill, or finished meanwhile)."""
        if req.status is ReqStatus.FINISHED:
            self.drafter.drop([req])
            return None  # failed (or aborted) after the step was planned
        drafts = len(req.spec.draft)
        req.kv_len += n - drafts  # the drafts' K/V counts once verified (below)
        if req.kv_len < req.num_tokens:  # a non-final prefill chunk
            self.kv.cache_computed(req)
            return None
        prompt_scores = None
        if req.status is ReqStatus.PREFILL:
            if req is self.running.chunked:
                self.running.chunked = None
            self.kv.cache_computed(req)
            req.status = ReqStatus.DECODE
            prompt_scores, req.prompt_scores = req.prompt_scores, None
        sp = req.sampling
        if sp.max_tokens == 0:  # prefill only: computed, cached, scored; done
            self._finish(req, "length")
            return req.output([], None, prompt_scores)
        slot = req.slot
        done = slot in back.terminated  # its grammar is complete
        if drafts:
            verified = back.verified.get(slot)
            new, reason = self.drafter.take_verified(
                req, verified, self._eos, back.forced.get(slot), done
            )
        else:
            new, reason = take_tokens(req, back.forced.get(slot, [token]), self._eos, done)
        if reason is not None:
            self._finish(req, reason)
        if sp.logprobs is not None and entries is None:
            raise ValueError(f"the worker returned no logprobs for {req.rid!r}")
        # One entry per token sampled (a verification's every token; with
        # jump-forward the sampled one only).
        logprobs = None if entries is None else entries[: len(new)]
        return req.output(new, logprobs, prompt_scores)

    def _fail(self, rid: str, message: str) -> list[OutputItem]:
        """End every sample of ``rid`` still unfinished with finish_reason "error"."""
        outputs = []
        for req in self._requests.get(rid, []):
            if req.status is ReqStatus.FINISHED:
                continue
            self._finish(req, "error")
            item = req.output([])
            item.error = message
            outputs.append(item)
        return outputs

    # -------------------------------------------------------------- helpers
    def _finish(self, req: Request, reason: str) -> None:
        """End ``req``, waiting or running: its KV is released (computed pages stay
        cached), its slot, grammar and adapter let go."""
        waiting = req.status is ReqStatus.WAITING
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if waiting:
            self.waiting.remove(req)
        else:
            self.kv.release(req)  # while it holds its slot (running.py)
            self.running.remove(req)
            self.monitor.finished(req)
        if req.sampling.structured is not None:
            self.grammars.release(req.sampling.structured)
        if req.lora:
            self.loras.release(req.lora)
        samples = self._requests.get(req.rid)
        if samples is not None and all(s.status == ReqStatus.FINISHED for s in samples):
            del self._requests[req.rid]

    # ------------------------------------------------------ cache and stats
    def record_kv_events(self) -> KVEventRecorder:
        """From now on, record every change of the tree (``--kv-events``,
        docs/scale-out.md); the recorder wraps the cache (with tiers: the tree below
        them), so call before any request."""
        recorder = self.kv.record_events()
        recorder.lora_info = self.loras.info
        self.cache = self.kv.cache
        return recorder

    def flush_cache(self, keep_disk: bool = False) -> int:
        """Evict every unlocked page now (with tiers: empty the host tier, and the
        disk tier unless ``keep_disk``); returns how many pool pages were freed.
        With copies in flight, what they hold goes when they are done (pages being
        promoted stay in the pool): callers that want every tier empty step until
        ``copies_pending`` is False first (the Engine, the scheduler process)."""
        return self.kv.flush(keep_disk)

    def explain(
        self,
        prompt_ids: np.ndarray | Sequence[int],
        salt: str | None = None,
        lora: str | None = None,
        images: Sequence[ImageInput] = (),
    ) -> dict[str, Any]:
        """What the cache would serve of this prompt now and why no more (``explain.py``),
        under the namespace a request with ``salt`` and ``lora`` would use, its
        ``images`` keyed as ``add_request`` keys them (token ids in the answer are the
        keyed ones: an image's are negative); runs nothing, changes nothing. Raises
        ValueError on bad input (as ``add_request``)."""
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        if prompt.ndim != 1 or len(prompt) == 0:
            raise ValueError("the prompt is empty")
        check_salt(salt)
        check_images(prompt, images)
        prompt = keyed_prompt(prompt, images)
        tree_salt = salt if lora is None else namespace(salt, self.loras.lookup(lora).digest)
        tiers = self.kv.tiers
        out = explain(
            self.kv.cache,
            prompt,
            tree_salt,
            len(prompt) - 1,
            self.kv.evictions,
            None if tiers is None else tiers.lower_tiers,
        )
        out["namespace"] = {"cache_salt": salt, "adapter": lora}
        return out

    def _explain_arrival(self, prompt: np.ndarray, salt: str | None, lora: str | None) -> dict:
        """``explain`` for a request that asked for it: without the most common
        continuation, which may be another client's text in the same namespace (the
        admin's explain call gives it)."""
        report = self.explain(prompt, salt, lora)
        if report["miss"] is not None:
            report["miss"]["most_common"] = None
        return report

    def dashboard(self) -> dict[str, Any]:
        """The dashboard's figures (``monitor.py``), rebuilt at most once a second."""
        return self.monitor.snapshot(lambda: dashboard_data(self))

    def stats(self) -> dict[str, Any]:
        cached = self.cache.cached_pages
        out = {
            "num_pages": self.config.num_pages,
            "page_size": self.page_size,
            "pages_free": self.allocator.num_free,
            "pages_cached": cached,
            "pages_used": self.allocator.num_used - cached,
            "pages_evictable": self.cache.evictable_pages,
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "releasing": self.running.num_releasing,  # finished slots the worker is not told of yet
            "steps": self.num_steps,
            "preemptions": self.num_retractions,  # every retraction, priority's included
            "priority_preemptions": self.num_priority_preemptions,
            "timeouts": self.num_timeouts,
            **self.drafter.stats(),
            "evicted_pages": self.kv.evicted_pages,
            "eviction_policy": self.cache_policy,
            "queue_time": self.queue_times.snapshot(),
            "state_snapshots": self.config.state_snapshots,  # 0: not a hybrid model
            "encoder_runs": self.encoder_runs,
            "encoder_cache_hits": self.encoder_hits,
        }
        if self.cache_policy == "priority":  # what cache_retention hints hold
            out.update(self.kv.retention_stats())
        window = self.kv.window
        if window is not None:
            out["window_pages"] = window.num_pages
            out["window_pages_free"] = window.num_free
            out["window_pages_evictable"] = window.evictable
            out["window_evicted_pages"] = self.kv.window_evicted
        tiers = self.kv.tiers
        if tiers is not None:
            out.update(tiers.stats())
            out["loading"] = sum(r.status is ReqStatus.LOADING for r in self.running)
            for name, n in zip(("l1", "l2", "l3", "store"), self.tier_hit_tokens):
                out[f"hit_tokens_{name}"] = n
        if self.disagg is not None:
            out.update(self.disagg.stats.snapshot("kv_transfer_"))
            if isinstance(self.disagg, DecodeSide):
                out["kv_transfer_quarantined_pages"] = self.disagg.quarantined_pages()
        return out

    def check_idle(self) -> None:
        """At idle every page is free or held by exactly one tree node, no locks
        (with tiers: no copies in flight; step until ``copies_pending`` is False)."""
        assert not self.running and not self.waiting, "the scheduler is not idle"
        assert not self.copies_pending, "copies between cache tiers are in flight"
        if self.disagg is not None:
            assert not self.disagg.busy, "KV transfers are outstanding (or quarantined)"
        self.cache.check()
        assert self.cache.protected_pages == 0, "a lock survived its request"
        cached = self.cache.cached_pages
        assert self.allocator.num_free + cached == self.config.num_pages, (
            f"page leak: {self.config.num_pages - self.allocator.num_free - cached} pages"
        )
        self.running.check_idle()
        self.kv.check_states_idle()
        self.kv.check_window_idle()
        assert not self.grammars.in_use, "a grammar outlived its requests"
        assert not any(a.requests for a in self.loras.by_id.values()), (
            "a LoRA adapter's request count outlived its requests"
        )

    # ------------------------------------------------------------- counters
    # Kept by the parts that count them (stats() reports them).
    @property
    def hit_tokens(self) -> int:
        return self.admission.hit_tokens

    @property
    def query_tokens(self) -> int:
        return self.admission.query_tokens

    @property
    def tier_hit_tokens(self) -> list[int]:
        return self.admission.tier_hit_tokens

    @property
    def queue_times(self) -> QueueTimes:
        return self.admission.queue_times

    @property
    def num_retractions(self) -> int:
        return self.decodes.num_retractions

    @property
    def num_priority_preemptions(self) -> int:
        return self.decodes.num_priority_preemptions

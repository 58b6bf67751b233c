"""The worker's engine room: runs one scheduler step on the model and samples.

``ModelRunner.step(batch)``, ``batch`` a ``protocol.Step`` (the runner from
``build.build_runner(config)``):
0. performs the copies between cache tiers (``batch.copies``, ``host_cache.py``):
   the part the step needs now (demotions), the rest handed to the copy thread;
1. clears the slots in ``batch.release`` (page table, sampling state);
2. for each request: remembers its sampling params if given, cuts its slot's
   page table to ``keep_pages`` when given, appends ``new_pages``, and checks the
   table covers ``start_pos + len(input_ids)`` tokens;
3. runs the model on all new tokens at once (the attention backend writes their
   K/V into their pages);
4. computes the logprobs of the prompt tokens it was asked to score
   (``score_ids``), from the logits of the positions before them;
5. for every request with ``sample=True``, in batch order: takes the raw
   logprobs when asked for, applies ``min_tokens``, ``logit_bias`` and the
   penalties (``logits.py``) and samples one token; a request with drafts
   (``num_drafts``) is verified instead (``speculative.py``): its new tokens are
   the accepted drafts and the token after them (``StepResult.verified``).
It returns a ``protocol.StepResult``: the tokens and the logprobs (``Scores``),
and the tickets of cache tier copies finished since the last step. A step with
nothing to compute waits (briefly) for a ticket in flight or a grammar being
compiled, so a scheduler waiting only for those does not spin. ``close()`` finishes
the copies queued (a clean stop loses no write-through file).

Tensor parallelism (``comm`` of several ranks, docs/parallel.md): every rank
builds a runner over its shard of the model and its KV heads, for the same page
ids, and every rank runs every step (``worker/tp.py`` hands them the same
``Step``). Rank 0, the leader, samples and answers; the others (followers) run
steps 1-3 only and keep no sampling, penalty or grammar state beyond what the
step's checks read, and return an empty ``StepResult``.

The runner builds nothing but its step machinery: it receives its parts (model,
KV pools and page tables, attention backend, state pool, cache tiers, LoRA slots,
grammars: ``parts.py``), which ``build.build_runner`` builds from a
``WorkerConfig``; the builder then runs the warm-up (``warmup``: one prefill, then
a decode step of every slot at once, so the first real request finds its buffers
mapped and its kernels initialised) and hands over the decode CUDA graphs it
captured, if any (``use_graphs``, ``cuda_graph.py``). What the backend can do is
declared by it (``AttentionBackend.plans_native_steps``, ``captures_graphs``).

No host sync per step but reading the sampled tokens: the step's token ids,
positions and logits rows go to the device in one non-blocking copy from a
pinned buffer (``staging.py``), as do the attention backend's index arrays.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from radixserve.layers import invariant
from radixserve.layers.recurrent import StateSegment
from radixserve.model_info import ModelInfo
from radixserve.models import decode_step
from radixserve.protocol import (
    Forced,
    GrammarFailure,
    LoraReport,
    Scores,
    SlotFailure,
    Step,
    StepReq,
    StepResult,
    Verified,
)
from radixserve.sampling_params import SamplingParams
from radixserve.worker import cuda_graph
from radixserve.worker.attention import AttentionBatch
from radixserve.worker.grammar import apply_bitmask
from radixserve.worker.logits import LogitsProcessor, token_logprobs
from radixserve.worker.multimodal import MultimodalSlots, VisionEncoder
from radixserve.worker.parts import RunnerParts
from radixserve.worker.sampler import Sampler
from radixserve.worker.speculative import verify
from radixserve.worker.staging import Staging
from radixserve.worker.state_pool import StatePool, StepStates

# How long a step with nothing to compute waits for a grammar being compiled or a
# ticket of cache tier copies.
IDLE_WAIT_S = 0.05
_NO_TOKENS = np.zeros(0, dtype=np.int32)

log = logging.getLogger("radixserve.worker")


class ModelRunner:
    """Model weights + KV pool + page tables + attention backend + sampler."""

    def __init__(self, parts: RunnerParts) -> None:
        """The runner over ``parts``, which ``build.build_runner`` builds from a
        ``WorkerConfig`` (``parts.py`` lists them)."""
        config, loaded, kv = parts.config, parts.model, parts.kv
        cfg = loaded.config
        self.config, self.comm = config, parts.comm
        self.leader = parts.comm.rank == 0
        self.model, self.model_config, self._model_name = loaded.model, cfg, loaded.name
        self.dtype_name, self.dtype_reason = loaded.dtype_name, loaded.dtype_reason
        self._device = loaded.device
        self.weight_bytes = self.model.weight_bytes()
        self.kv = kv
        self.pool, self.page_table = kv.pool, kv.page_table
        self.window_pool, self.window_table = kv.window_pool, kv.window_table
        self.window_pages, self.window_span = kv.window_pages, kv.window_span
        self.page_bytes, self.kv_bytes = kv.page_bytes, kv.kv_bytes
        self.tokens_per_gib = kv.tokens_per_gib
        self.bytes_per_cached_token = kv.bytes_per_cached_token
        self.bytes_per_token_one_pool = kv.bytes_per_token_one_pool
        self.backend = parts.backend
        self.states = parts.states
        self.state_bytes = StatePool.bytes_per_entry(cfg, loaded.dtype)
        tiers = parts.tiers
        self.host_cache = None if tiers is None else tiers.host_cache
        self.kv_identity = "" if tiers is None else tiers.kv_identity
        self._threads = None if tiers is None else tiers.copy_threads  # (idle, while copying)
        self.loras, self._start_loras = parts.loras, parts.start_loras
        self.grammar_cache, self.grammars = parts.grammar_cache, parts.grammars
        self._inputs = Staging(self._device, torch.int64)
        self.sampler = Sampler(config.seed)
        self.logits_processor = LogitsProcessor(cfg.vocab_size, cfg.eos_token_ids, self._device)
        #: The decode graphs replayed (``use_graphs``; None: every step runs eagerly).
        self.graphs: cuda_graph.DecodeGraphs | None = None
        self._warming = False  # a warm-up step (its decodes have no state snapshot)
        self._lora_rows = False  # whether the step being planned has adapter rows
        if self.backend.plans_native_steps:
            self.backend.native_layers = self._native_layers
        # A vision-language model's images and multimodal positions (multimodal.py).
        self.multimodal: MultimodalSlots | None = None
        if loaded.vision is not None:
            cache_bytes = int(config.encoder_cache_mb * 2**20)
            self.multimodal = MultimodalSlots(VisionEncoder(loaded.vision, cache_bytes))

    def _native_layers(self, rows: int) -> bool:
        """Whether a decode step of ``rows`` rows runs every layer in one native call
        (``models/decode_step.py``): the backend then gives it one native attention
        plan. Steps with adapter rows run the layers one by one."""
        return not self._lora_rows and decode_step.takes(self.model, rows)

    def use_graphs(self, graphs: cuda_graph.DecodeGraphs | None) -> None:
        """Replay ``graphs`` for the decode steps they hold from now on (captured after
        the warm-up: ``build.build_runner``); None: every step runs eagerly."""
        self.graphs = graphs

    @property
    def num_pages(self) -> int:
        """Pages the scheduler hands out (the pool may hold one more: the graphs' pad page)."""
        return self.kv.num_pages

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def max_context_len(self) -> int:
        return self.model_config.max_context_len

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def info(self) -> ModelInfo:
        """The facts the scheduler and the tokenizer size themselves by."""
        return ModelInfo(
            num_pages=self.num_pages,
            page_size=self.page_size,
            max_context_len=self.max_context_len,
            vocab_size=self.vocab_size,
            eos_token_ids=tuple(self.eos_token_ids),
            model_name=self.model_name,
            backend_name=self.backend_name,
            dtype=self.dtype_name,
            dtype_reason=self.dtype_reason,
            tp=self.comm.size,
            weight_bytes=self.weight_bytes,
            kv_bytes=self.kv_bytes,
            host_pages=0 if self.host_cache is None else self.host_cache.num_slots,
            page_bytes=self.page_bytes,
            kv_identity=self.kv_identity,
            loras=self._start_loras,
            state_bytes=self.state_bytes,
            state_snapshots=0 if self.states is None else self.states.num_snapshots,
            kv_dtype=self.pool.kv_dtype_name,
            vision=self.multimodal is not None,
            tokens_per_gib=self.tokens_per_gib,
            window_pages=self.window_pages,
            window_span=self.window_span,
            window_page_bytes=self.kv.window_page_bytes,
        )

    def warmup(self, prefill_tokens: int, decode_batch: int) -> None:
        """Run the largest steps the scheduler will send before any request does.

        One prefill of ``prefill_tokens`` tokens in slot 0, then one decode step
        of ``decode_batch`` slots that all read that prefill's pages, both sampling
        greedily; every slot is released after. Both are capped by the pool and
        the context. The K/V written goes to
        pages the scheduler has not handed out yet and is overwritten before
        use, so the warm-up leaves no state behind.
        """
        s = self.page_size
        batch = min(decode_batch, self.page_table.max_slots, self.num_pages - 1)
        # Slot 0's pages, then one page of each other slot: they fit in the pool.
        tokens = min(prefill_tokens, self.max_context_len - 1, (self.num_pages - batch + 1) * s - 1)
        if tokens < 1 or batch < 1:
            return
        self._warming = True  # its decodes start mid-sequence without a state snapshot
        own = -(-(tokens + 1) // s)  # slot 0: its prefill and its decoded token
        pages = np.arange(own + batch - 1, dtype=np.int32)
        first, full = -(-tokens // s), tokens // s  # pages the prefill fills / fills whole
        greedy = SamplingParams(temperature=0.0, max_tokens=1)
        ids = np.zeros(tokens, dtype=np.int32)
        self.step(Step([StepReq(0, ids, 0, pages[:first], True, greedy)]))
        # Slot 0 decodes on; every other slot reads slot 0's whole pages (as forks of one
        # prompt do) and decodes its next token into a page of its own.
        decode = [StepReq(0, ids[:1], tokens, pages[first:own], True)]
        for i in range(1, batch):
            table = np.append(pages[:full], pages[own + i - 1])
            decode.append(StepReq(i, ids[:1], full * s, table, True, greedy))
        self.step(Step(decode))
        self.step(Step([], release=np.arange(batch, dtype=np.int32)))
        self._warming = False
        if self.window_pool is not None:  # the warm-up wrote into the dummy page
            for t in self.window_pool.layers:
                t[-1].zero_()

    @torch.inference_mode()
    def step(self, batch: Step) -> StepResult:
        """Run one step: the sampled tokens (one per ``sample=True`` request, in
        order), the logprobs computed, and what the grammars made of it, as a
        ``StepResult``. A follower rank computes its part and returns no tokens."""
        reports = self._load_loras(batch)
        if not self.leader:
            with invariant.batch_invariant(self.config.deterministic):
                self._forward(batch, [])  # followers verify nothing: rank 0 answers
            if self.host_cache is not None:
                self.host_cache.finished()  # in step: done; rank 0 reports
            return StepResult(batch.step_id, np.zeros(0, dtype=np.int32), [])
        for key in batch.drop_grammars:
            self.grammar_cache.drop(key)
        for spec in batch.grammars:
            self.grammar_cache.submit(spec)
        copying = self.host_cache is not None and (self.host_cache.busy or bool(batch.copies))
        if not batch.reqs and not copying:
            # Nothing to compute: give a compilation in flight a moment, so a
            # scheduler that waits only on grammars does not spin.
            self.grammar_cache.wait(IDLE_WAIT_S)
        if self._threads is not None:
            hc = self.host_cache
            assert hc is not None
            # The copy thread gets a core while it has work (this step's or earlier).
            heavy = hc.busy or any(hc.goes_to_thread(c) for c in batch.copies)
            want = self._threads[1] if heavy else self._threads[0]
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        encoder = None if self.multimodal is None else self.multimodal.encoder
        counts = (0, 0) if encoder is None else (encoder.runs, encoder.hits)
        with invariant.batch_invariant(self.config.deterministic):
            result = self._step(batch)
        if encoder is not None:
            result.encoder_runs = encoder.runs - counts[0]
            result.encoder_hits = encoder.hits - counts[1]
        if self.host_cache is not None:
            if not batch.reqs and self.host_cache.busy:
                # Nothing to compute: wait for the next ticket instead of spinning.
                self.host_cache.wait(IDLE_WAIT_S)
            result.copies_done = self.host_cache.finished()
            result.store_missed = self.host_cache.last_missed
        ready, failures = self.grammar_cache.poll()
        result.grammars_ready = ready
        result.grammar_failures = [GrammarFailure(k, m) for k, m in failures]
        result.loras = reports
        return result

    def _load_loras(self, batch: Step) -> list[LoraReport]:
        """Drop, then load, the step's adapters (every rank: each holds its shard); a
        failure is reported, not raised: the server goes on without that adapter. The
        step's released slots let go of theirs first (an adapter is dropped in the step
        that releases its last request's slot)."""
        for slot in batch.release:
            self.loras.clear(slot)
        for lora_id in batch.drop_loras:
            self.loras.drop(lora_id)
        reports = []
        for spec in batch.load_loras:
            try:
                adapter = self.loras.load(spec.id, spec.name, spec.path)
            except (ValueError, OSError) as e:  # LoraError is a ValueError
                reports.append(LoraReport(spec.id, error=str(e)))
                continue
            reports.append(LoraReport(spec.id, adapter.digest, adapter.rank))
            log.info("LoRA %r loaded from %s (rank %d)", spec.name, spec.path, adapter.rank)
        return reports

    def close(self) -> None:
        """Finish the cache tier copies queued and stop the copy thread (the
        process's threads as they were)."""
        if self.host_cache is not None:
            self.host_cache.close()
        if self._threads is not None:
            torch.set_num_threads(self._threads[0])
            self._threads = None

    def _step(self, batch: Step) -> StepResult:
        failed: list[SlotFailure] = []
        logits, num_sampled, plans, drafts = self._forward(batch, failed)
        scores = []
        for slot, pos, lo, hi, ids in plans:
            k = self.sampler.params(slot).prompt_logprobs or 0
            chosen, top_ids, top_lps = token_logprobs(logits[lo:hi], ids, k)
            scores.append(Scores(slot, pos, chosen, top_ids.ravel(), top_lps.ravel()))
        sampling = [r for r in batch.reqs if r.sample]
        if not sampling:
            return StepResult(batch.step_id, np.zeros(0, dtype=np.int32), scores, failed=failed)
        all_logits = logits
        logits = logits[:num_sampled]
        plain = sampling
        if drafts:  # the requests with drafts are verified below, one by one
            keep = [i for i, r in enumerate(sampling) if not r.num_drafts]
            plain = [sampling[i] for i in keep]
            logits = logits[keep]
        slots = [r.slot for r in plain]
        positions = [r.start_pos + len(r.input_ids) for r in plain]
        params = [self.sampler.params(slot) for slot in slots]
        want = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        processed = bool(slots) and self.logits_processor.active(slots)
        constrained = self.grammars.active(slots)
        if logits.dtype in (torch.bfloat16, torch.float16) and (
            want or processed or constrained or not all(p.greedy for p in params)
        ):
            # Exactly the same values: the processing, filters, softmax and logprobs run
            # in float32. Plain greedy rows take the argmax of the half values as they
            # are (the same first maximum; the LM head's output is not copied).
            logits = logits.float()
        raw = logits[[i for i, _ in want]] if want else None  # a copy: indexing by list
        if processed:
            logits = self.logits_processor.apply(logits, slots, positions)
        if constrained:
            logits = self.grammars.apply_masks(logits, slots)
        tokens = self.sampler.sample(logits, slots, positions) if slots else _NO_TOKENS
        forced: dict[int, list[int]] = {}
        terminated: list[int] = []
        if constrained:
            forced, terminated, rejected = self.grammars.accept(slots, tokens)
            failed += [SlotFailure(slot, message) for slot, message in rejected]
        self.logits_processor.record(slots, tokens, forced)
        if want:
            picked = torch.from_numpy(tokens[[i for i, _ in want]]).to(raw.device)
            chosen, top_ids, top_lps = token_logprobs(raw, picked, max(k for _, k in want))
            for j, (i, k) in enumerate(want):
                scores.append(
                    Scores(
                        slots[i], positions[i], chosen[j : j + 1], top_ids[j, :k], top_lps[j, :k]
                    )
                )
        verified: list[Verified] = []
        if drafts:
            tokens = self._verify(
                sampling, all_logits, tokens, drafts, verified, scores, forced, terminated, failed
            )
        return StepResult(
            batch.step_id,
            tokens,
            scores,
            [Forced(slot, np.asarray(ids, dtype=np.int32)) for slot, ids in forced.items()],
            np.asarray(terminated, dtype=np.int32),
            failed,
            verified=verified,
        )

    def _verify(
        self,
        sampling: list[StepReq],
        logits: torch.Tensor,
        plain_tokens: np.ndarray,
        drafts: dict[int, tuple[int, int]],
        verified: list[Verified],
        scores: list[Scores],
        forced: dict[int, list[int]],
        terminated: list[int],
        failed: list[SlotFailure],
    ) -> np.ndarray:
        """Verify the drafts of the sampling requests that have them (``worker/speculative.py``):
        their rows are the sampling row and the draft rows of ``logits``. Returns one
        token per sampling request (the plain ones' from ``plain_tokens``, in order);
        fills ``verified`` and the verified tokens' logprobs into ``scores``.

        With a grammar the drafts it rejects are cut first (``GrammarSlots.walk_drafts``:
        the longest prefix it accepts), row ``i`` gets the mask of the grammar's state
        after the first ``i`` drafts, and the matcher then advances by the accepted
        drafts and the sampled token (jump-forward into ``forced``, a completed grammar
        into ``terminated``, a rejection into ``failed``)."""
        out = np.zeros(len(sampling), dtype=np.int32)
        at = 0
        for i, r in enumerate(sampling):
            if not r.num_drafts:
                out[i] = plain_tokens[at]
                at += 1
                continue
            lo, k = drafts[r.slot]
            rows = torch.cat([logits[i : i + 1], logits[lo : lo + k]])
            if rows.dtype in (torch.bfloat16, torch.float16):
                rows = rows.float()
            first = r.start_pos + len(r.input_ids) - k  # the position row 0 samples
            candidates = r.input_ids[-k:].tolist()
            grammar = self.grammars.active([r.slot])
            checked = rows
            if grammar:
                a, bitmask = self.grammars.walk_drafts(r.slot, candidates)
                candidates = candidates[:a]
                checked = rows[: a + 1].clone()  # rows keeps the raw logits (logprobs)
                apply_bitmask(checked, bitmask, list(range(a + 1)), self.grammars.vocab_size)
            ids = verify(
                checked,
                candidates,
                r.slot,
                first,
                self.sampler,
                self.logits_processor,
                record_last=not grammar,
            )
            if grammar:
                rejected: list[tuple[int, str]] = []
                self.grammars.accept_verified(r.slot, ids, forced, terminated, rejected)
                failed += [SlotFailure(slot, message) for slot, message in rejected]
                last = np.asarray(ids[-1:], dtype=np.int32)
                self.logits_processor.record([r.slot], last, forced)
            out[i] = ids[0]
            verified.append(Verified(r.slot, np.asarray(ids, dtype=np.int32)))
            top = self.sampler.params(r.slot).logprobs
            if top is not None:
                picked = torch.tensor(ids, dtype=torch.int64, device=rows.device)
                chosen, top_ids, top_lps = token_logprobs(rows[: len(ids)], picked, top)
                scores.append(Scores(r.slot, first, chosen, top_ids.ravel(), top_lps.ravel()))
        return out

    @torch.inference_mode()
    def forward_logits(self, batch: Step) -> torch.Tensor:
        """Steps 1-3 of ``step``: logits [num sampling requests, vocab] (no sampling;
        on a follower rank, an empty tensor)."""
        with invariant.batch_invariant(self.config.deterministic):
            logits, num_sampled, _, _ = self._forward(batch, [])
        return logits[:num_sampled] if self.leader else torch.zeros(0, self.vocab_size)

    def _forward(
        self, batch: Step, failed: list[SlotFailure]
    ) -> tuple[torch.Tensor, int, list[tuple], dict[int, tuple[int, int]]]:
        """Steps 1-3: the logits of the sampling rows (first, in order: a request with
        drafts gives the row of its last real token here), then of its draft rows,
        then of the rows that score prompt tokens; how many sampling rows there are;
        the scoring plans ``(slot, first position, first row, end row, token ids)``;
        and per slot with drafts ``(first draft row, number of drafts)``.
        A slot whose grammar rejects its replayed history goes into ``failed``.
        The step's copies between cache tiers come first (their in-step part)."""
        for copies in batch.copies:
            if self.host_cache is None:
                raise ValueError("a step with cache tier copies, but this worker has no tiers")
            self.host_cache.apply(copies)
        if len(batch.state_saves):
            self._save_states(batch.state_saves)
        for slot in batch.release:
            self.page_table.clear(slot)
            if self.window_table is not None:
                self.window_table.clear(slot)
            self.sampler.remove(slot)
            self.loras.clear(slot)
            if self.multimodal is not None:
                self.multimodal.clear(slot)
            if self.leader:
                self.logits_processor.remove(slot)
                self.grammars.remove(slot)
        if not batch.reqs:
            return torch.zeros(0, self.vocab_size), 0, [], {}
        ids, positions, logits_rows, score_rows, draft_rows = [], [], [], [], []
        embeds: list[tuple[np.ndarray, torch.Tensor]] = []
        mm = self.multimodal
        drafts: dict[int, tuple[int, int]] = {}
        plans: list[tuple] = []
        qo_indptr, kv_lens, page_counts, tables, window_tables = [0], [], [], [], []
        segments: list[StateSegment] = []
        seen: set[int] = set()
        s = self.page_size
        for r in batch.reqs:
            if r.slot in seen:
                raise ValueError(f"slot {r.slot} appears twice in one step")
            seen.add(r.slot)
            self.page_table.check_slot(r.slot)
            if r.sampling is not None:
                self.sampler.add(r.slot, r.sampling)  # followers too: the checks read it
                self.loras.assign(r.slot, r.lora)
                if mm is not None:
                    mm.add(r.slot, r.images, r.prompt_len)
                elif r.images:
                    raise ValueError(f"slot {r.slot}: images, but this model has no vision tower")
                if self.leader:
                    self.logits_processor.add(r.slot, r.sampling, r.prompt_len, r.history)
                    error = self.grammars.add(r.slot, r.sampling, r.prompt_len, r.history)
                    if error is not None:
                        failed.append(SlotFailure(r.slot, error))
            elif r.sample and not self.sampler.has(r.slot):
                raise ValueError(f"slot {r.slot} samples but was never given SamplingParams")
            if r.keep_pages >= 0:
                self.page_table.truncate(r.slot, r.keep_pages)
            self.page_table.append(r.slot, r.new_pages)
            n = len(r.input_ids)
            if n < 1:
                raise ValueError(f"slot {r.slot}: a step needs at least one input token")
            k = r.num_drafts
            if k:
                self._check_drafts(r)
            kv_len = r.start_pos + n
            if kv_len > self.max_context_len:
                raise ValueError(f"slot {r.slot}: {kv_len} tokens exceed the context length")
            need = -(-kv_len // s)
            if self.page_table.num_slot_pages(r.slot) < need:
                raise ValueError(
                    f"slot {r.slot}: page table has {self.page_table.num_slot_pages(r.slot)} "
                    f"pages, {need} needed for {kv_len} tokens"
                )
            ids.append(np.asarray(r.input_ids, dtype=np.int64))
            if mm is None:
                positions.append(np.arange(r.start_pos, kv_len, dtype=np.int64))
            else:
                positions.append(mm.positions(r.slot, r.start_pos, kv_len))
                embeds.extend(mm.embeds(r.slot, r.start_pos, kv_len, qo_indptr[-1]))
            qo_indptr.append(qo_indptr[-1] + n)
            if self.states is not None:
                segments.append(self._state_segment(r, qo_indptr[-2]))
            if r.sample:
                logits_rows.append(qo_indptr[-1] - 1 - k)
            if k:
                drafts[r.slot] = (len(draft_rows), k)
                draft_rows.extend(range(qo_indptr[-1] - k, qo_indptr[-1]))
            if len(r.score_ids):
                plans.append(self._score_plan(r, len(score_rows)))
                first = qo_indptr[-2] + r.score_pos - 1 - r.start_pos  # the row before it
                score_rows.extend(range(first, first + len(r.score_ids)))
            kv_lens.append(kv_len)
            tables.append(self.page_table.pages(r.slot)[:need])
            page_counts.append(need)
            if self.window_table is not None:
                window_tables.append(self._window_pages(r, need))
            elif len(r.window_pages):
                raise ValueError(f"slot {r.slot}: window pages, but this worker has no window pool")
        attn = AttentionBatch(
            qo_indptr=np.asarray(qo_indptr, dtype=np.int32),
            kv_lens=np.asarray(kv_lens, dtype=np.int32),
            page_indptr=np.concatenate([[0], np.cumsum(page_counts)]).astype(np.int32),
            page_indices=np.concatenate(tables).astype(np.int32),
            window_page_indices=np.concatenate(window_tables) if window_tables else None,
        )
        input_ids = np.concatenate(ids)
        if input_ids.min() < 0 or input_ids.max() >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        flat_positions = np.concatenate(positions, axis=-1)
        if flat_positions.ndim == 2 and (flat_positions == flat_positions[0]).all():
            flat_positions = flat_positions[0]  # no image rows: M-RoPE is the plain rotary
        lora = self.loras.batch([r.slot for r in batch.reqs], attn.qo_indptr)
        self._lora_rows = lora is not None
        plain = not embeds and flat_positions.ndim == 1
        if lora is None and plain and self._graph_step(batch, attn):
            assert self.graphs is not None
            logits = self.graphs.run(attn, input_ids, flat_positions)
        else:
            self.backend.begin_batch(attn)
            rows = np.asarray(logits_rows + draft_rows + score_rows, dtype=np.int64)
            # M-RoPE's position rows travel flat and are viewed back on the device.
            ids_t, pos_t, rows_t = self._inputs.to_device([input_ids, flat_positions.ravel(), rows])
            pos_t = pos_t.view(flat_positions.shape)
            states = None if self.states is None else StepStates(self.states, segments)
            image_rows = self._image_rows(embeds)
            logits = self.model(
                ids_t, pos_t, max(kv_lens) - 1, self.backend, rows_t, lora, states, image_rows
            )
        if logits is None:  # a follower rank
            return torch.zeros(0, self.vocab_size), 0, [], {}
        num_sampled = len(logits_rows)
        # The draft rows come after the sampling ones, the scoring rows after both.
        before = num_sampled + len(draft_rows)
        plans = [(slot, pos, lo + before, hi + before, t) for slot, pos, lo, hi, t in plans]
        drafts = {slot: (num_sampled + lo, k) for slot, (lo, k) in drafts.items()}
        return logits, num_sampled, plans, drafts

    def _image_rows(
        self, embeds: list[tuple[np.ndarray, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image rows and their features, as the model takes them."""
        if not embeds:
            return None
        rows = torch.from_numpy(np.concatenate([r for r, _ in embeds])).to(self._device)
        return rows, torch.cat([f for _, f in embeds])

    def _window_pages(self, r: StepReq, need: int) -> np.ndarray:
        """Set ``r``'s window table entries; its pages out of every window go to the
        dummy page; the table's first ``need`` entries (checked: every page a query
        of the step may see is a real window page)."""
        wt = self.window_table
        assert wt is not None
        wt.set(r.slot, r.window_start, r.window_pages)
        first = wt.forget_before(r.slot, r.start_pos, self.page_size)
        pages = wt.pages(r.slot, need)
        if not self._warming and (pages[first:] == wt.dummy).any():
            raise ValueError(
                f"slot {r.slot}: no window page for a position its sliding layers read"
            )
        return pages

    def _check_drafts(self, r: StepReq) -> None:
        """A request's drafts are verifiable: it samples, at least one real input
        token comes first, and nothing is scored."""
        k, n = r.num_drafts, len(r.input_ids)
        if not r.sample or not 0 < k < n:
            raise ValueError(
                f"slot {r.slot}: {k} drafts need a sampling step with more than {k} input tokens"
            )
        if len(r.score_ids):
            raise ValueError(f"slot {r.slot}: drafts and prompt tokens to score in one step")

    def _save_states(self, pairs: np.ndarray) -> None:
        """``Step.state_saves``: each slot's state into a snapshot, before anything else."""
        if self.states is None:
            raise ValueError("a step saves recurrent states, but this model has none")
        if len(pairs) % 2:
            raise ValueError("state_saves holds slot, snapshot pairs")
        for slot, snapshot in pairs.reshape(-1, 2).tolist():
            self.page_table.check_slot(slot)
            self.states.copy(slot, self.states.snapshot_entry(snapshot))

    def _state_segment(self, r: StepReq, lo: int) -> StateSegment:
        """Set up ``r``'s slot state for its step (empty at position 0, else restored
        from a snapshot when given) and describe its rows for the model."""
        assert self.states is not None
        n = len(r.input_ids)
        if r.start_pos == 0:
            self.states.zero(r.slot)
        elif r.state_restore >= 0:
            self.states.copy(self.states.snapshot_entry(r.state_restore), r.slot)
        elif r.sampling is not None and not self._warming:
            raise ValueError(
                f"slot {r.slot} starts at position {r.start_pos} without a state snapshot "
                "(a hybrid model's recurrent layers need the state after its cached prefix)"
            )
        if r.state_save < 0:
            if r.state_save2 >= 0:
                raise ValueError(f"slot {r.slot}: state_save2 without state_save")
            return StateSegment(lo, lo + n, r.slot)
        if not 1 <= r.state_save_at <= n:
            raise ValueError(f"slot {r.slot}: state_save_at {r.state_save_at} not in [1, {n}]")
        saves = [(r.state_save_at, self.states.snapshot_entry(r.state_save))]
        if r.state_save2 >= 0:
            if not r.state_save_at < r.state_save2_at <= n:
                raise ValueError(
                    f"slot {r.slot}: state_save2_at {r.state_save2_at} not in "
                    f"({r.state_save_at}, {n}]"
                )
            saves.append((r.state_save2_at, self.states.snapshot_entry(r.state_save2)))
        return StateSegment(lo, lo + n, r.slot, tuple(saves))

    def _graph_step(self, batch: Step, attn: AttentionBatch) -> bool:
        """Whether this step replays a decode graph: every request one new token, all
        sampling, nothing to score, and a captured size that holds the batch."""
        return (
            self.graphs is not None
            and attn.num_tokens == attn.batch_size
            and all(r.sample and not len(r.score_ids) for r in batch.reqs)
            and self.graphs.size_for(attn.batch_size) is not None
        )

    def _score_plan(self, r: StepReq, first_row: int) -> tuple:
        """Check ``r``'s prompt tokens to score (the positions before them must be
        computed in this step, the slot must have asked for prompt logprobs);
        its plan, with rows counted among the scoring rows from ``first_row``."""
        m = len(r.score_ids)
        if not (
            r.start_pos + 1 <= r.score_pos and r.score_pos + m - 1 <= r.start_pos + len(r.input_ids)
        ):
            raise ValueError(
                f"slot {r.slot}: tokens to score at positions {r.score_pos}..{r.score_pos + m - 1} "
                f"need logits this step does not compute"
            )
        if not self.sampler.has(r.slot) or self.sampler.params(r.slot).prompt_logprobs is None:
            raise ValueError(f"slot {r.slot}: prompt tokens to score but no prompt_logprobs")
        if int(r.score_ids.min()) < 0 or int(r.score_ids.max()) >= self.vocab_size:
            raise ValueError(f"token id to score out of range [0, {self.vocab_size})")
        ids = torch.from_numpy(np.asarray(r.score_ids, dtype=np.int64)).to(self._device)
        return (r.slot, r.score_pos, first_row, first_row + m, ids)

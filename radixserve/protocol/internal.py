"""The messages between the server's own processes: tokenizer <-> scheduler
(requests in; outputs, errors and admin replies out), scheduler <-> worker (the
``Step`` the scheduler plans and the ``StepResult`` the worker answers: they are the
step itself, of which no copy exists), and the control messages (``Ready``,
``Shutdown``, ``Draining``). No client sends or sees these (docs/protocol.md).
Internal token and page id arrays travel as little-endian int32 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from radixserve.protocol.disagg import KV_SOURCE, KVSend, KVSent
from radixserve.protocol.wire import (
    BOOL,
    F32,
    F64,
    FINISH,
    I32,
    I32_LIST,
    INT,
    INT_LIST,
    KEY,
    KEY_BYTES,
    KEYS,
    MAP,
    SAMPLING,
    SCORED,
    STR,
    STR_LIST,
    Kind,
    Message,
    _nested,
    _optional,
    f,
)
from radixserve.sampling_params import SamplingParams


# ------------------------------------------------------- tokenizer <-> scheduler
@dataclass
class ImageInput(Message):
    """One image of a prompt, preprocessed (docs/multimodal.md). Its **span** is the
    prompt tokens ``ids`` from ``offset``: the placeholder tokens (``token_id``), one
    per feature row of the image in order, and whatever tokens the model's processor
    puts between them (Idefics3's tile markers; Qwen2.5-VL's span is placeholders
    only), all fixed by the image. ``pixels`` are the image processor's output
    (float32) of shape ``pixel_shape``; ``grid`` is model-specific (Qwen2.5-VL's time,
    height and width patches). ``digest`` is the SHA-256 of the decoded pixels and
    their size, which keys the image in the prefix cache and the encoder cache."""

    digest: bytes = f(KEY)
    offset: int = f(INT)
    ids: np.ndarray = f(I32)
    token_id: int = f(INT)
    pixel_shape: list[int] = f(INT_LIST)
    pixels: np.ndarray = f(F32)
    grid: list[int] = f(INT_LIST, [])

    def __post_init__(self) -> None:
        if not self.pixel_shape or min(self.pixel_shape) < 1:
            raise ValueError(f"an image's pixel shape must be positive sizes: {self.pixel_shape}")
        if len(self.pixels) != math.prod(self.pixel_shape):
            raise ValueError("an image's pixels do not match their shape")
        if self.offset < 0 or not (np.asarray(self.ids) == self.token_id).any():
            raise ValueError("an image's span is out of range or holds no placeholder")

    @property
    def tokens(self) -> int:
        """The span's length in tokens."""
        return len(self.ids)

    @property
    def end(self) -> int:
        return self.offset + len(self.ids)

    def patches(self) -> np.ndarray:
        """The pixels in their shape."""
        return self.pixels.reshape(self.pixel_shape)


@dataclass
class AddRequest(Message):
    TYPE: ClassVar[str] = "add_request"
    rid: str = f(STR)
    input_ids: np.ndarray = f(I32)
    sampling: SamplingParams = f(SAMPLING)
    salt: str | None = f(_optional(STR), None)
    lora: str | None = f(_optional(STR), None)  # the LoRA adapter's name (None: the base)
    kv_source: str | None = f(_optional(KV_SOURCE), None)  # Generate's (docs/scale-out.md)
    # The prompt's images, in prompt order (their runs in ``input_ids`` hold token_id).
    images: list[ImageInput] = f(_nested(ImageInput), [])


@dataclass
class LoraAdmin(Message):
    """Tokenizer -> scheduler: ``op`` "load" (``name`` from ``path``), "unload"
    (``name``) or "list"; answered with an ``AdminReply`` (``{"error"}`` when refused),
    a load once the worker has reported it."""

    TYPE: ClassVar[str] = "lora_admin"
    tag: int = f(INT)
    op: str = f(Kind('"load", "unload" or "list"', lambda x: x in ("load", "unload", "list")))
    name: str = f(STR, "")
    path: str = f(STR, "")


@dataclass
class AbortRequest(Message):
    """Finish ``rid`` now; reason "stop" when the tokenizer saw a stop string."""

    TYPE: ClassVar[str] = "abort_request"
    rid: str = f(STR)
    reason: str = f(Kind('"abort" or "stop"', lambda x: x in ("abort", "stop")), "abort")
    index: int | None = f(_optional(INT), None)


@dataclass
class Flush(Message):
    TYPE: ClassVar[str] = "flush"
    tag: int = f(INT)
    keep_disk: bool = f(BOOL, False)


@dataclass
class GetStats(Message):
    TYPE: ClassVar[str] = "get_stats"
    tag: int = f(INT)


@dataclass
class Explain(Message):
    """Tokenizer -> scheduler: explain the cache's hit on ``input_ids`` under ``salt``
    and the adapter ``lora``; answered with an ``AdminReply`` (``{"error"}`` when
    refused)."""

    TYPE: ClassVar[str] = "explain"
    tag: int = f(INT)
    input_ids: np.ndarray = f(I32)
    salt: str | None = f(_optional(STR), None)
    lora: str | None = f(_optional(STR), None)
    images: list[ImageInput] = f(_nested(ImageInput), [])  # as AddRequest's


@dataclass
class GetDashboard(Message):
    TYPE: ClassVar[str] = "get_dashboard"
    tag: int = f(INT)


@dataclass
class CheckIdle(Message):
    TYPE: ClassVar[str] = "check_idle"
    tag: int = f(INT)


@dataclass
class OutputItem(Message):
    """What one step (or an abort) produced for one sample of a request.

    ``index`` says which of the request's n samples; ``token_ids`` are the new
    tokens (none for an abort); ``finish_reason`` is None while it runs.
    ``logprobs``: one ``[logprob, top ids, top logprobs]`` per token of
    ``token_ids`` when the request asked for them. ``prompt_logprobs``: one
    entry per prompt position (null where not scored), once, with the first
    token of sample 0. ``token_ids`` may hold several tokens: those a grammar
    forced after the sampled one (jump-forward, docs/structured.md).
    """

    rid: str = f(STR)
    index: int = f(INT)
    token_ids: list[int] = f(I32_LIST)
    finish_reason: str | None = f(FINISH)
    prompt_tokens: int = f(INT)
    completion_tokens: int = f(INT)
    cached_tokens: int = f(INT)
    logprobs: list | None = f(SCORED, None)
    prompt_logprobs: list | None = f(SCORED, None)
    # With finish_reason "error": what went wrong (every sample of the request fails).
    error: str | None = f(_optional(STR), None)
    # cached_tokens split by where they were found: [pool (L1), host (L2), disk (L3),
    # the shared KV store].
    cached_tokens_by_tier: list[int] = f(INT_LIST, [0, 0, 0, 0])
    # Prompt tokens the request's cache_retention hint holds (fewer when clipped at a
    # retention cap; 0: no hint, or none held).
    retained_tokens: int = f(INT, 0)
    # With sampling.explain, on the last item: the cache's explain at arrival (token ids).
    explain: dict | None = f(_optional(MAP), None)


@dataclass
class Outputs(Message):
    TYPE: ClassVar[str] = "outputs"
    items: list[OutputItem] = f(_nested(OutputItem))


@dataclass
class RequestError(Message):
    """The scheduler refused ``rid`` (e.g. a prompt that can never fit the pool)."""

    TYPE: ClassVar[str] = "request_error"
    rid: str = f(STR)
    message: str = f(STR)


@dataclass
class AdminReply(Message):
    TYPE: ClassVar[str] = "admin_reply"
    tag: int = f(INT)
    data: dict = f(MAP)


# ---------------------------------------------------------- scheduler <-> worker
@dataclass
class StepReq(Message):
    """One request's share of a step.

    slot: the request's slot (its page table and sampling state live there).
    input_ids: int32 tokens to compute now, at absolute positions
    ``start_pos .. start_pos + len(input_ids) - 1``.
    start_pos: number of tokens already in the KV pool for this slot (cached
    prefix included).
    new_pages: int32 page ids appended to the slot's page table since its last
    step; a slot's first step carries its whole table so far (cached-prefix
    pages included). After appending, the table must cover
    ``start_pos + len(input_ids)`` tokens.
    sample: whether to sample a token after this step (False for non-final
    prefill chunks).
    sampling: given in the step that adds the slot; remembered until released.
    With it come ``prompt_len`` (the request's prompt length: what
    ``min_tokens`` counts from) and, when the parameters have penalties,
    ``history``: every token of the request so far (prompt, then generated),
    from which the penalties' counts start.
    score_ids: prompt tokens to score (prompt logprobs): ``score_ids[j]`` is
    the token at position ``score_pos + j``, scored from the logits of the
    position before it, which this step computes.
    Hybrid models (recurrent states, docs/models.md): with ``start_pos == 0`` the
    slot's state starts empty; ``state_restore`` (-1: none) is a snapshot copied
    into the slot's state first (the state after ``start_pos`` tokens, which a
    slot's first step after a cache hit needs); ``state_save`` (-1: none) is a
    snapshot the state is copied into after the first ``state_save_at`` of this
    step's tokens (1 <= state_save_at <= len(input_ids)); ``state_save2`` (-1: none)
    a second one, after the first ``state_save2_at`` (state_save_at < state_save2_at
    <= len(input_ids)): a prefill chunk may hold both where waiting requests part from
    the prompt and the prompt's own last page boundary.
    num_drafts: speculative decoding (docs/speculative.md): the last ``num_drafts``
    of ``input_ids`` are draft tokens to verify (``sample`` must be True, at least
    one input token is not a draft, and the slot has no grammar). The worker
    samples the token after the last real input as usual, then accepts drafts
    while each equals the token sampled before it (rejection sampling when not
    greedy), and answers the accepted drafts plus the token sampled after them
    (``StepResult.verified``). K/V is written for every row; only the accepted
    rows' K/V counts: the scheduler frees the pages past them.
    keep_pages: when >= 0, the slot's page table is first cut to this many pages
    (the scheduler freed the pages past a verification's accepted tokens), then
    ``new_pages`` are appended.
    window_start, window_pages: models whose sliding layers keep their K/V in the
    window pool (docs/models.md, "Sliding windows and the cache"): entries
    ``window_start ..`` of the slot's window page table are set to these window
    page ids (-1: the dummy page, a page whose tokens no query of the slot can see
    any more). After them the window table covers the pages of positions
    ``[max(0, start_pos - W), start_pos + len(input_ids))`` (W: the largest
    window); pages wholly before ``start_pos - W`` are the dummy page.
    """

    slot: int = f(INT)
    input_ids: np.ndarray = f(I32)
    start_pos: int = f(INT)
    new_pages: np.ndarray = f(I32)
    sample: bool = f(BOOL, True)
    sampling: SamplingParams | None = f(_optional(SAMPLING), None)
    prompt_len: int = f(INT, 0)
    history: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    score_pos: int = f(INT, 0)
    score_ids: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    # The slot's LoRA adapter (0: the base model), given with ``sampling``.
    lora: int = f(INT, 0)
    state_restore: int = f(INT, -1)
    state_save_at: int = f(INT, 0)
    state_save: int = f(INT, -1)
    num_drafts: int = f(INT, 0)
    keep_pages: int = f(INT, -1)
    window_start: int = f(INT, 0)
    window_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    state_save2_at: int = f(INT, 0)
    state_save2: int = f(INT, -1)
    # The prompt's images, given with ``sampling`` (docs/multimodal.md): the worker
    # puts their features in place of their placeholder tokens and rotates the
    # prompt by its multimodal positions.
    images: list[ImageInput] = f(_nested(ImageInput), [])


@dataclass
class LoraLoad(Message):
    """Load the PEFT adapter folder ``path`` as adapter ``id`` (the scheduler's number,
    never reused), called ``name``."""

    id: int = f(INT)
    name: str = f(STR)
    path: str = f(STR)


@dataclass
class LoraReport(Message):
    """What became of a ``LoraLoad``: its content ``digest`` and ``rank``, or ``error``."""

    id: int = f(INT)
    digest: str = f(STR, "")
    rank: int = f(INT, 0)
    error: str | None = f(_optional(STR), None)


@dataclass
class PageCopies(Message):
    """The KV copies between tiers (docs/cache-tiers.md) one step asks for, under a
    ``ticket`` (numbered by the scheduler from 1). The worker performs them in this
    order; what is marked *in step* is done before the step computes anything, the
    rest may run in the background (a copy thread, a copy stream) while steps go on:

    0. ``save``: pool page ``save_pages[i]`` is written to the disk tier as the page
       file of key ``save_keys[32 i : 32 i + 32]`` (write-through of computed pages;
       the page is read in step, the file written in the background);
    1. ``to_disk``: host slot ``to_disk_slots[i]`` is written to the disk tier as the
       page file of key ``to_disk_keys[32 i : 32 i + 32]`` (the slot is read in
       step, the file written in the background);
    2. ``demote``: pool page ``demote_pages[i]`` is copied to host slot
       ``demote_slots[i]`` (in step);
    3. ``promote``: host slot ``promote_slots[i]`` is copied to pool page
       ``promote_pages[i]`` (background);
    4. ``load``: the page file of key ``load_keys[32 i : 32 i + 32]`` is read into
       pool page ``load_pages[i]`` (background);
    5. ``store_save``: pool page ``store_save_pages[i]`` is written to the shared KV
       store under key ``store_save_keys[32 i : 32 i + 32]`` (read in step, written in
       the background);
    6. ``store_load``: the store's page of key ``store_load_keys[32 i : 32 i + 32]``
       is read into pool page ``store_load_pages[i]`` (background); a page the store
       does not give is reported in ``StepResult.store_missed``.

    The order is what makes one step's copies safe: a slot written to disk may be
    reused by a demotion, and a page demoted may be the target of a promotion.
    The ticket is reported in ``StepResult.copies_done`` once all of it is done;
    until then the scheduler computes on no page being filled and reuses no slot
    or file being read or written.
    """

    save_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    save_keys: bytes = f(KEYS, b"")
    to_disk_slots: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    to_disk_keys: bytes = f(KEYS, b"")
    demote_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    demote_slots: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    promote_slots: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    promote_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    load_keys: bytes = f(KEYS, b"")
    load_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    ticket: int = f(INT, 0)
    store_save_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    store_save_keys: bytes = f(KEYS, b"")
    store_load_pages: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    store_load_keys: bytes = f(KEYS, b"")

    def __post_init__(self) -> None:
        n = KEY_BYTES
        pairs = (
            (len(self.save_keys) // n, len(self.save_pages), "save"),
            (len(self.to_disk_keys) // n, len(self.to_disk_slots), "to_disk"),
            (len(self.demote_pages), len(self.demote_slots), "demote"),
            (len(self.promote_slots), len(self.promote_pages), "promote"),
            (len(self.load_keys) // n, len(self.load_pages), "load"),
            (len(self.store_save_keys) // n, len(self.store_save_pages), "store_save"),
            (len(self.store_load_keys) // n, len(self.store_load_pages), "store_load"),
        )
        for a, b, name in pairs:
            if a != b:
                raise ValueError(f"page copies: {name} has {a} sources and {b} targets")

    def __len__(self) -> int:
        return (
            len(self.save_pages)
            + len(self.to_disk_slots)
            + len(self.demote_pages)
            + len(self.promote_pages)
            + len(self.load_pages)
            + len(self.store_save_pages)
            + len(self.store_load_pages)
        )


@dataclass
class GrammarSpec(Message):
    """A structured-output constraint the worker must compile (``StructuredOutput``'s
    fields, and its ``key``)."""

    key: str = f(STR)
    kind: str = f(STR)
    spec: str = f(STR)


@dataclass
class Step(Message):
    """What the worker computes next: the ``copies`` between cache tiers are done
    first (``PageCopies``), then ``release`` slots are cleared, then ``reqs`` run,
    in order. ``step_id`` numbers the scheduler's steps from 1.

    Grammars (docs/structured.md): ``grammars`` are to be compiled (in the
    background; each is reported in a later ``StepResult.grammars_ready`` or
    ``grammar_failures``) and held until named in ``drop_grammars``, after which
    the worker may keep them in its cache of compiled grammars. A slot's
    ``StepReq.sampling`` may name a grammar only once it was reported ready.
    A step with no ``reqs`` waits a little for a compilation, or a ticket of
    copies, in flight. ``state_saves`` (hybrid models): pairs ``slot, snapshot``
    (flat int32): each slot's recurrent state is copied into the snapshot before
    anything else (before ``release`` clears the slot).
    """

    TYPE: ClassVar[str] = "step"
    reqs: list[StepReq] = f(_nested(StepReq))
    release: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    step_id: int = f(INT, 0)
    grammars: list[GrammarSpec] = f(_nested(GrammarSpec), [])
    drop_grammars: list[str] = f(STR_LIST, [])
    copies: list[PageCopies] = f(_nested(PageCopies), [])  # none or one (docs/cache-tiers.md)
    # LoRA adapters to load and to drop before ``reqs`` run (docs/lora.md).
    load_loras: list[LoraLoad] = f(_nested(LoraLoad), [])
    drop_loras: list[int] = f(INT_LIST, [])
    state_saves: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    # Prefill/decode disaggregation: pages to write into a decode server's pool
    # (docs/scale-out.md), reported in ``StepResult.kv_sent``.
    kv_sends: list[KVSend] = f(_nested(KVSend), [])


@dataclass
class Scores(Message):
    """Logprobs the worker computed for ``slot``: of the token at each position
    ``pos .. pos + m - 1`` (prompt tokens it was given, or the token it just
    sampled), with the top ``k`` alternatives of each, most likely first
    (``top_ids`` and ``top_logprobs`` hold m rows of k)."""

    slot: int = f(INT)
    pos: int = f(INT)
    logprobs: np.ndarray = f(F64)
    top_ids: np.ndarray = f(I32)
    top_logprobs: np.ndarray = f(F64)

    def entries(self) -> list[list]:
        """As ``OutputItem`` carries them: one ``[logprob, top ids, top logprobs]`` each."""
        m = len(self.logprobs)
        k = len(self.top_ids) // m if m else 0
        ids = self.top_ids.reshape(m, k).tolist()
        lps = self.top_logprobs.reshape(m, k).tolist()
        return [[lp, i, v] for lp, i, v in zip(self.logprobs.tolist(), ids, lps)]


@dataclass
class Forced(Message):
    """Jump-forward: ``slot``'s new tokens of this step are ``token_ids`` instead of
    its one sampled token (the sampled token followed by the tokens its grammar
    forces, or, when the two merge in tokenization, their retokenization)."""

    slot: int = f(INT)
    token_ids: np.ndarray = f(I32)


@dataclass
class Verified(Message):
    """Speculative decoding: ``slot``'s new tokens of this step are ``token_ids``,
    the drafts it accepted followed by the token sampled after them (so at least
    one, at most ``num_drafts + 1``). Its K/V now covers the step's real inputs and
    the accepted drafts; the last token has none yet."""

    slot: int = f(INT)
    token_ids: np.ndarray = f(I32)


@dataclass
class SlotFailure(Message):
    """``slot``'s request must fail with ``message`` (its grammar rejected a token)."""

    slot: int = f(INT)
    message: str = f(STR)


@dataclass
class GrammarFailure(Message):
    """The grammar ``key`` could not be compiled: its requests fail with ``message``."""

    key: str = f(STR)
    message: str = f(STR)


@dataclass
class StepResult(Message):
    """The tokens sampled in step ``step_id`` (one per ``sample=True`` request, in
    order) and the logprobs computed in it.

    Structured output: ``forced`` replaces some slots' sampled token by several;
    ``terminated`` slots' grammars have ended (their requests are complete);
    ``failed`` slots must fail; ``grammars_ready`` and ``grammar_failures``
    report compilations finished since the last step.

    Speculative decoding: ``verified`` gives, for each slot whose step had drafts,
    its new tokens (its entry in ``tokens`` is the first of them).

    Cache tiers: ``copies_done`` are the tickets of ``PageCopies`` whose copies
    finished since the last step (each reported once, in any order);
    ``store_missed`` the pool pages of those tickets' ``store_load`` that the shared
    store did not give (they hold no KV).
    """

    TYPE: ClassVar[str] = "step_result"
    step_id: int = f(INT)
    tokens: np.ndarray = f(I32)
    scores: list[Scores] = f(_nested(Scores), [])
    forced: list[Forced] = f(_nested(Forced), [])
    terminated: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))
    failed: list[SlotFailure] = f(_nested(SlotFailure), [])
    grammars_ready: list[str] = f(STR_LIST, [])
    grammar_failures: list[GrammarFailure] = f(_nested(GrammarFailure), [])
    copies_done: list[int] = f(INT_LIST, [])
    loras: list[LoraReport] = f(_nested(LoraReport), [])  # one per Step.load_loras
    verified: list[Verified] = f(_nested(Verified), [])
    kv_sent: list[KVSent] = f(_nested(KVSent), [])  # sends over since the last step
    # Images the vision encoder ran on in this step, and those whose features came
    # from the encoder cache (docs/multimodal.md).
    encoder_runs: int = f(INT, 0)
    encoder_hits: int = f(INT, 0)
    store_missed: np.ndarray = f(I32, np.zeros(0, dtype=np.int32))


# --------------------------------------------------------------------- control
@dataclass
class Ready(Message):
    """A child finished starting; ``info`` is what the launcher needs from it."""

    TYPE: ClassVar[str] = "ready"
    process: str = f(STR)
    info: dict = f(MAP, {})


@dataclass
class Shutdown(Message):
    """Launcher -> tokenizer: answer everything in flight with ``message`` and exit."""

    TYPE: ClassVar[str] = "shutdown"
    message: str = f(STR)


@dataclass
class Draining(Message):
    """A child acknowledges ``Shutdown``: it now refuses new work (the HTTP front's 503s)."""

    TYPE: ClassVar[str] = "draining"
    process: str = f(STR)

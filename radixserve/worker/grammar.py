"""Structured output in the worker: compiled grammars, per-slot matchers, token
masks and jump-forward (docs/structured.md).

``GrammarCache`` compiles grammars on a background thread, so compilation never
holds up a step: the scheduler names a grammar (``Step.grammars``) when its
first request arrives, the worker reports it ready (``StepResult.grammars_ready``)
a step or more later, and only then does the scheduler admit requests that use
it. The scheduler holds a grammar while any request uses it
(``Step.drop_grammars`` lets go); let go, it stays in a least-recently-used
cache of ``grammar_cache_size`` compiled grammars, keyed by a hash of its
source, so the next request with the same schema finds it compiled. The
tokenizer's vocabulary is turned into xgrammar's ``TokenizerInfo`` once, on the
first compilation.

``GrammarSlots`` owns one ``xgrammar.GrammarMatcher`` per constrained slot (each
of a request's n samples has a slot, so each has its own). Per step:
``apply_masks`` fills one token bitmask row per constrained row and masks the
logits of those rows in one batched call (other rows are untouched);
``accept`` advances each matcher by its sampled token and, with jump-forward,
appends the string the grammar forces next. A token a matcher rejects fails
that request, never the worker. A retracted request comes back with its
history: its matcher is rebuilt by replaying the tokens it had generated.

Jump-forward and the tokenization boundary: the forced string is tokenized
together with the text of the token just sampled, as SGLang does, because the
two may merge into fewer or different tokens (``"`` then ``name": "`` is
``"name`` ...). The sampled token has no KV yet, so replacing it costs
nothing: when the retokenization starts with the sampled token it is kept and
the rest appended; otherwise the retokenization replaces it. Either way the
candidate must decode to exactly that text and be accepted by the matcher;
else the forced string alone is tokenized and appended; else nothing is
forced. Requests that ask for logprobs never jump (forced tokens have no
sampled logprob).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.layers import cpu_kernels
from radixserve.protocol import GrammarSpec
from radixserve.sampling_params import SamplingParams, StructuredOutput
from radixserve.structured import build_grammar, clean_error, xgrammar

log = logging.getLogger("radixserve.worker")

_BITS = 32  # a bitmask word's tokens


class GrammarCache:
    """Compiled grammars by key: held (named by the scheduler and not dropped),
    compiling, and an LRU of ``cache_size`` recently let go."""

    def __init__(
        self,
        tokenizer_loader: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        cache_size: int = 64,
    ) -> None:
        self._load_tokenizer = tokenizer_loader
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_size = cache_size
        self._executor: ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built on the compile thread
        self._held: dict[str, Any] = {}
        self._pending: dict[str, Future] = {}
        self._lru: OrderedDict[str, Any] = OrderedDict()
        self._ready: list[str] = []
        self._failures: list[tuple[str, str]] = []
        self._done = threading.Event()
        self.compiled = 0  # compilations run (tests read it: a cache hit runs none)

    # --------------------------------------------------- scheduler messages
    def submit(self, spec: GrammarSpec) -> None:
        """Hold ``spec.key``: from the cache when it is there, else compiled in the background."""
        key = spec.key
        if key in self._held or key in self._pending:
            return
        if key in self._lru:
            self._held[key] = self._lru.pop(key)
            self._ready.append(key)
            return
        so = StructuredOutput(spec.kind, spec.spec)
        if so.key != key:
            self._failures.append((key, "the grammar's key does not match its source"))
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="radixserve-grammar")
        future = self._executor.submit(self._compile, so)
        future.add_done_callback(lambda _: self._done.set())
        self._pending[key] = future

    def drop(self, key: str) -> None:
        """No request uses ``key`` any more: keep it in the LRU (or cancel its compilation)."""
        future = self._pending.pop(key, None)
        if future is not None:
            future.cancel()
            return
        compiled = self._held.pop(key, None)
        if compiled is None or self.cache_size == 0:
            return
        self._lru[key] = compiled
        while len(self._lru) > self.cache_size:
            self._lru.popitem(last=False)

    def poll(self) -> tuple[list[str], list[tuple[str, str]]]:
        """Grammars ready and failures since the last poll."""
        for key, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[key]
            try:
                self._held[key] = future.result()
                self._ready.append(key)
            except Exception as e:  # a grammar xgrammar cannot compile: its requests fail
                self._failures.append((key, _message(e)))
        ready, self._ready = self._ready, []
        failures, self._failures = self._failures, []
        return ready, failures

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for a compilation in flight to finish."""
        if not self._pending or any(f.done() for f in self._pending.values()):
            return
        self._done.clear()
        if not any(f.done() for f in self._pending.values()):
            self._done.wait(timeout)

    def get(self, key: str) -> Any:
        compiled = self._held.get(key)
        if compiled is None:
            raise ValueError(f"grammar {key} is not compiled and held (not reported ready)")
        return compiled

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------ compile thread
    def _compile(self, so: StructuredOutput) -> Any:
        xgr = xgrammar()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._load_tokenizer(),
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
            )
            # One cache (this class's, by source hash): xgrammar's own is off.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = self._compiler.compile_grammar(build_grammar(so))
        self.compiled += 1
        return compiled


def _message(e: BaseException) -> str:
    text = str(e) if isinstance(e, ValueError) else clean_error(e)
    return f"could not compile the grammar: {text}"


@dataclass
class _Slot:
    matcher: Any
    jump: bool  # jump-forward for this slot


class GrammarSlots:
    """The matchers of the constrained slots, their masks and their jump-forward."""

    def __init__(self, cache: GrammarCache, tokenizer_loader: Any, jump_forward: bool) -> None:
        self.cache = cache
        self._load_tokenizer = tokenizer_loader
        self._tokenizer: Any = None
        self.jump_forward = jump_forward
        self._slots: dict[int, _Slot] = {}
        self._bitmask: torch.Tensor | None = None
        self.vocab_size = cache.vocab_size

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def add(
        self, slot: int, params: SamplingParams, prompt_len: int, history: np.ndarray
    ) -> str | None:
        """Give ``slot`` a matcher for ``params.structured`` (none without one) and
        replay the tokens it generated before (``history[prompt_len:]``). Returns
        an error message when a replayed token is rejected."""
        self._slots.pop(slot, None)
        if params.structured is None:
            return None
        xgr = xgrammar()
        matcher = xgr.GrammarMatcher(self.cache.get(params.structured.key))
        self._slots[slot] = _Slot(matcher, self.jump_forward and params.logprobs is None)
        for token in np.asarray(history[prompt_len:]).tolist():
            if not matcher.accept_token(int(token)):
                self._slots.pop(slot)
                return f"the grammar rejects token {token} of the request's output on replay"
        return None

    def remove(self, slot: int) -> None:
        self._slots.pop(slot, None)

    def active(self, slots: list[int]) -> bool:
        return any(s in self._slots for s in slots)

    # --------------------------------------------------------------- masks
    def fill_masks(self, slots: list[int]) -> tuple[list[int], torch.Tensor]:
        """The constrained rows of a batch sampling ``slots`` and their bitmask:
        [len(slots), ceil(vocab / 32)] int32, row i filled when row i is constrained."""
        rows = [i for i, s in enumerate(slots) if s in self._slots]
        words = -(-self.vocab_size // _BITS)
        if self._bitmask is None or self._bitmask.shape[0] < len(slots):
            self._bitmask = torch.empty(max(len(slots), 8), words, dtype=torch.int32)
        bitmask = self._bitmask[: len(slots)]
        for i in rows:
            self._slots[slots[i]].matcher.fill_next_token_bitmask(bitmask, i)
        return rows, bitmask

    def apply_masks(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Mask every token the grammar of ``slots[i]``'s row cannot take next; returns
        the masked logits (``logits`` itself when row-major; the LM head may hand
        over a transposed view, which is copied once: the kernels need rows)."""
        rows, bitmask = self.fill_masks(slots)
        if rows:
            logits = logits.contiguous()
            apply_bitmask(logits, bitmask, rows, self.vocab_size)
        return logits

    # --------------------------------------------------------------- accept
    def accept(
        self, slots: list[int], tokens: np.ndarray
    ) -> tuple[dict[int, list[int]], list[int], list[tuple[int, str]]]:
        """Advance each constrained slot's matcher by its sampled token.

        Returns the forced tokens (slot -> the tokens that replace its sampled
        one, jump-forward), the slots whose grammar terminated, and the slots
        whose token was rejected, with a message (their matcher is dropped)."""
        forced: dict[int, list[int]] = {}
        terminated: list[int] = []
        failed: list[tuple[int, str]] = []
        for slot, token in zip(slots, tokens.tolist()):
            if slot in self._slots:
                self._accept_one(slot, token, forced, terminated, failed)
        return forced, terminated, failed

    def _accept_one(
        self,
        slot: int,
        token: int,
        forced: dict[int, list[int]],
        terminated: list[int],
        failed: list[tuple[int, str]],
    ) -> None:
        st = self._slots[slot]
        m = st.matcher
        if m.is_terminated() or not m.accept_token(token):
            failed.append((slot, f"the grammar rejected the sampled token {token}"))
            del self._slots[slot]
        elif m.is_terminated():
            terminated.append(slot)
        elif st.jump and (ids := self._jump(m, token)) is not None:
            forced[slot] = ids

    # ---------------------------------------------------------- speculation
    def walk_drafts(self, slot: int, drafts: list[int]) -> tuple[int, torch.Tensor]:
        """Walk ``slot``'s grammar over ``drafts``: the number ``a`` of leading drafts
        it accepts (a draft that completes the grammar is not taken: the row before it
        samples it as a plain step would) and the bitmask [a + 1, words] of the states
        after the first 0 .. a drafts (row i's mask). The matcher is rolled back."""
        m = self._slots[slot].matcher
        words = -(-self.vocab_size // _BITS)
        bitmask = torch.empty(len(drafts) + 1, words, dtype=torch.int32)
        m.fill_next_token_bitmask(bitmask, 0)
        a = 0
        for d in drafts:
            if not m.accept_token(int(d)):
                break
            if m.is_terminated():
                m.rollback(1)
                break
            a += 1
            m.fill_next_token_bitmask(bitmask, a)
        if a:
            m.rollback(a)
        return a, bitmask[: a + 1]

    def accept_verified(
        self,
        slot: int,
        ids: list[int],
        forced: dict[int, list[int]],
        terminated: list[int],
        failed: list[tuple[int, str]],
    ) -> None:
        """Advance ``slot``'s matcher by a verification's tokens (the accepted drafts,
        which ``walk_drafts`` checked, then the sampled one, taken as ``accept`` takes a
        sampled token: termination, jump-forward)."""
        m = self._slots[slot].matcher
        if not _accept_all(m, ids[:-1]):  # pragma: no cover - walk_drafts accepted them
            failed.append((slot, "the grammar rejected an accepted draft"))
            del self._slots[slot]
            return
        self._accept_one(slot, ids[-1], forced, terminated, failed)

    def _jump(self, m: Any, token: int) -> list[int] | None:
        """The tokens replacing ``token`` once the forced string is appended; None: no jump."""
        forced = m.find_jump_forward_string()
        if not forced:
            return None
        tok = self.tokenizer
        last = tok.decode([token])
        if "\ufffd" not in last:  # a whole character: the boundary may merge
            merged = tok.encode(last + forced, add_special_tokens=False)
            if merged and tok.decode(merged) == last + forced:
                if merged[0] == token:
                    if _accept_all(m, merged[1:]):
                        return merged
                else:
                    m.rollback(1)
                    if _accept_all(m, merged):
                        return merged
                    if not m.accept_token(token):  # pragma: no cover - it was accepted before
                        raise RuntimeError("the grammar matcher lost its state on rollback")
        alone = tok.encode(forced, add_special_tokens=False)
        if alone and tok.decode(alone) == forced and _accept_all(m, alone):
            return [token, *alone]
        return None


def _accept_all(m: Any, ids: list[int]) -> bool:
    """Accept every token of ``ids``, or none of them (rolled back)."""
    for n, t in enumerate(ids):
        if not m.accept_token(t):
            if n:
                m.rollback(n)
            return False
    return True


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int
) -> None:
    """Set to -inf, in place, the logits of ``rows`` whose token's bit is 0 in the
    same row of ``bitmask``: the native CPU kernel (csrc/, one pass that skips
    whole words of allowed tokens) where it is built, xgrammar's kernel on CUDA,
    else the same in torch."""
    if not logits.is_contiguous():
        raise ValueError("token masks need row-major logits")
    width = min(vocab_size, logits.shape[1])
    if cpu_kernels.bitmask_ok(logits) and bitmask.shape[1] * _BITS >= logits.shape[1]:
        cpu_kernels.apply_token_bitmask(logits, bitmask, rows)
        return
    if logits.is_cuda:
        bm = bitmask.to(logits.device, non_blocking=True)
        xgrammar().apply_token_bitmask_inplace(logits, bm, vocab_size=width, indices=rows)
        return
    apply_bitmask_torch(logits, bitmask, rows, vocab_size)


def apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int
) -> None:
    """``apply_bitmask`` in plain torch (any device and dtype)."""
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    allowed = unpack_bitmask(bitmask.index_select(0, idx.cpu()).to(logits.device), vocab_size)
    width = min(vocab_size, logits.shape[1])
    sub = logits.index_select(0, idx)
    sub[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
    logits.index_copy_(0, idx, sub)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, words] int32 bitmask -> [n, vocab_size] bool (bit j of word w: token 32w + j)."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()

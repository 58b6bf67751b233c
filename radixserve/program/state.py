"""The program states users hold: ``ProgramState`` (Engine, Client) and
``AsyncProgramState`` (AsyncClient), their shared context and plans, and the
``Branches`` a fork returns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from radixserve.program.backends import AsyncClientBackend, ClientBackend, EngineBackend
from radixserve.program.plans import (
    Plan,
    ProgramError,
    Selection,
    T,
    _Generate,
    _lockstep,
    _run,
    _run_async,
    _Tokenize,
)
from radixserve.results import Result
from radixserve.sampling_params import SamplingParams

S = TypeVar("S", bound="_State")

# ------------------------------------------------------------------ state
_PREFILL_ONLY = SamplingParams(max_tokens=0)


def _sampling(sampling_params: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
    if sampling_params is not None and sampling:
        raise ValueError("pass sampling_params or sampling keyword arguments, not both")
    sp = sampling_params if sampling_params is not None else SamplingParams(**sampling)
    if sp.n != 1:
        raise ValueError("a program generates one sample per gen; fork for several")
    return sp


def _check_finished(result: Result, what: str) -> None:
    if result.finish_reason in ("abort", "error"):
        why = f": {result.error}" if result.error else ""
        raise ProgramError(f"{what}: the request ended with {result.finish_reason}{why}")


class _State:
    """What the sync and async program states share: the context and the plans."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._ids: list[int] = []
        # Appended, not yet tokenized: text (a call), or token ids queued behind text.
        # A call with messages is the rendering a chat program starts from.
        self._pending: list[_Tokenize | list[int]] = []
        self._vars: dict[str, str] = {}
        self.results: dict[str, Result | Selection] = {}
        self._messages: list[dict[str, Any]] | None = None  # None: not a chat
        self._chat_ids: list[int] = []  # the template's rendering of _messages
        self._resident = 0  # how much of the context a request of this program computed
        self._op: str | None = None  # the variable being computed (for BranchError)

    def _start(
        self,
        prompt: str | None,
        input_ids: Sequence[int] | None,
        messages: Sequence[Mapping[str, Any]] | None,
    ) -> None:
        if sum(x is not None for x in (prompt, input_ids, messages)) > 1:
            raise ValueError("start a program from at most one of prompt, input_ids, messages")
        if input_ids is not None:
            self._ids = [int(t) for t in input_ids]
        elif prompt is not None:
            self._pending.append(_Tokenize(prompt, add_special_tokens=True))
        elif messages is not None:
            self._messages = []
            if messages:
                self._pending.append(_Tokenize(messages=[dict(m) for m in messages]))
                self._messages = [dict(m) for m in messages]

    # ------------------------------------------------------------ reading
    @property
    def token_ids(self) -> list[int]:
        """The context (a copy)."""
        return list(self._ids)

    @property
    def messages(self) -> list[dict[str, Any]] | None:
        """A chat program's conversation so far (a copy); None for a plain program."""
        return None if self._messages is None else [dict(m) for m in self._messages]

    def __getitem__(self, name: str) -> str:
        return self._vars[name]

    def __contains__(self, name: object) -> bool:
        return name in self._vars

    def variables(self) -> dict[str, str]:
        return dict(self._vars)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {len(self._ids)} tokens, variables {list(self._vars)}>"

    def _append(self, piece: str | Sequence[int]) -> None:
        if isinstance(piece, str):
            if piece:
                self._pending.append(_Tokenize(piece))
        elif isinstance(piece, Sequence):
            ids = [int(t) for t in piece]
            if self._pending:  # behind text not yet tokenized
                self._pending.append(ids)
            else:
                self._ids += ids
        else:
            raise TypeError(f"append a string or token ids, not {type(piece).__name__}")

    def _copy(self: S) -> S:
        child = object.__new__(type(self))
        child.__dict__.update(self.__dict__)
        child._ids = list(self._ids)
        child._pending = list(self._pending)
        child._vars = dict(self._vars)
        child.results = dict(self.results)
        child._messages = None if self._messages is None else [dict(m) for m in self._messages]
        child._chat_ids = list(self._chat_ids)
        child._op = None
        return child

    # -------------------------------------------------------------- plans
    def _flush_plan(self) -> Plan[None]:
        while self._pending:
            piece = self._pending[0]
            try:
                ids = (yield piece) if isinstance(piece, _Tokenize) else piece
            except Exception:
                self._pending.clear()  # what was appended since the last success is dropped
                raise
            self._pending.pop(0)
            self._ids += ids
            if isinstance(piece, _Tokenize) and piece.messages is not None:
                self._chat_ids = list(ids)

    def _prefill_plan(self) -> Plan[None]:
        """The frontend hint: compute (and cache) the context, generate nothing."""
        if self._ids and self._resident < len(self._ids):
            [result] = yield _Generate(((list(self._ids), _PREFILL_ONLY),))
            _check_finished(result, "the context's prefill")
            self._resident = len(self._ids)

    def _gen_plan(self, name: str, sp: SamplingParams) -> Plan[str]:
        self._op = name
        yield from self._flush_plan()
        [result] = yield _Generate(((list(self._ids), sp),))
        _check_finished(result, f"gen {name!r}")
        # The last generated token has no KV yet: the next request computes it.
        self._resident = len(self._ids) + max(len(result.token_ids) - 1, 0)
        self._ids += result.token_ids
        self._vars[name] = result.text
        self.results[name] = result
        self._op = None
        return result.text

    def _select_plan(self, name: str, choices: Sequence[str]) -> Plan[str]:
        self._op = name
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choices must be a non-empty list of strings")
        yield from self._flush_plan()
        if not self._ids:
            raise ValueError("select needs a context: the first token of a prompt has no logprob")
        tokens = []
        for choice in choices:
            ids = yield _Tokenize(choice)
            if not ids:
                raise ValueError(f"choice {choice!r} has no tokens")
            tokens.append(ids)
        if len(choices) > 1:
            yield from self._prefill_plan()  # computed once, not once per choice
        context = list(self._ids)
        sp = SamplingParams(max_tokens=0, prompt_logprobs=0, logprob_start_len=len(context))
        results = yield _Generate(tuple((context + t, sp) for t in tokens))
        logprobs = []
        for result in results:
            _check_finished(result, f"select {name!r}")
            logprobs.append([e.logprob for e in result.prompt_logprobs[len(context) :]])
        scores = [sum(lps) / len(lps) for lps in logprobs]
        best = max(range(len(scores)), key=scores.__getitem__)  # the first of equal scores
        self._ids += tokens[best]
        self._resident = len(self._ids)
        self._vars[name] = choices[best]
        self.results[name] = Selection(choices[best], best, list(choices), scores, logprobs)
        self._op = None
        return choices[best]

    def _fork_plan(self, n: int) -> Plan[list]:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("fork needs a number of branches >= 1")
        self._op = None
        yield from self._flush_plan()
        yield from self._prefill_plan()
        return [self._copy() for _ in range(n)]

    def _render_plan(self, messages: list[dict[str, Any]], opening: bool) -> Plan[list[int]]:
        """The template's rendering of ``messages`` (with the generation prompt when
        ``opening``), checked to extend the rendering of the conversation so far."""
        if not messages:
            return []
        ids = yield _Tokenize(messages=messages, add_generation_prompt=opening)
        if ids[: len(self._chat_ids)] != self._chat_ids:
            raise ValueError(
                "this chat template renders a conversation differently once it continues "
                "(the rendering with one more message does not extend the rendering "
                "without it): a chat program cannot keep its tokens"
            )
        return ids

    def _message_plan(self, role: str, content: str, start: int | None = None) -> Plan[None]:
        if self._messages is None:
            raise ValueError("messages need a chat program: program(messages=[...])")
        if not isinstance(content, str):
            raise ValueError("message content must be a string")
        if start is None:
            self._op = None
        yield from self._flush_plan()
        message = {"role": role, "content": content}
        ids = yield from self._render_plan([*self._messages, message], opening=False)
        old = list(self._ids)
        if start is not None:  # an assistant turn: its generated tokens give way
            del self._ids[start:]
        self._ids += ids[len(self._chat_ids) :]
        # What earlier requests computed still counts up to where the tokens differ.
        same = next((k for k, (a, b) in enumerate(zip(old, self._ids)) if a != b), None)
        self._resident = min(
            self._resident, min(len(old), len(self._ids)) if same is None else same
        )
        self._chat_ids = ids
        self._messages.append(message)

    def _assistant_gen_plan(self, name: str, sp: SamplingParams) -> Plan[str]:
        if self._messages is None:
            raise ValueError("assistant_gen needs a chat program: program(messages=[...])")
        yield from self._flush_plan()
        self._op = name
        opened = yield from self._render_plan(self._messages, opening=True)
        start = len(self._ids)
        resident, variables, results = self._resident, dict(self._vars), dict(self.results)
        self._ids += opened[len(self._chat_ids) :]
        try:
            text = yield from self._gen_plan(name, sp)
            yield from self._message_plan("assistant", text, start)
        except BaseException:  # the state stays as it was
            del self._ids[start:]
            self._resident, self._vars, self.results = resident, variables, results
            raise
        return text


class ProgramState(_State):
    """A prompt program on an ``Engine`` or a ``Client`` (see the module docstring).
    Made by ``Engine.program`` / ``Client.program``; a ``with`` block aborts the
    program's requests still in flight when it ends."""

    def __init__(
        self,
        backend: EngineBackend | ClientBackend,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(backend)
        self._start(prompt, input_ids, messages)
        self._do(self._flush_plan())

    def _do(self, plan: Plan[T]) -> T:
        return _run(self._backend, plan)

    def __iadd__(self, piece: str | Sequence[int]) -> ProgramState:
        self._append(piece)
        self._do(self._flush_plan())
        return self

    def gen(
        self, name: str, *, sampling_params: SamplingParams | None = None, **sampling: Any
    ) -> str:
        """Generate after the context; returns the text (also ``self[name]``)."""
        return self._do(self._gen_plan(name, _sampling(sampling_params, sampling)))

    def select(self, name: str, choices: Sequence[str]) -> str:
        """The choice with the highest mean token logprob; returns it (also ``self[name]``)."""
        return self._do(self._select_plan(name, choices))

    def fork(self, n: int) -> Branches[ProgramState]:
        """n copies of this state, after making the context resident."""
        return Branches(self._do(self._fork_plan(n)))

    def system(self, content: str) -> None:
        self._do(self._message_plan("system", content))

    def user(self, content: str) -> None:
        self._do(self._message_plan("user", content))

    def assistant(self, content: str) -> None:
        self._do(self._message_plan("assistant", content))

    def assistant_gen(
        self, name: str, *, sampling_params: SamplingParams | None = None, **sampling: Any
    ) -> str:
        """Generate the assistant's next message; returns its text (also ``self[name]``)."""
        return self._do(self._assistant_gen_plan(name, _sampling(sampling_params, sampling)))

    def close(self) -> None:
        """Abort this program's requests still in flight (those of other threads)."""
        self._backend.abort_all()

    def __enter__(self) -> ProgramState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncProgramState(_State):
    """A prompt program on an ``AsyncClient``: ``ProgramState``'s operations, awaited.
    ``s += "text"`` is tokenized at the next awaited operation (or ``await s.flush()``);
    ``token_ids`` shows only what was tokenized."""

    def __init__(
        self,
        backend: AsyncClientBackend,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(backend)
        self._start(prompt, input_ids, messages)

    async def _do(self, plan: Plan[T]) -> T:
        return await _run_async(self._backend, plan)

    def __iadd__(self, piece: str | Sequence[int]) -> AsyncProgramState:
        self._append(piece)
        return self

    async def flush(self) -> None:
        """Tokenize what was appended with ``+=``."""
        await self._do(self._flush_plan())

    async def gen(
        self, name: str, *, sampling_params: SamplingParams | None = None, **sampling: Any
    ) -> str:
        return await self._do(self._gen_plan(name, _sampling(sampling_params, sampling)))

    async def select(self, name: str, choices: Sequence[str]) -> str:
        return await self._do(self._select_plan(name, choices))

    async def fork(self, n: int) -> AsyncBranches:
        return AsyncBranches(await self._do(self._fork_plan(n)))

    async def system(self, content: str) -> None:
        await self._do(self._message_plan("system", content))

    async def user(self, content: str) -> None:
        await self._do(self._message_plan("user", content))

    async def assistant(self, content: str) -> None:
        await self._do(self._message_plan("assistant", content))

    async def assistant_gen(
        self, name: str, *, sampling_params: SamplingParams | None = None, **sampling: Any
    ) -> str:
        return await self._do(self._assistant_gen_plan(name, _sampling(sampling_params, sampling)))

    async def close(self) -> None:
        await self._backend.abort_all()

    async def __aenter__(self) -> AsyncProgramState:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# --------------------------------------------------------------- branches
class _BranchList(list, Generic[S]):
    def values(self, name: str) -> list[str]:
        """Each branch's ``name`` variable, in order."""
        return [b[name] for b in self]

    def _name(self, i: int) -> str | None:
        return self[i]._op

    def _lockstep(self, make: Callable[[S], Plan[T]]) -> Plan[list[T]]:
        return _lockstep([make(b) for b in self], self._name)


class Branches(_BranchList[ProgramState]):
    """The states ``fork`` returned (a list), with operations on all of them at once."""

    def gen(
        self, name: str, *, sampling_params: SamplingParams | None = None, **sampling: Any
    ) -> list[str]:
        """``gen`` on every branch, as one batch; the texts in order."""
        sp = _sampling(sampling_params, sampling)
        return self._do(self._lockstep(lambda b: b._gen_plan(name, sp)))

    def select(self, name: str, choices: Sequence[str]) -> list[str]:
        """``select`` on every branch, as one batch; the choices in order."""
        return self._do(self._lockstep(lambda b: b._select_plan(name, choices)))

    def run(self, fn: Callable[[ProgramState], T]) -> list[T]:
        """``fn(branch)`` for every branch (on threads with a ``Client``); the return
        values in order. The first to fail raises ``BranchError``."""
        if not self:
            return []
        fns = [lambda b=b: fn(b) for b in self]
        return self[0]._backend.map(fns, self._name)

    def _do(self, plan: Plan[T]) -> T:
        if not self:
            plan.close()
            return []  # type: ignore[return-value]
        return _run(self[0]._backend, plan)


class AsyncBranches(_BranchList[AsyncProgramState]):
    """``Branches`` for ``AsyncProgramState``: the same operations, awaited."""

    async def gen(
        self, name: str, *, sampling_params: SamplingParams | None = None, **sampling: Any
    ) -> list[str]:
        sp = _sampling(sampling_params, sampling)
        return await self._do(self._lockstep(lambda b: b._gen_plan(name, sp)))

    async def select(self, name: str, choices: Sequence[str]) -> list[str]:
        return await self._do(self._lockstep(lambda b: b._select_plan(name, choices)))

    async def run(self, fn: Callable[[AsyncProgramState], Awaitable[T]]) -> list[T]:
        """``await fn(branch)`` for every branch, concurrently; the first to fail
        raises ``BranchError`` and cancels the others."""
        if not self:
            return []
        fns = [lambda b=b: fn(b) for b in self]
        return await self[0]._backend.map(fns, self._name)

    async def _do(self, plan: Plan[T]) -> T:
        if not self:
            plan.close()
            return []  # type: ignore[return-value]
        return await _run_async(self[0]._backend, plan)

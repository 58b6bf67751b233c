"""Prompt programs: a context held as exact token ids, extended by text, generation
and choice, and forked into branches that share its KV through the prefix cache.

    s = engine.program("Q: What is 2 + 2?\\nA:")      # or client.program(...)
    s.gen("answer", max_tokens=16, temperature=0, stop=["\\n"])
    s += "\\nIs that right? "
    s.select("verdict", ["yes", "no"])
    print(s["answer"], s["verdict"])

    branches = s.fork(3)                              # the context is computed once
    branches.gen("idea", max_tokens=32, temperature=0.8)
    print(branches.values("idea"))

The context never goes through text again: each request sends it as
``input_ids``, so what the model saw is exactly what the next request extends
(no re-tokenization drift, and every request's prefix is the previous one's,
which the radix cache serves). The rules, in docs/programs.md:

- ``s += "text"`` appends the text's tokens, tokenized on its own, without
  special tokens; ``s += [ids]`` appends token ids. The program's first prompt
  gets the tokenizer's special tokens (BOS), as ``generate(prompt)`` would.
- ``s.gen(name, ...)`` appends exactly the tokens the model generated (with a stop
  string, the tokens that produced it too) and stores the text in ``s[name]``
  (without the stop string), the ``Result`` in ``s.results[name]``.
- ``s.select(name, choices)`` scores each choice by the mean logprob of its tokens
  after the context (token-length normalization), appends the winner's tokens
  (the first of equal scores) and stores it; ``s.results[name]`` is a
  ``Selection``.
- ``s.fork(n)`` first makes the context resident (a ``max_tokens=0`` request,
  unless an earlier request of this program already computed all of it), then
  returns ``Branches`` of n copies. ``branches.gen`` / ``branches.select`` run one
  operation on every branch at once (one batch in the Engine, concurrent requests
  on a server); ``branches.run(fn)`` calls ``fn(branch)`` for each (on threads with
  a ``Client``, one after another with the Engine, as tasks with an
  ``AsyncClient``). A branch that fails raises ``BranchError`` (its index, and the
  variable it was computing); with a client the other branches' requests are
  aborted.
- Chat: ``program(messages=[...])`` starts from the template's rendering of the
  messages; ``s.system/user/assistant(text)`` append one message: the tokens by
  which the rendering of the conversation with it extends the rendering without
  it; ``s.assistant_gen(name, ...)`` appends the template's generation prompt,
  generates, then replaces the generated tokens by the template's rendering of
  the assistant message. After each message the chat part of the context is
  exactly what ``tokenize(messages=...)`` gives for the conversation so far.

``AsyncProgramState`` (``AsyncClient.program``) has the same operations as
coroutines; there ``s += "text"`` is tokenized at the next awaited operation (or
``await s.flush()``).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from radixserve.results import Result
from radixserve.sampling_params import SamplingParams

T = TypeVar("T")
S = TypeVar("S", bound="_State")
# Requests a sync client sends at once for one batch (each waits on a thread).
MAX_THREADS = 64


class ProgramError(RuntimeError):
    """A program's request did not complete (it was aborted, or the server failed it)."""


class BranchError(ProgramError):
    """Branch ``branch`` of a fork failed; ``name`` is the variable it was computing
    (None outside ``gen``/``select``), ``error`` (also ``__cause__``) what it raised."""

    def __init__(self, branch: int, name: str | None, error: BaseException) -> None:
        where = f"branch {branch}" + (f" ({name!r})" if name is not None else "")
        super().__init__(f"{where} failed: {type(error).__name__}: {error}")
        self.branch, self.name, self.error = branch, name, error


@dataclass(frozen=True)
class Selection:
    """What ``select`` chose: ``choices[index]``, and every choice's ``score`` (the mean
    of ``token_logprobs``, the logprob of each of its tokens after the context)."""

    choice: str
    index: int
    choices: list[str]
    scores: list[float]
    token_logprobs: list[list[float]]


# ------------------------------------------------------------------ calls
# Operations are generators ("plans") that yield one of these calls and are sent
# its answer: the token ids of a ``_Tokenize``, a ``_Generate``'s Results in order.
# A sync or an async runner executes the calls, so the logic exists once.
@dataclass(frozen=True)
class _Tokenize:
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = False

    def options(self) -> dict[str, Any]:
        """The keyword arguments of a client's ``tokenize`` after the prompt."""
        return {
            "messages": self.messages,
            "add_special_tokens": self.add_special_tokens,
            "add_generation_prompt": self.add_generation_prompt,
        }


@dataclass(frozen=True)
class _Generate:
    requests: tuple[tuple[list[int], SamplingParams], ...]
    # Answered as is, failures included (for ``_lockstep``, which hands them out);
    # otherwise a failure is raised inside the plan.
    raw: bool = False


Call = _Tokenize | _Generate
Plan = Generator[Call, Any, T]
Answer = list[int] | list[Result | BaseException] | BaseException


def _first_error(answer: Answer) -> BaseException | None:
    if isinstance(answer, BaseException):
        return answer
    return next((a for a in answer if isinstance(a, BaseException)), None)


def _advance(plan: Plan, answer: Answer | None, raw: bool = False) -> Call:
    """Send ``answer`` into ``plan`` (a failure is raised inside it, unless ``raw``) and
    return its next call; StopIteration carries its value."""
    error = None if answer is None or raw else _first_error(answer)
    return plan.throw(error) if error is not None else plan.send(answer)


def _lockstep(plans: list[Plan], names: Callable[[int], str | None]) -> Plan[list]:
    """One plan that runs ``plans`` (one per branch) together: their tokenizations one
    by one, their generations as one batch. The first branch to fail (the lowest index
    among those failing at once) raises ``BranchError``; the others are closed."""
    calls: dict[int, Call] = {}
    values: list[Any] = [None] * len(plans)
    failed: list[tuple[int, Exception]] = []

    def advance(i: int, answer: Answer | None) -> None:
        try:
            calls[i] = _advance(plans[i], answer)
        except StopIteration as stop:
            calls.pop(i, None)
            values[i] = stop.value
        except Exception as e:
            calls.pop(i, None)
            failed.append((i, e))

    for i in range(len(plans)):
        advance(i, None)
    while calls and not failed:
        tokenizing = [i for i, c in calls.items() if isinstance(c, _Tokenize)]
        if tokenizing:
            i = tokenizing[0]
            try:
                answer = yield calls[i]
            except Exception as e:  # the runner raises a failure here: it is branch i's
                answer = e
            advance(i, answer)
            continue
        live = sorted(calls)
        batch = [r for i in live for r in calls[i].requests]  # type: ignore[union-attr]
        answers = yield _Generate(tuple(batch), raw=True)
        start = 0
        for i in live:
            size = len(calls[i].requests)  # type: ignore[union-attr]
            advance(i, answers[start : start + size])
            start += size
    for i in list(calls):
        plans[i].close()
    if failed:
        i, error = min(failed, key=lambda f: f[0])
        raise BranchError(i, names(i), error) from error
    return values


def _run(backend: Any, plan: Plan[T]) -> T:
    answer, raw = None, False
    while True:
        try:
            call = _advance(plan, answer, raw)
        except StopIteration as stop:
            return stop.value
        answer, raw = backend.call(call), getattr(call, "raw", False)


async def _run_async(backend: Any, plan: Plan[T]) -> T:
    answer, raw = None, False
    while True:
        try:
            call = _advance(plan, answer, raw)
        except StopIteration as stop:
            return stop.value
        answer, raw = await backend.call(call), getattr(call, "raw", False)


# --------------------------------------------------------------- backends
class EngineBackend:
    """Runs a program's calls on an in-process ``Engine``: a batch is one
    ``Engine.generate``; branches' functions run one after another (the Engine is
    not thread-safe)."""

    def __init__(self, engine: Any, cache_salt: str | None = None) -> None:
        self.engine, self.cache_salt = engine, cache_salt

    def call(self, call: Call) -> Answer:
        if isinstance(call, _Tokenize):
            try:
                return self.engine.inputs.tokenize(
                    call.prompt, call.messages, call.add_special_tokens, call.add_generation_prompt
                )
            except ValueError as e:
                return e
        # Checked one by one first, so that a bad request fails alone.
        answers: list[Any] = [None] * len(call.requests)
        good = []
        for i, (ids, sp) in enumerate(call.requests):
            try:
                self.engine.inputs.to_ids(input_ids=ids)
                self.engine.inputs.check_sampling(sp)
                self.engine.scheduler.check_request(ids, sp)
            except ValueError as e:
                answers[i] = e
            else:
                good.append(i)
        if good:
            results = self.engine.generate(
                [call.requests[i][0] for i in good],
                [call.requests[i][1] for i in good],
                cache_salt=self.cache_salt,
            )
            for i, result in zip(good, results):
                answers[i] = result
        return answers

    def map(self, fns: list[Callable[[], T]], names: Callable[[int], str | None]) -> list[T]:
        out = []
        for i, fn in enumerate(fns):
            try:
                out.append(fn())
            except Exception as e:
                raise BranchError(i, names(i), e) from e
        return out

    def abort_all(self) -> None:
        """Nothing is outstanding between calls: the Engine runs each to the end."""


class ClientBackend:
    """Runs a program's calls on a ``Client``: a batch's requests concurrently, each on a
    thread; branches' functions on threads too. Tracks the requests in flight, so a
    failing branch (or leaving a ``with`` block) aborts the rest."""

    def __init__(
        self, client: Any, cache_salt: str | None = None, timeout: float | None = None
    ) -> None:
        self.client, self.cache_salt, self.timeout = client, cache_salt, timeout
        self._lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._stopping = threading.Event()  # a branch of ``map`` failed: send no more

    def call(self, call: Call) -> Answer:
        if isinstance(call, _Tokenize):
            try:
                return self.client.tokenize(call.prompt, **call.options(), timeout=self.timeout)
            except Exception as e:
                return e
        if len(call.requests) == 1:
            return [self._generate(*call.requests[0])]
        with ThreadPoolExecutor(min(len(call.requests), MAX_THREADS)) as pool:
            return list(pool.map(lambda r: self._generate(*r), call.requests))

    def _generate(self, ids: list[int], sp: SamplingParams) -> Result | BaseException:
        rid = uuid.uuid4().hex
        with self._lock:
            if self._stopping.is_set():
                return ProgramError("not sent: another branch failed")
            self._in_flight.add(rid)
        try:
            return self.client.generate(**_request(ids, sp, rid, self))
        except Exception as e:
            return e
        finally:
            with self._lock:
                self._in_flight.discard(rid)

    def map(self, fns: list[Callable[[], T]], names: Callable[[int], str | None]) -> list[T]:
        with ThreadPoolExecutor(min(len(fns), MAX_THREADS)) as pool:
            futures = [pool.submit(fn) for fn in fns]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [i for i, f in enumerate(futures) if f in done and f.exception()]
            if failed:
                self._stopping.set()
                try:
                    self.abort_all()
                    wait(futures)
                finally:
                    self._stopping.clear()
                i = failed[0]
                error = futures[i].exception()
                raise BranchError(i, names(i), error) from error  # type: ignore[arg-type]
        return [f.result() for f in futures]

    def abort_all(self) -> None:
        with self._lock:
            outstanding = list(self._in_flight)
        for rid in outstanding:
            self.client.abort(rid)


def _request(ids: list[int], sp: SamplingParams, rid: str, backend: Any) -> dict[str, Any]:
    """A client ``generate``'s keyword arguments for one request of a program."""
    return {
        "input_ids": ids,
        "sampling_params": sp,
        "cache_salt": backend.cache_salt,
        "request_id": rid,
        "timeout": backend.timeout,
    }


class AsyncClientBackend:
    """``ClientBackend`` for an ``AsyncClient``: a batch's requests and branches'
    functions as concurrent tasks; a failing branch cancels the others (which aborts
    their requests)."""

    def __init__(
        self, client: Any, cache_salt: str | None = None, timeout: float | None = None
    ) -> None:
        self.client, self.cache_salt, self.timeout = client, cache_salt, timeout
        self._in_flight: set[str] = set()

    async def call(self, call: Call) -> Answer:
        if isinstance(call, _Tokenize):
            try:
                return await self.client.tokenize(
                    call.prompt, **call.options(), timeout=self.timeout
                )
            except Exception as e:
                return e
        return list(await asyncio.gather(*(self._generate(*r) for r in call.requests)))

    async def _generate(self, ids: list[int], sp: SamplingParams) -> Result | BaseException:
        rid = uuid.uuid4().hex
        self._in_flight.add(rid)
        try:
            return await self.client.generate(**_request(ids, sp, rid, self))
        except Exception as e:
            return e
        finally:
            self._in_flight.discard(rid)

    async def map(
        self, fns: list[Callable[[], Awaitable[T]]], names: Callable[[int], str | None]
    ) -> list[T]:
        tasks = [asyncio.ensure_future(fn()) for fn in fns]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        failed = [i for i, t in enumerate(tasks) if t in done and t.exception()]
        if failed:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            i = failed[0]
            error = tasks[i].exception()
            raise BranchError(i, names(i), error) from error  # type: ignore[arg-type]
        return [t.result() for t in tasks]

    async def abort_all(self) -> None:
        for rid in list(self._in_flight):
            await self.client.abort(rid)


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

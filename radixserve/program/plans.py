"""Prompt programs' plans: the operations as generators that yield calls
(tokenize, generate) and are sent the answers, so the logic exists once for the
sync and the async runners; the errors and ``Selection`` they produce."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from radixserve.results import Result
from radixserve.sampling_params import SamplingParams

T = TypeVar("T")
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

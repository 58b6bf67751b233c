"""Where a program's calls run: an in-process ``Engine``, a ``Client`` (threads)
or an ``AsyncClient`` (tasks). Each answers a plan's ``_Tokenize`` / ``_Generate``
and runs a fork's branch functions, turning a branch's failure into
``BranchError`` (and aborting the others' requests on a server)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from radixserve.program.plans import (
    MAX_THREADS,
    Answer,
    BranchError,
    Call,
    ProgramError,
    T,
    _Tokenize,
)
from radixserve.results import Result
from radixserve.sampling_params import SamplingParams


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

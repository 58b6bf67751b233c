"""``radixserve bench program``: the prompt programs of docs/programs.md as a workload.

Four programs, each as in docs/programs.md: ``select`` (a HellaSwag-style choice
of an ending), ``tot`` (tree of thought: fork, generate, judge with ``select``,
keep the best), ``sot`` (skeleton of thought: an outline, then every point
expanded in a branch of the same chat) and ``bsm`` (branch-solve-merge: a draft,
one judge per criterion, a rewrite from the verdicts). ``--programs N`` runs N of
each kind chosen, all at once (or Poisson arrivals at ``--rate`` programs/s, at
most ``--max-concurrency`` in flight), as ``AsyncProgramState``s.

A program decides its next request from the answers to its earlier ones, so the
generic runner, which sends a tree of prompts fixed in advance, cannot drive it.
This runner records every request a program sends instead (its exact
``input_ids``, its ``logprob_start_len`` when it scores, the ids that came back)
as the runner's ``RequestRecord``s, in send order, so ``metrics.summarize``
gives the same numbers, the offline optimum included, for what was actually
sent. Program texts depend on what the model generated (``tot`` samples at
temperature 0.8), so two variants need not send the same requests: each one's
optimum is over its own.

Targets: a radixserve server (``AsyncClient``) or, with ``--backend engine``, an
in-process Engine stepped on the event loop (``EngineClient``), so the programs'
requests in flight at once share model steps, as on a server. Requests are not
streamed: there is no TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.benchmark import report
from radixserve.benchmark.backends import Backend, EngineBackend
from radixserve.benchmark.metrics import step_summary, summarize
from radixserve.benchmark.runner import RequestRecord, RunResult, arrival_times
from radixserve.program import AsyncBranches, AsyncClientBackend, AsyncProgramState
from radixserve.results import Result
from radixserve.sampling_params import SamplingParams

PROGRAMS = ("select", "tot", "sot", "bsm")

# ---------------------------------------------------------------- programs
# Each program: ``async def (new, i, gen_len)``; ``new(prompt=..., messages=...)``
# starts a program state, ``i`` picks the program's inputs, ``gen_len(default)`` the
# max_tokens of one gen (``--output-len`` when given, else the example's).
New = Callable[..., AsyncProgramState]
GenLen = Callable[[int], int]

SELECT_QUESTIONS = [
    (
        "A man is sitting on a roof. He",
        [
            " is using wrap to wrap a pair of skis.",
            " is ripping level tiles off.",
            " is holding a rubik's cube.",
            " starts pulling up roofing on a roof.",
        ],
    ),
    (
        "A woman pours water into a glass. She",
        [" drinks the water.", " paints the glass red.", " throws the glass at the moon."],
    ),
    (
        "A boy kicks a ball across the park. The ball",
        [" rolls into a pond.", " sings a song.", " turns into a bird.", " stops by a tree."],
    ),
    (
        "A chef slices an onion on a board. The chef",
        [" starts to cry.", " flies to the moon.", " puts the slices in a pan."],
    ),
]
TOT_QUESTIONS = [
    "A farmer has 17 sheep and buys 24 more. How many sheep are there?",
    "A train leaves at 3 pm and travels for 2 hours. When does it arrive?",
    "Tom has 5 apples and gives away 2. How many does he keep?",
    "A box holds 6 eggs. How many eggs are in 4 boxes?",
]
SOT_TOPICS = ["learning Python", "sleeping well", "saving money", "writing clearly"]
BSM_TASKS = [
    "Write one sentence about the sea.",
    "Write one sentence about a forest.",
    "Write one sentence about the city at night.",
]
BSM_CRITERIA = ["grammar", "imagery", "brevity"]


async def select_program(new: New, i: int, gen_len: GenLen) -> None:
    context, endings = SELECT_QUESTIONS[i % len(SELECT_QUESTIONS)]
    s = new(prompt=context)
    await s.select("ending", endings)


async def tot_program(
    new: New, i: int, gen_len: GenLen, depth: int = 2, width: int = 3, keep: int = 2
) -> None:
    question = TOT_QUESTIONS[i % len(TOT_QUESTIONS)]
    root = new(prompt=f"Question: {question}\nLet's think step by step.\nStep:")
    frontier = [root]
    for _ in range(depth):
        children = AsyncBranches([k for leaf in frontier for k in await leaf.fork(width)])
        await children.gen("step", max_tokens=gen_len(32), temperature=0.8, stop=["\n"])
        for k in children:
            k += "Is this step correct? Answer:"
        await children.select("ok", [" yes", " no"])
        children.sort(key=lambda k: k.results["ok"].scores[0], reverse=True)
        frontier = children[:keep]
        for k in frontier:
            k += "\nStep:"


async def sot_program(new: New, i: int, gen_len: GenLen, points: int = 3) -> None:
    topic = SOT_TOPICS[i % len(SOT_TOPICS)]
    s = new(messages=[{"role": "system", "content": "You are a concise assistant."}])
    await s.user(f"List {points} short tips for {topic}, one per line, no details.")
    await s.assistant_gen("skeleton", max_tokens=gen_len(48), temperature=0)
    # Always ``points`` branches (a small model may list fewer): one program, one shape.
    listed = [p.strip() for p in s["skeleton"].splitlines() if p.strip()][:points]
    tips = listed + [f"tip {k + 1}" for k in range(len(listed), points)]
    branches = await s.fork(points)
    for b, tip in zip(branches, tips):
        await b.user(f"Explain this tip in two sentences: {tip}")

    async def detail(b: AsyncProgramState) -> str:
        return await b.assistant_gen("detail", max_tokens=gen_len(64), temperature=0)

    await branches.run(detail)


async def bsm_program(new: New, i: int, gen_len: GenLen) -> None:
    task = BSM_TASKS[i % len(BSM_TASKS)]
    s = new(messages=[{"role": "user", "content": task}])
    await s.assistant_gen("draft", max_tokens=gen_len(40), temperature=0)
    judges = await s.fork(len(BSM_CRITERIA))
    for judge, criterion in zip(judges, BSM_CRITERIA):
        await judge.user(f"Judge that sentence only for {criterion}, in one line.")

    async def verdict(j: AsyncProgramState) -> str:
        return await j.assistant_gen("verdict", max_tokens=gen_len(32), temperature=0)

    verdicts = await judges.run(verdict)
    reviews = "\n".join(f"- {k}: {v}" for k, v in zip(BSM_CRITERIA, verdicts))
    await s.user(f"Reviews:\n{reviews}\nRewrite the sentence taking them into account.")
    await s.assistant_gen("final", max_tokens=gen_len(40), temperature=0)


BODIES: dict[str, Callable[[New, int, GenLen], Awaitable[None]]] = {
    "select": select_program,
    "tot": tot_program,
    "sot": sot_program,
    "bsm": bsm_program,
}


def kinds(choice: str) -> list[str]:
    return list(PROGRAMS) if choice == "all" else [choice]


# --------------------------------------------------------------- recording
class Recorder:
    """Every request of a run's programs, as the runner's records, in send order."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []
        self._order = itertools.count()
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def open(self, key: str, ids: Sequence[int], sp: SamplingParams) -> RequestRecord:
        rec = RequestRecord(key, next(self._order), list(ids), sp.max_tokens, self.now())
        if sp.prompt_logprobs is not None:
            rec.logprob_start_len = sp.logprob_start_len
        return rec

    def close(self, rec: RequestRecord, result: Result | BaseException) -> None:
        rec.end_time = self.now()
        if isinstance(result, BaseException):
            rec.error = f"{type(result).__name__}: {result}"
        else:
            rec.usage = result.usage
            rec.output_ids = list(result.token_ids)
            rec.output_text = result.text
            rec.finish_reason = result.finish_reason
            if result.finish_reason in ("abort", "error"):
                rec.error = result.error or f"the request ended with {result.finish_reason}"
        self.records.append(rec)


class RecordingBackend(AsyncClientBackend):
    """A program's backend that records each request it sends (keys ``PROGRAM/N``)."""

    def __init__(self, client: Any, recorder: Recorder, key: str, timeout: float) -> None:
        super().__init__(client, None, timeout)
        self.recorder, self.key = recorder, key
        self._sent = itertools.count()

    async def _generate(self, ids: list[int], sp: SamplingParams) -> Result | BaseException:
        rec = self.recorder.open(f"{self.key}/{next(self._sent)}", ids, sp)
        try:
            result = await super()._generate(ids, sp)
        except asyncio.CancelledError as e:  # another branch failed; this one still counts
            self.recorder.close(rec, e)
            raise
        self.recorder.close(rec, result)
        return result


class EngineClient:
    """What a program needs of an ``AsyncClient`` (``tokenize``, ``generate``,
    ``abort``) on an in-process Engine. One driver task steps the scheduler while it
    has work, yielding to the event loop between steps, so every request the
    programs send meanwhile joins the next step. Stop strings and Results are the
    Engine's own (``Engine._add_requests`` / ``_postprocess``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._streams: dict[tuple[str, int], Any] = {}
        self._waiting: dict[tuple[str, int], asyncio.Future[Result]] = {}
        self._rids: dict[str, str] = {}  # the program's request id -> the scheduler's
        self._driver: asyncio.Task[None] | None = None

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
    ) -> list[int]:
        return self.engine.inputs.tokenize(
            prompt, messages, add_special_tokens, add_generation_prompt
        )

    async def generate(
        self,
        *,
        input_ids: list[int],
        sampling_params: SamplingParams,
        cache_salt: str | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
    ) -> Result:
        eng = self.engine
        streams = eng._add_requests(
            [(eng.inputs.to_ids(input_ids=input_ids), [])], [sampling_params], cache_salt
        )
        (key,) = streams  # n == 1 in programs
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._streams.update(streams)
        self._waiting[key] = future
        if request_id is not None:
            self._rids[request_id] = key[0]
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())
        try:
            return await future
        finally:
            if request_id is not None:
                self._rids.pop(request_id, None)
            if not future.done():  # cancelled: end the request too
                self._waiting.pop(key, None)
                self._streams.pop(key, None)
                eng.scheduler.abort_request(key[0])

    async def abort(self, request_id: str) -> None:
        rid = self._rids.get(request_id)
        if rid is not None:
            self.engine.scheduler.abort_request(rid)

    async def _drive(self) -> None:
        eng = self.engine
        await asyncio.sleep(0)  # let every request sent in this instant in first
        try:
            while eng.scheduler.has_work():
                for out in eng.scheduler.step(eng.runner.step):
                    result = eng._postprocess(out, self._streams)
                    if result is None:
                        continue
                    future = self._waiting.pop((out.rid, out.index), None)
                    if future is not None and not future.done():
                        future.set_result(result)
                await asyncio.sleep(0)  # let programs read answers and send more
        except Exception as e:  # fail every request in flight, not the run
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(e)
            self._waiting.clear()
            self._streams.clear()


# ------------------------------------------------------------------ running
@dataclass
class ProgramRun:
    result: RunResult
    programs: int
    failed: list[str]  # "KIND-I: error" per program that raised


async def run_programs(
    client: Any,
    names: Sequence[str],
    per_kind: int,
    *,
    output_len: int | None = None,
    rate: float | None = None,
    max_concurrency: int | None = None,
    seed: int = 0,
    timeout: float = 600.0,
) -> ProgramRun:
    """``per_kind`` programs of each kind in ``names`` on ``client`` (an ``AsyncClient``
    or an ``EngineClient``), interleaved by kind; every request recorded."""
    recorder = Recorder()
    jobs = [(name, i) for i in range(per_kind) for name in names]
    sem = asyncio.Semaphore(max_concurrency or len(jobs))
    failed: list[str] = []

    def gen_len(default: int) -> int:
        return output_len if output_len is not None else default

    async def one(name: str, i: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - recorder.now()))
        key = f"{name}-{i}"

        def new(**start: Any) -> AsyncProgramState:
            return AsyncProgramState(RecordingBackend(client, recorder, key, timeout), **start)

        async with sem:
            try:
                await BODIES[name](new, i, gen_len)
            except Exception as e:  # a failed program is reported, not fatal to the run
                failed.append(f"{key}: {type(e).__name__}: {e}")

    times = arrival_times(len(jobs), rate, seed)
    await asyncio.gather(*(one(name, i, t) for (name, i), t in zip(jobs, times)))
    records = sorted(recorder.records, key=lambda r: r.order)
    return ProgramRun(RunResult(records, recorder.now(), 0), len(jobs), failed)


def program_summary(run: ProgramRun) -> dict[str, Any]:
    d = run.result.duration
    done = run.programs - len(run.failed)
    return {
        "programs": done,
        "programs_failed": len(run.failed),
        "program_errors": run.failed[:5],
        "program_throughput": done / d if d else 0.0,
        "requests_per_program": len(run.result.records) / run.programs if run.programs else 0.0,
    }


async def run_variant(
    args: argparse.Namespace, backend: Backend, client: Any, label: str
) -> dict[str, Any]:
    """One target: warm-up requests, a flushed cache, the programs once."""
    try:
        info = await backend.info()
        warm = SamplingParams(max_tokens=4)
        for _ in range(args.warmup):
            await client.generate(input_ids=await client.tokenize("Warm up."), sampling_params=warm)
        flushed = await backend.reset_cache()
        before = await backend.stats()
        run = await run_programs(
            client,
            kinds(args.program),
            args.programs,
            output_len=args.output_len,
            rate=args.rate,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            timeout=args.timeout,
        )
        after = await backend.stats()
    finally:
        await backend.close()
    metrics = summarize(run.result, info.page_size)
    metrics.update(step_summary(before, after, metrics["requests"]))
    metrics.update(program_summary(run))
    return {
        "label": label,
        "backend": backend.name,
        "model": info.model,
        "page_size": info.page_size,
        "cache_flushed_before_run": flushed,
        "stats_before": before,
        "stats_after": after,
        "metrics": metrics,
        "requests": report.request_rows(run.result.records, texts=True),
    }


# Of the generic workloads' flags, the ones a program run takes.
PROGRAM_FLAGS = {"output-len"}


def check_args(args: argparse.Namespace, workload_flags: Sequence[str]) -> None:
    if args.backend == "openai":
        raise SystemExit(
            "radixserve bench program: programs send token ids and tokenize with the "
            "server's tokenizer: use --backend radixserve (a launched server or "
            "--endpoint) or --backend engine"
        )
    for name in workload_flags:
        if name not in PROGRAM_FLAGS and getattr(args, name.replace("-", "_")) is not None:
            raise SystemExit(f"radixserve bench: --{name} does not apply to program")
    if args.score:
        raise SystemExit("radixserve bench: --score does not apply to program")
    if args.programs < 1:
        raise SystemExit("radixserve bench program: --programs must be >= 1")


def title(args: argparse.Namespace) -> str:
    names = kinds(args.program)
    gens = f", {args.output_len} tokens per gen" if args.output_len is not None else ""
    arrival = f"Poisson {args.rate} programs/s" if args.rate else "all at once"
    conc = f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""
    return (
        f"program: {args.programs * len(names)} programs ({args.programs} each of "
        f"{', '.join(names)}{gens}), {arrival}{conc}"
    )


def main(args: argparse.Namespace, workload_flags: Sequence[str]) -> int:
    """``radixserve bench program``: every variant of ``targets.variants``, then the table,
    the JSON and the PNG, as for the other workloads."""
    from radixserve.benchmark.server import LaunchedServer
    from radixserve.benchmark.targets import make_backend, make_engine, variants

    check_args(args, workload_flags)
    results: list[dict[str, Any]] = []
    for label, launch_args in variants(args):
        if launch_args is None:
            backend = make_backend(args, None)
            results.append(asyncio.run(run_variant(args, backend, backend.client, label)))
            continue
        if args.backend == "engine":
            print(f"radixserve bench: engine {label}: {' '.join(launch_args)}", file=sys.stderr)
            engine = make_engine(launch_args)
            try:
                v = asyncio.run(
                    run_variant(args, EngineBackend(engine), EngineClient(engine), label)
                )
            finally:
                engine.close()
            summary = f"engine {engine.config.model}"
        else:
            print(f"radixserve bench: launching {label}: {' '.join(launch_args)}", file=sys.stderr)
            with LaunchedServer(launch_args) as server:
                backend = make_backend(args, server.endpoint)
                v = asyncio.run(run_variant(args, backend, backend.client, label))
            summary = server.summary
        v["server_args"], v["server_summary"] = launch_args, summary
        results.append(v)

    head = title(args)
    print(report.table(head, results))
    params = {"program": args.program, "programs": args.programs, "output_len": args.output_len}
    report.save(
        args,
        head,
        results,
        "program",
        workload_params=params,
        num_programs=args.programs * len(kinds(args.program)),
    )
    bad = any(v["metrics"]["failed"] or v["metrics"]["programs_failed"] for v in results)
    return 1 if bad else 0

"""Grammar mask benchmark: what constraining every row of a decode batch costs, next
to the decode step itself, through the ModelRunner with the embedded model.

A decode step of ``--batches`` requests (32 by default) starts from a KV cache
holding ``--context`` tokens per request (random values: a step's time does not
depend on them). The same slots take turns, round by round (a shared machine
drifts; both modes see the same one): ``--steps`` greedy steps unconstrained,
then ``--steps`` with every row constrained by one of the json-extract
workload's record schemas (``radixserve.benchmark.workloads.RECORDS``, row i
the i-th mod 4), jump-forward off so that every step feeds one token per row
in both modes. A row whose object is complete starts a fresh one, so every
constrained step masks every row. The first step after a switch, which
registers the slots' parameters, is not timed, nor are ``--steps`` warm-up
steps of each mode. A sampled token a grammar rejects is counted (``rejected``:
0 when the masks are right) and its row restarts.

In the constrained steps the worker's ``GrammarSlots`` is timed from the
outside: ``fill_masks`` (xgrammar fills each row's token bitmask), the apply
(``apply_masks`` less its fill: the logits of disallowed tokens set to -inf)
and ``accept`` (each matcher advanced by its sampled token). The table gives
each in ms per step (the median over rounds of the round's mean) and over the
unconstrained step (the median of the per-round ratios).

    python bench/grammar_mask.py                        # batch 32, context 512
    python bench/grammar_mask.py --batches 1,8,32 --rounds 3 --steps 10   # quicker
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from radixserve.benchmark.workloads import RECORDS
from radixserve.models.tokenizer import load_tokenizer
from radixserve.protocol import GrammarSpec, Step, StepReq
from radixserve.sampling_params import SamplingParams, StructuredOutput
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from radixserve.worker.model_runner import ModelRunner

PLAIN = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
TIMED = ("fill_masks", "apply_masks", "accept")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def constraints() -> list[SamplingParams]:
    """One greedy constrained parameter set per record schema (key order kept)."""
    import json

    return [
        SamplingParams(
            temperature=0,
            max_tokens=1 << 20,
            structured=StructuredOutput.json(json.dumps(schema, separators=(",", ":"))),
        )
        for _, schema in RECORDS
    ]


def compile_grammars(runner: ModelRunner, params: list[SamplingParams]) -> None:
    """Hand the grammars to the worker and step until every one is compiled."""
    specs = {p.structured.key: p.structured for p in params}  # type: ignore[union-attr]
    grammars = [GrammarSpec(k, so.kind, so.spec) for k, so in specs.items()]
    result = runner.step(Step([], grammars=grammars))
    ready = set(result.grammars_ready)
    deadline = time.monotonic() + 300
    while ready < set(specs):
        result = runner.step(Step([]))
        if result.grammar_failures:
            raise RuntimeError(f"a grammar did not compile: {result.grammar_failures}")
        ready |= set(result.grammars_ready)
        if time.monotonic() > deadline:
            raise RuntimeError("the grammars did not compile within 300 s")


class Clock:
    """Wraps methods of one object and adds up the seconds spent in each."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.spent = dict.fromkeys(names, 0.0)
        for name in names:
            setattr(obj, name, self._timed(name, getattr(obj, name)))

    def _timed(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t

        return run

    def take(self) -> dict[str, float]:
        out = dict(self.spent)
        self.spent = dict.fromkeys(self.spent, 0.0)
        return out


class Batch:
    """B decoding slots over random KV; ``step(params)`` runs one decode step of all
    of them with ``params[i]`` for row i, registering a row's parameters when
    they change or when its grammar ended (a fresh matcher)."""

    def __init__(self, runner: ModelRunner, batch: int, context: int, max_steps: int) -> None:
        self.runner, self.batch, self.s = runner, batch, runner.page_size
        per_req = -(-(context + max_steps + 1) // self.s)
        self.tables = [np.arange(i * per_req, (i + 1) * per_req, dtype=np.int32)
                       for i in range(batch)]  # fmt: skip
        self.held = [0] * batch
        self.pos = [context] * batch
        self.toks = np.full(batch, 100, dtype=np.int32)
        self.given: list[SamplingParams | None] = [None] * batch
        self.rejected = 0  # sampled tokens a grammar rejected: 0 when the masks hold

    def step(self, params: list[SamplingParams]) -> float:
        reqs = []
        for i in range(self.batch):
            need = -(-(self.pos[i] + 1) // self.s)
            sp = params[i] if self.given[i] is not params[i] else None
            self.given[i] = params[i]
            reqs.append(StepReq(i, self.toks[i : i + 1], self.pos[i],
                                self.tables[i][self.held[i] : need], True, sp))  # fmt: skip
            self.held[i] = need
        t = time.perf_counter()
        result = self.runner.step(Step(reqs))
        dt = time.perf_counter() - t
        self.toks = result.tokens.copy()
        self.pos = [p + 1 for p in self.pos]
        self.rejected += len(result.failed)
        for slot in [*result.terminated.tolist(), *(f.slot for f in result.failed)]:
            self.given[slot] = None  # its object is complete (or failed): a fresh matcher
        return dt

    def close(self) -> None:
        self.runner.step(Step([], release=np.arange(self.batch, dtype=np.int32)))


def max_steps(rounds: int, steps: int) -> int:
    """Decode steps one batch takes: the warm-up, then per round two untimed and
    ``2 * steps`` timed ones."""
    return 2 * steps + 2 * rounds * (steps + 1)


def measure(
    runner: ModelRunner, clock: Clock, batch: int, context: int, rounds: int, steps: int
) -> dict[str, Any]:
    """Alternate ``steps`` plain and ``steps`` constrained steps for ``rounds`` rounds."""
    rows = [PLAIN] * batch
    cons = constraints()
    constrained = [cons[i % len(cons)] for i in range(batch)]
    b = Batch(runner, batch, context, max_steps(rounds, steps))
    per_round: dict[str, list[float]] = {k: [] for k in ("plain", "constrained", *TIMED)}
    try:
        for _ in range(steps):  # warm-up: first-touch of buffers, matchers' first states
            b.step(rows)
            b.step(constrained)
        b.rejected = 0
        for _ in range(rounds):
            b.step(rows)  # registers the plain parameters: not timed
            per_round["plain"].append(float(np.mean([b.step(rows) for _ in range(steps)])))
            b.step(constrained)
            clock.take()
            times = [b.step(constrained) for _ in range(steps)]
            spent = clock.take()
            per_round["constrained"].append(float(np.mean(times)))
            for k in TIMED:
                per_round[k].append(spent[k] / steps)
    finally:
        b.close()
    fill = np.asarray(per_round["fill_masks"])
    apply = np.asarray(per_round["apply_masks"]) - fill  # apply_masks calls fill_masks
    plain = np.asarray(per_round["plain"])
    cons_t = np.asarray(per_round["constrained"])
    accept = np.asarray(per_round["accept"])
    med = lambda a: float(np.median(a))  # noqa: E731
    return {
        "batch": batch,
        "plain_ms": med(plain) * 1e3,
        "constrained_ms": med(cons_t) * 1e3,
        "fill_ms": med(fill) * 1e3,
        "apply_ms": med(apply) * 1e3,
        "accept_ms": med(accept) * 1e3,
        "mask_over_step": med((fill + apply) / plain),
        "grammar_over_step": med((fill + apply + accept) / plain),
        "constrained_over_plain": med(cons_t / plain),
        "rejected": b.rejected,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")
    ap.add_argument("--cache-dir", default=None, help="converted-model cache dir")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batches", type=ints, default=[32], help="decode batch sizes, e.g. 1,32")
    ap.add_argument("--context", type=int, default=512, help="tokens in KV per request")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (plain, then constrained)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    max_b = max(args.batches)
    per_req = -(-(args.context + max_steps(args.rounds, args.steps) + 1) // args.page_size)
    config = WorkerConfig(model=args.model, dtype=args.dtype, cache_dir=args.cache_dir,
                          page_size=args.page_size, num_pages=max_b * per_req,
                          max_running_requests=max_b, jump_forward=False)  # fmt: skip
    runner = build_runner(config, load_tokenizer(args.model, args.cache_dir))
    for layer in runner.pool.layers:
        layer.normal_()
    compile_grammars(runner, constraints())
    clock = Clock(runner.grammars, TIMED)
    print(f"model {runner.model_name}, dtype {runner.dtype_name}, vocab {runner.vocab_size}, "
          f"context {args.context}, page_size {args.page_size}, torch threads "
          f"{torch.get_num_threads()}, {args.rounds} rounds x {args.steps} steps per mode")  # fmt: skip
    results = [measure(runner, clock, b, args.context, args.rounds, args.steps)
               for b in args.batches]  # fmt: skip

    head = ("batch", "step ms", "constrained ms", "mask fill ms", "mask apply ms",
            "accept ms", "mask / step", "mask+accept / step", "constrained / step",
            "rejected")  # fmt: skip
    print("\n| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in results:
        cells = [f"{r['batch']}", f"{r['plain_ms']:.1f}", f"{r['constrained_ms']:.1f}",
                 f"{r['fill_ms']:.2f}", f"{r['apply_ms']:.2f}", f"{r['accept_ms']:.2f}",
                 f"{r['mask_over_step']:.3f}", f"{r['grammar_over_step']:.3f}",
                 f"{r['constrained_over_plain']:.3f}", f"{r['rejected']}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print(
        "\nstep: an unconstrained decode step of the batch; constrained: the same with every "
        "row masked; mask = fill + apply; ratios: medians of the per-round ratios; "
        "rejected: sampled tokens a grammar refused in the timed steps (0: the masks hold)"
    )


if __name__ == "__main__":
    main()

"""Alternate ``decode_step_tokens`` values on one in-process Engine.

    python bench/prefill_budget.py 0,256,512,1024 3 out.json -- shared-prefix \\
        --groups 4 --prompts 8 --system-len 512 --question-len 64 --output-len 64 \\
        --no-plot --no-progress --warmup 2 --server-args "--threads 1" --cpu-clock

Everything after ``--`` is ``radixserve bench``'s arguments (``--backend engine``
implied). Each round runs the workload once per value from a flushed cache, in
alternating order, on the same Engine (only the scheduler's config changes), and
prints one JSON line per run; the rows go to OUT. ``--cpu-clock`` (after ``--``,
taken out before bench parses) times the runs with this process's CPU time instead
of the wall clock: with one worker thread, the work done, not the time other
processes on a shared machine took from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import types
from dataclasses import replace

import numpy as np

import radixserve.benchmark.runner as runner
from radixserve.benchmark.backends import EngineBackend
from radixserve.benchmark.cli import add_arguments, build_workload, run_variant
from radixserve.benchmark.targets import make_engine
from radixserve.benchmark.workloads import from_tokenizer
from radixserve.models.tokenizer import load_tokenizer

KEYS = ("duration_s", "output_tok_s", "ttft_median_ms", "ttft_p99_ms", "itl_mean_ms",
        "itl_p99_ms", "itl_max_ms")  # fmt: skip


def main(argv: list[str]) -> None:
    sep = argv.index("--")
    values = [int(v) for v in argv[0].split(",")]
    rounds, out_path = int(argv[1]), argv[2]
    bench_argv = argv[sep + 1 :]
    if "--cpu-clock" in bench_argv:
        bench_argv.remove("--cpu-clock")
        runner.time = types.SimpleNamespace(perf_counter=time.process_time)  # type: ignore[assignment]
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(bench_argv)
    tok = load_tokenizer(args.tokenizer or args.model)
    workload = build_workload(args, from_tokenizer(tok, args.prompt_kind, args.seed))
    engine = make_engine(["--model", args.model, *args.server_args.split()])
    base = engine.scheduler.config
    rows = []
    try:
        for r in range(rounds):
            for v in values if r % 2 == 0 else values[::-1]:
                engine.scheduler.config = replace(base, decode_step_tokens=v)
                load = os.getloadavg()[0]
                [res] = asyncio.run(run_variant(args, workload, EngineBackend(engine), str(v), tok))
                m = res["metrics"]
                itl = [b - a for rec in res["_records"] if rec.ok
                       for a, b in zip(rec.chunk_times, rec.chunk_times[1:])]  # fmt: skip
                m["itl_max_ms"] = float(np.max(itl)) * 1e3
                row = {"round": r, "decode_step_tokens": v, "load": load}
                row |= {k: m[k] for k in KEYS}
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(out_path, "w") as f:
                    json.dump(rows, f)
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1:])

"""Time to first token of a long system prompt after a restart: from the disk tier
(docs/cache-tiers.md) against recomputing it.

    python bench/tier_restart.py                       # SmolLM2, 4096-token system prompt
    python bench/tier_restart.py --system-len 2048 --trials 3

1. An Engine with a disk tier answers system prompt + question 0 (cold: computed,
   and written through to the directory); it is closed.
2. Per trial, a new Engine on the same directory (a restart) answers system prompt +
   question i: the prompt's whole pages come from disk.
3. An Engine without tiers answers the same prompts (recomputed).
TTFT is the time of a one-token generation (Engine start-up and warm-up excluded).
Every Engine runs ``--threads`` step threads (default 1: on a shared 2-core
machine two OpenMP threads stall whenever one is descheduled).
The first tokens must agree; the table prints each variant's TTFT and its ratio to
recomputing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from radixserve import Engine, SamplingParams


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int, list[int], int]:
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    [r] = engine.generate([prompt], sp)
    return (
        time.perf_counter() - t0,
        r.usage.cached_tokens,
        r.usage.cached_tokens_by_tier,
        r.token_ids[0],
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--system-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--host-cache-gb", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of every Engine (0: the default, which with a disk tier on "
        "the CPU leaves a core to the copy thread, so the variants would differ)",
    )
    args = p.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    system = rng.integers(100, 40000, args.system_len).tolist()
    questions = [
        rng.integers(100, 40000, args.question_len).tolist() for _ in range(args.trials + 1)
    ]
    base = dict(dtype=args.dtype, page_size=args.page_size, threads=args.threads)
    disk = tempfile.mkdtemp(prefix="rs-tier-bench-")
    tiers = dict(base, host_cache_gb=args.host_cache_gb, disk_cache_dir=disk)
    rows = []
    try:
        eng = Engine(args.model, **tiers)
        t, cached, _, first = ttft(eng, system + questions[0])
        eng.close()
        rows.append(("cold, written through", t, cached, "-"))
        from_disk, answers = [], []
        for q in questions[1:]:
            eng = Engine(args.model, **tiers)
            t, cached, by_tier, token = ttft(eng, system + q)
            eng.close()
            from_disk.append(t)
            answers.append(token)
            rows.append(("restart, from disk", t, cached, str(by_tier)))
        eng = Engine(args.model, **base)
        recompute = []
        for q, token in zip(questions[1:], answers):
            eng.flush_cache()
            t, cached, _, want = ttft(eng, system + q)
            recompute.append(t)
            rows.append(("no tiers, recomputed", t, cached, "-"))
            if want != token:
                print(f"first token differs: {token} from disk, {want} recomputed", file=sys.stderr)
                return 1
        eng.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    ref = statistics.median(recompute)
    print(
        f"system prompt {args.system_len} tokens + question {args.question_len}, "
        f"page size {args.page_size}, model {args.model} ({args.dtype}), "
        f"{args.threads} thread(s)"
    )
    print(
        f"{'variant':<24} {'TTFT s':>8} {'cached':>7} {'by tier [pool,host,disk]':>26} {'/ recompute':>12}"
    )
    for name, t, cached, tiers_s in rows:
        print(f"{name:<24} {t:>8.3f} {cached:>7} {tiers_s:>26} {t / ref:>11.3f}x")
    print(
        f"median from disk {statistics.median(from_disk):.3f} s, recomputed {ref:.3f} s: "
        f"{statistics.median(from_disk) / ref:.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

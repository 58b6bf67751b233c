"""Does a load from the disk tier delay the requests that are not waiting for it?
Synchronous copies (done in the step) against the copy thread, in one run.

    python bench/tier_overlap.py                       # SmolLM2, 4096-token system prompt
    python bench/tier_overlap.py --system-len 2048 --trials 3

Default ``--threads 1``: on a 2-core machine shared with other jobs, two OpenMP
threads per step wait for each other when one is descheduled (steps 30x slower);
one step thread leaves the other core to the copy thread.

1. An Engine with a disk tier computes the system prompt (written through) and closes.
2. Per trial and mode (``sync``, ``async``, alternating), a new Engine on a copy of
   that directory (a restart; every trial finds the same files) starts a batch of ``--batch`` short requests with long
   outputs; once they decode, a request of system prompt + question arrives: its
   system prompt's pages load from disk (LOADING) while the batch goes on.
   ``sync`` replaces the worker's host cache by one without the copy thread (the
   copies of a step are done in that step, as before tickets), ``async`` is the
   default.
3. Measured, per step, in the *load window* (from the long request's arrival to the
   step that computes its prefill, excluded): the wall time of each step, i.e. the
   time between two tokens of the running batch (ITL). Also the step with the long
   prefill (the same work in both modes), the long request's TTFT (arrival to first
   token) and the batch's mean ITL before the arrival (its usual pace). The longest
   window step is split: the part outside the worker's ``step`` is the scheduler's
   (its admission reads and checks every page file it will load).

The batch's tokens and the long request's first token must be the same in both
modes. The table prints medians over the trials and the ratio async / sync.
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
from radixserve.scheduler.request import ReqStatus
from radixserve.worker.host_cache import HostCache


def synchronous(engine: Engine) -> None:
    """Give the worker a host cache without the copy thread (same slots, empty)."""
    old = engine.runner.host_cache
    old.close()
    engine.runner.host_cache = HostCache(
        old.pool, old.num_slots, old.disk_dir, engine.runner.kv_identity, asynchronous=False
    )


def trial(args, tiers: dict, mode: str, system: list[int], rng) -> dict:
    # Every trial restarts from the cold run's files alone (a trial writes its own
    # question's pages through, which would change the next trial's hit).
    run_dir = tempfile.mkdtemp(prefix="rs-tier-overlap-run-")
    shutil.rmtree(run_dir)
    shutil.copytree(tiers["disk_cache_dir"], run_dir)
    eng = Engine(args.model, **{**tiers, "disk_cache_dir": run_dir})
    if mode == "sync":
        synchronous(eng)
    sched, runner = eng.scheduler, eng.runner
    batch_sp = SamplingParams(max_tokens=args.batch_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        sched.add_request(f"b{i}", rng.integers(100, 40000, 32).tolist(), batch_sp)
    question = system + rng.integers(100, 40000, args.question_len).tolist()
    tokens: dict[str, list[int]] = {}
    steps: list[tuple[float, str]] = []  # (seconds, phase)
    plans: list[float] = []  # seconds of each step outside the worker (the scheduler)
    phase, arrived, ttft = "before", 0.0, None
    while sched.has_work():
        if phase == "before" and len(tokens.get("b0", [])) >= args.warm_steps:
            sched.add_request("long", question, SamplingParams(max_tokens=1, temperature=0.0))
            phase, arrived = "window", time.perf_counter()
        worker = [0.0]

        def run(step, worker=worker):
            w0 = time.perf_counter()
            result = runner.step(step)
            worker[0] = time.perf_counter() - w0
            return result

        t0 = time.perf_counter()
        outs = sched.step(run)
        t1 = time.perf_counter()
        steps.append((t1 - t0, phase))
        plans.append(t1 - t0 - worker[0])
        for out in outs:
            tokens.setdefault(out.rid, []).extend(out.token_ids)
            if out.rid == "long" and ttft is None:
                ttft = t1 - arrived
                cached = out.cached_tokens_by_tier
        if phase == "window":
            req = sched._requests.get("long")
            if req is None or req[0].status not in (ReqStatus.WAITING, ReqStatus.LOADING):
                steps[-1] = (t1 - t0, "prefill")  # this step computed its prefill
                phase = "after"
    eng.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    window = [t for t, p in steps if p == "window"]
    longest = max(i for i, (t, p) in enumerate(steps) if p == "window" and t == max(window))
    usual = [t for t, p in steps if p == "before"][1:]  # the first is the batch's prefill
    return {
        "window_steps": len(window),
        "window_s": sum(window),
        "window_max_itl": max(window),
        "window_max_plan": plans[longest],
        "prefill_s": next(t for t, p in steps if p == "prefill"),
        "usual_itl": statistics.mean(usual),
        "ttft": ttft,
        "cached": cached,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--system-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=48)
    p.add_argument("--warm-steps", type=int, default=4, help="batch tokens before the arrival")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--host-cache-gb", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the step (0: torch's default); the copy thread is one more",
    )
    args = p.parse_args(argv)

    system = np.random.default_rng(args.seed).integers(100, 40000, args.system_len).tolist()
    disk = tempfile.mkdtemp(prefix="rs-tier-overlap-")
    tiers = dict(
        dtype=args.dtype,
        page_size=args.page_size,
        host_cache_gb=args.host_cache_gb,
        disk_cache_dir=disk,
        threads=args.threads,
    )
    results: dict[str, list[dict]] = {"sync": [], "async": []}
    try:
        eng = Engine(args.model, **tiers)
        eng.generate([system + [100]], SamplingParams(max_tokens=1, temperature=0.0))
        eng.close()
        for i in range(args.trials):
            for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
                rng = np.random.default_rng(args.seed + 1 + i)  # same prompts in both modes
                results[mode].append(trial(args, tiers, mode, system, rng))
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    for i in range(args.trials):
        a, s = results["async"][i], results["sync"][i]
        if a["tokens"] != s["tokens"]:
            differ = sorted(k for k in a["tokens"] if a["tokens"][k] != s["tokens"].get(k))
            print(f"trial {i}: tokens differ between sync and async: {differ}", file=sys.stderr)
            return 1
        if a["cached"][2] < args.system_len - args.system_len % args.page_size:
            print(f"trial {i}: the system prompt did not come from disk: {a['cached']}")
            return 1
    print(
        f"batch of {args.batch} decoding; a {args.system_len}-token system prompt + "
        f"{args.question_len}-token question arrives and loads from disk; model {args.model} "
        f"({args.dtype}), page size {args.page_size}, {args.threads} step thread(s), "
        f"{args.trials} trials (medians)"
    )
    print(f"{'metric':<44} {'sync':>9} {'async':>9} {'async/sync':>11}")
    rows = [
        ("batch ITL, usual (ms, mean)", "usual_itl", 1000),
        ("load window: longest batch ITL (ms)", "window_max_itl", 1000),
        ("  of which the scheduler (ms)", "window_max_plan", 1000),
        ("load window: duration (ms)", "window_s", 1000),
        ("load window: batch steps", "window_steps", 1),
        ("step with the long prefill (ms)", "prefill_s", 1000),
        ("long request TTFT (ms)", "ttft", 1000),
    ]
    for name, key, scale in rows:
        s = statistics.median(r[key] for r in results["sync"]) * scale
        a = statistics.median(r[key] for r in results["async"]) * scale
        print(f"{name:<44} {s:>9.1f} {a:>9.1f} {a / s if s else float('nan'):>10.2f}x")
    print("per trial (sync | async): longest ITL in the window, ms:")
    for i in range(args.trials):
        s, a = results["sync"][i], results["async"][i]
        print(f"  trial {i}: {s['window_max_itl'] * 1000:.1f} | {a['window_max_itl'] * 1000:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scheduler CPU time per step, with a worker stand-in that answers instantly.

    python bench/scheduler.py                 # 256 running requests, page size 1
    python bench/scheduler.py --page-size 16 --running 512
    python bench/scheduler.py --check-kv      # use the KV-simulating worker (slower)

The stand-in returns a token per sampling request without computing anything,
so the table shows the scheduler's own cost: planning the step (decode pages,
admission, building the worker's message) and taking its result back
(finish checks, cache-early inserts). Requests share a few system prompts so
the radix tree is exercised. Compare cache radix and none in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.sampling_params import SamplingParams  # noqa: E402
from radixserve.scheduler.config import SchedulerConfig  # noqa: E402
from radixserve.scheduler.scheduler import Scheduler  # noqa: E402
from radixserve.scheduler.sim_worker import SimWorker  # noqa: E402


class InstantWorker:
    """Answers every sampling request with a fixed token (never EOS)."""

    def step(self, batch) -> np.ndarray:
        return np.full(sum(r.sample for r in batch.reqs), 7, dtype=np.int32)


def run(args, cache: str) -> dict:
    ps = args.page_size
    per_req = args.prompt_len + args.output_len
    num_pages = 2 * args.running * -(-per_req // ps)
    cfg = SchedulerConfig(
        num_pages=num_pages,
        page_size=ps,
        max_context_len=per_req + 1,
        eos_token_ids=(2,),
        cache=cache,
        max_running_requests=args.running,
        chunked_prefill_size=args.chunk,
        radix_impl=args.radix_impl,
    )
    sched = Scheduler(cfg)
    worker = SimWorker(num_pages, ps, args.running) if args.check_kv else InstantWorker()
    rng = np.random.default_rng(0)
    systems = [rng.integers(3, 32000, args.prompt_len - 64) for _ in range(8)]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i in range(args.running):
        prompt = np.concatenate([systems[i % 8], rng.integers(3, 32000, 64)])
        sched.add_request(f"r{i}", prompt, sp)
    step_times, decode_times = [], []
    in_worker = [0.0]  # seconds spent in the worker during the current step

    def timed_step(batch):
        t = time.perf_counter()
        tokens = worker.step(batch)
        in_worker[0] += time.perf_counter() - t
        return tokens

    while sched.has_work():
        in_worker[0] = 0.0
        t0 = time.perf_counter()
        sched.step(timed_step)
        dt = time.perf_counter() - t0 - in_worker[0]
        step_times.append(dt)
        if not sched.waiting and sched.chunked is None and len(sched.running) == args.running:
            decode_times.append(dt)
    sched.check_idle()
    return {
        "cache": cache,
        "steps": len(step_times),
        "decode_steps": len(decode_times),
        "decode_median_ms": 1e3 * statistics.median(decode_times) if decode_times else float("nan"),
        "decode_p99_ms": 1e3 * float(np.percentile(decode_times, 99))
        if decode_times
        else float("nan"),
        "all_median_ms": 1e3 * statistics.median(step_times),
        "total_s": sum(step_times),
        "hit_rate": sched.hit_tokens / max(sched.query_tokens, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--running", type=int, default=256, help="requests running at once")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--chunk", type=int, default=8192, help="chunked_prefill_size")
    p.add_argument("--radix-impl", default="auto")
    p.add_argument("--check-kv", action="store_true", help="use the KV-simulating worker")
    args = p.parse_args(argv)
    rows = [run(args, cache) for cache in ("radix", "none")]
    print(
        f"scheduler: {args.running} requests, prompt {args.prompt_len}, output "
        f"{args.output_len}, page size {args.page_size} (scheduler time only)"
    )
    cols = [
        "cache",
        "steps",
        "decode_median_ms",
        "decode_p99_ms",
        "all_median_ms",
        "total_s",
        "hit_rate",
    ]
    print("  " + "  ".join(f"{c:>16}" for c in cols))
    for r in rows:
        cells = [f"{r[c]:>16.4f}" if isinstance(r[c], float) else f"{r[c]:>16}" for c in cols]
        print("  " + "  ".join(cells))
    a, b = rows
    print(
        f"  radix/none decode step time ratio: {a['decode_median_ms'] / b['decode_median_ms']:.2f}"
    )


if __name__ == "__main__":
    main()

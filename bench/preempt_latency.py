"""An urgent request behind a full server, under the default and the priority policy.

For each policy, launches ``radixserve launch --max-running-requests 4`` (default: the
embedded SmolLM2) and times one request of ``--urgent-tokens`` tokens at priority -1
(its first token, TTFT, and its end) in two cases, ``--rounds`` times each:

- ``full``: ``--flood`` requests of ``--flood-tokens`` tokens at priority 5 are streamed
  at once; the urgent request is sent when ``--max-running`` of them stream tokens
  (every slot is taken, the rest wait);
- ``mid-prefill``: two such requests stream, then one with a prompt of about
  ``--long-prompt`` tokens (prefilled in chunks while they decode) is admitted; the
  urgent request is sent during its prefill, with slots free.

The same urgent request sent to the idle server afterwards is its own work alone.
Prompts are distinct (no prefix hits beyond the chat template). Prints the medians
per case and policy, and the priority policy's ratios to the default's.

First, where the time goes, in steps (no model: the scheduler with its simulated
worker, the same shapes, default flags): for each case and policy, the steps from
the urgent request's arrival to its first token and to its end, and the prompt
tokens of worse requests computed in the steps up to its first token.

    PYTHONPATH=. python bench/preempt_latency.py [--rounds 3] [--cases full,mid-prefill] \
        [-- launch flags]
    PYTHONPATH=. python bench/preempt_latency.py --steps-only

(``PYTHONPATH=.``: the checkout's scheduler, not an installed one.)
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import time

from radixserve.client.aio import AsyncClient

FLOOD_PRIORITY = 5
URGENT_PRIORITY = -1


async def stream(c: AsyncClient, prompt: str, max_tokens: int, priority: int, started=None):
    """(TTFT, total) in seconds of one streamed request; ``started`` is set at its
    first token."""
    start = time.perf_counter()
    first = None
    async for chunk in c.generate_stream(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        priority=priority,
    ):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
            if started is not None:
                started.set()
    return first, time.perf_counter() - start


def story(r: int, i: int) -> str:
    return f"Round {r}, story {i}: tell a long tale about dragon number {(r * 97 + i) % 1000}."


async def round_(c: AsyncClient, case: str, r: int, args) -> tuple[float, ...]:
    """One round: the urgent request's (TTFT, total) behind the load, then alone."""
    n = args.flood if case == "full" else 2
    started = [asyncio.Event() for _ in range(n)]
    load = [
        asyncio.create_task(stream(c, story(r, i), args.flood_tokens, FLOOD_PRIORITY, started[i]))
        for i in range(n)
    ]
    # Full: as many flood requests stream as the server runs at once.
    while sum(e.is_set() for e in started) < min(n, args.max_running):
        await asyncio.sleep(0.005)
    if case == "mid-prefill":
        words = " ".join(f"w{(r * 131 + k) % 9973}" for k in range(args.long_prompt // 3))
        load.append(asyncio.create_task(stream(c, words, 4, FLOOD_PRIORITY)))
        while (await c.stats())["running"] < n + 1:  # admitted: its chunks have begun
            await asyncio.sleep(0.005)
        await asyncio.sleep(args.long_delay)
    urgent = f"Round {r}: what is {r} plus {r * 3}?"
    behind = await stream(c, urgent, args.urgent_tokens, URGENT_PRIORITY)
    await asyncio.gather(*load)
    alone = await stream(c, urgent + " Again.", args.urgent_tokens, URGENT_PRIORITY)
    return (*behind, *alone)


def steps(case: str, policy: str, args) -> tuple[int, int, int]:
    """(steps to the first token, steps to the end, worse prompt tokens computed
    before the first token) of the urgent request, on the simulated worker."""
    import numpy as np

    from radixserve.sampling_params import SamplingParams
    from radixserve.scheduler.config import SchedulerConfig
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.scheduler.sim_worker import SimWorker

    cfg = SchedulerConfig(num_pages=8192, page_size=16, schedule_policy=policy,
                          max_running_requests=args.max_running, max_context_len=8192)  # fmt: skip
    sched = Scheduler(cfg)
    worker = SimWorker(cfg.num_pages, cfg.page_size, cfg.max_running_requests)
    rng = np.random.default_rng(0)
    computed: list[tuple[str, int, int]] = []

    def run(step):
        computed[:] = [(r.rid, r.sampling.priority, n) for r, n in sched._batch]
        return worker.step(step)

    def params(n: int, level: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, priority=level)

    def step() -> list:
        return sched.step(run)

    n = args.flood if case == "full" else 2
    for i in range(n):
        sched.add_request(f"f{i}", rng.integers(3, 500, 50), params(args.flood_tokens, 5))
    for _ in range(3):
        step()
    if case == "mid-prefill":
        sched.add_request("long", rng.integers(3, 500, args.long_prompt), params(4, 5))
        step()
    sched.add_request("urgent", rng.integers(3, 500, 50), params(args.urgent_tokens, -1))
    first = worse = 0
    for k in range(1, 100_000):
        outs = step()
        if not first:
            worse += sum(t for rid, level, t in computed if level > -1 and t > 1)
        if any(o.rid == "urgent" and o.token_ids for o in outs) and not first:
            first = k
        if any(o.rid == "urgent" and o.finish_reason for o in outs):
            return first, k, worse
    raise RuntimeError("the urgent request did not finish")


def launch(flags: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    endpoint = None
    for line in proc.stdout:  # type: ignore[union-attr]
        if m := re.search(r"serving on (\S+)", line):
            endpoint = m.group(1)
        if "processes" in line:
            break
    if endpoint is None:
        proc.kill()
        raise SystemExit("the server did not start")
    return proc, endpoint


async def measure(endpoint: str, cases: list[str], args) -> dict[str, list[tuple[float, ...]]]:
    c = AsyncClient(endpoint, timeout=900)
    try:
        out = {}
        for case in cases:
            await round_(c, case, 1000, args)  # warm-up: every batch shape once
            out[case] = [await round_(c, case, r, args) for r in range(args.rounds)]
        return out
    finally:
        c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="full,mid-prefill")
    ap.add_argument("--flood", type=int, default=12)
    ap.add_argument("--flood-tokens", type=int, default=96)
    ap.add_argument("--urgent-tokens", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=4000)
    ap.add_argument("--long-delay", type=float, default=0.2, help="s after its admission")
    ap.add_argument("--max-running", type=int, default=4)
    ap.add_argument("--policies", default="lpm,priority", help="default first")
    ap.add_argument("--steps-only", action="store_true", help="the step counts only")
    ap.add_argument("launch", nargs="*", help="extra `radixserve launch` flags (after --)")
    args = ap.parse_args()
    cases = args.cases.split(",")
    head = ["to first token", "to its end", "worse prompt tokens first"]
    print(f"{'urgent request, in steps':<28}" + "".join(f"{h:>27}" for h in head))
    for case in cases:
        for policy in args.policies.split(","):
            counts = steps(case, policy, args)
            print(f"{case + ', ' + policy:<28}" + "".join(f"{v:>27}" for v in counts))
    if args.steps_only:
        return
    results: dict[tuple[str, str], list[float]] = {}
    for policy in args.policies.split(","):
        flags = ["--schedule-policy", policy, "--max-running-requests", str(args.max_running)]
        proc, endpoint = launch(flags + args.launch)
        try:
            rows = asyncio.run(measure(endpoint, cases, args))
        finally:
            proc.terminate()
            proc.wait(60)
        for case in cases:
            each = ", ".join(f"{row[1] * 1e3:.0f}" for row in rows[case])
            print(f"{case}, {policy}: urgent total per round ms: {each}", flush=True)
            results[case, policy] = [
                statistics.median(row[k] for row in rows[case]) * 1e3 for k in range(4)
            ]
    policies = args.policies.split(",")
    head = ["urgent TTFT ms", "urgent total ms", "alone TTFT ms", "alone total ms"]
    print(f"{'medians, ' + str(args.rounds) + ' rounds':<28}" + "".join(f"{h:>16}" for h in head))
    for case in cases:
        for policy in policies:
            row = results[case, policy]
            print(f"{case + ', ' + policy:<28}" + "".join(f"{v:>16.0f}" for v in row))
        base = results[case, policies[0]]
        for policy in policies[1:]:
            ratios = [v / b for v, b in zip(results[case, policy], base)]
            label = f"{case}, {policy} / {policies[0]}"
            print(f"{label:<28}" + "".join(f"{v:>15.2f}x" for v in ratios))


if __name__ == "__main__":
    main()

"""A lone request after an idle server against the same request in steady state.

Launches ``radixserve launch`` (default: the embedded SmolLM2, default flags) and
streams one request at a time through the client library: first ``--steady``
requests back to back (the steady state), then ``--lone`` requests each after
``--idle`` seconds of silence. Prompts are distinct (no prefix hits beyond the
chat template), so every request prefills the same amount. Prints TTFT, mean
inter-token latency and total time (medians) of both, and their ratios.

    python bench/idle_latency.py [--idle 5] [--steady 8] [--lone 4] [-- launch flags]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

from radixserve.client import Client


def one(c: Client, i: int, max_tokens: int) -> tuple[float, float, float]:
    prompt = f"Request {i}: write three sentences about the number {i * 7919 % 1000}."
    start = time.perf_counter()
    times = []
    for chunk in c.generate_stream(
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
    ):
        if chunk.token_ids:
            times.extend([time.perf_counter()] * len(chunk.token_ids))
    total = time.perf_counter() - start
    ttft = times[0] - start
    itl = (times[-1] - times[0]) / max(len(times) - 1, 1)
    return ttft, itl, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle", type=float, default=5.0)
    ap.add_argument("--steady", type=int, default=8)
    ap.add_argument("--lone", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("launch", nargs="*", help="extra `radixserve launch` flags (after --)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--port", "0", *args.launch]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    endpoint = None
    for line in proc.stdout:  # type: ignore[union-attr]
        if m := re.search(r"serving on (\S+)", line):
            endpoint = m.group(1)
        if "processes" in line:
            break
    assert endpoint, "the server did not start"
    try:
        with Client(endpoint, timeout=300) as c:
            for i in range(3):
                one(c, 10_000 + i, args.max_tokens)  # warm-up
            steady = [one(c, i, args.max_tokens) for i in range(args.steady)]
            lone = []
            for i in range(args.lone):
                time.sleep(args.idle)
                lone.append(one(c, 1000 + i, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{'':<22}{'TTFT ms':>10}{'ITL ms':>10}{'total ms':>10}")
    med = [
        [statistics.median(r[k] for r in rows) * 1e3 for k in range(3)] for rows in (steady, lone)
    ]
    print(f"{'steady state':<22}" + "".join(f"{v:>10.1f}" for v in med[0]))
    print(f"{f'after {args.idle:g} s idle':<22}" + "".join(f"{v:>10.1f}" for v in med[1]))
    print(f"{'ratio':<22}" + "".join(f"{b / a:>10.2f}" for a, b in zip(*med)))


if __name__ == "__main__":
    main()

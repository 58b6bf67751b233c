"""What polling the dashboard hard costs a running bench.

One server (``--dashboard --http-port 0``) runs a shared-system-prompt workload again
and again, interleaved trial by trial: alone, and while a poller process asks for
``/dashboard/data`` at ``--polls-per-s`` (1000 by default; keep-alive connections,
one thread each) and for ``/dashboard`` once a second, as a page left open by many
users would. Prints, per mode, the best and the median output throughput over the
trials, the polls answered per second, and the CPU seconds each server process took
per run (``/proc/PID/stat``: what a loaded machine disturbs far less than wall time),
and the ratios of the polled runs' medians to the quiet ones'.

    python bench/dashboard_polling.py [--model smollm2] [--trials 3] [--polls-per-s 1000]

The figures are built in the scheduler at most once a second and the HTTP front keeps
their encoded bytes for a second (``http/dashboard.py``), so a poll costs the front one
cached response and the scheduler nothing; what remains is the CPU the poller and the
front's event loop take, which a machine with fewer cores than the server's processes
plus the poller feels as a slower bench.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.benchmark.backends import RadixserveBackend  # noqa: E402
from radixserve.benchmark.metrics import summarize  # noqa: E402
from radixserve.benchmark.runner import run  # noqa: E402
from radixserve.benchmark.server import LaunchedServer  # noqa: E402
from radixserve.benchmark.workloads import TokenSource, shared_prefix  # noqa: E402


def poll(url: str, per_s: float, threads: int, stop, counts) -> None:
    """``threads`` keep-alive connections asking for the figures at ``per_s`` in all,
    and one asking for the page once a second; ``counts[0]`` polls answered 200."""
    target = urlparse(url)

    def worker(path: str, interval: float, slot: int) -> None:
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
        due = time.monotonic()
        while not stop.is_set():
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                with counts.get_lock():
                    counts[slot] += 1
            due += interval
            time.sleep(max(0.0, due - time.monotonic()))

    pool = [
        threading.Thread(target=worker, args=("/dashboard/data", threads / per_s, 0))
        for _ in range(threads)
    ]
    pool.append(threading.Thread(target=worker, args=("/dashboard", 1.0, 1)))
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds each process has used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


async def one_run(endpoint: str, workload, page_size: int) -> dict:
    backend = RadixserveBackend(endpoint, timeout=600)
    try:
        await backend.reset_cache()
        result = await run(workload, backend, progress=False)
    finally:
        await backend.close()
    return summarize(result, page_size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--polls-per-s", type=float, default=1000.0)
    p.add_argument("--poll-threads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    args = p.parse_args()

    server_args = ["--model", args.model, "--dashboard", "--http-port", "0"]
    server_args += ["--page-size", str(args.page_size)]
    src = TokenSource.random(32000, 0, exclude=range(0, 4))
    with LaunchedServer(server_args) as server:
        print(f"server: {server.summary}", file=sys.stderr)
        rows: dict[str, list[dict]] = {"quiet": [], "polled": []}
        for trial in range(args.trials):
            for mode in ("quiet", "polled"):
                workload = shared_prefix(
                    src, args.groups, args.prompts, args.system_len, args.question_len,
                    args.output_len,
                )  # fmt: skip
                stop, counts = mp.Event(), mp.Array("q", 2)
                poller = None
                if mode == "polled":
                    poller = mp.Process(
                        target=poll,
                        args=(server.http_url, args.polls_per_s, args.poll_threads, stop, counts),
                    )
                    poller.start()
                    time.sleep(1.0)  # polling at full rate before the run starts
                    base = counts[0]
                start, cpu0 = time.monotonic(), cpu_seconds(server.pids)
                m = asyncio.run(one_run(server.endpoint, workload, args.page_size))
                wall = time.monotonic() - start
                cpu = {k: v - cpu0[k] for k, v in cpu_seconds(server.pids).items()}
                polls = (counts[0] - base) / wall if poller is not None else 0.0
                if poller is not None:
                    stop.set()
                    poller.join()
                rows[mode].append(
                    {"tok_s": m["output_tok_s"], "polls_s": polls, "failed": m["failed"], **cpu}
                )
                print(
                    f"trial {trial} {mode:6s}: {m['output_tok_s']:8.1f} output tok/s, "
                    f"{polls:7.0f} polls/s, hit rate {m['hit_rate']:.2f}, CPU s "
                    + " ".join(f"{k}={v:.2f}" for k, v in cpu.items()),
                    file=sys.stderr,
                )
        names = list(server.pids)
    keys = ["tok_s", "polls_s", *names]
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in keys} for mode, rs in rows.items()
    }
    head = f"{'mode':8s} {'best tok/s':>11s} {'median tok/s':>13s} {'polls/s':>9s}"
    print("\n" + head + "".join(f" {k + ' CPU s':>15s}" for k in names))
    for mode, rs in rows.items():
        best = max(r["tok_s"] for r in rs)
        m = med[mode]
        line = f"{mode:8s} {best:11.1f} {m['tok_s']:13.1f} {m['polls_s']:9.0f}"
        print(line + "".join(f" {m[k]:15.2f}" for k in names))
    print("\npolled / quiet, medians:")
    for k in ["tok_s", *names]:
        what = "output tok/s" if k == "tok_s" else f"{k} CPU s"
        print(f"  {what:18s} {med['polled'][k] / max(med['quiet'][k], 1e-9):.3f}")
    if any(r["failed"] for rs in rows.values() for r in rs):
        print("some requests failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

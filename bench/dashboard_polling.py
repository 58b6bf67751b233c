"""What polling the dashboard hard costs a running bench.

One server (``--dashboard --http-port 0``) runs a shared-system-prompt workload again
and again, interleaved trial by trial: alone, and while a poller process asks for
``/dashboard/data`` at ``--polls-per-s`` (1000 by default) and for ``/dashboard`` once
a second, as a page left open by many users would. The poller is one asyncio loop
over raw keep-alive HTTP/1.1 connections (``--poll-connections``, one request in
flight on each), paced to the target rate in all; it reports the rate it reached and
the CPU it took itself. Its connections are many (64) because a front that shares its
cores with the model answers late, not slowly: with 8, the rate stopped at 170 a
second, each poll waiting about 50 ms for the front's turn on a core.

Prints, per mode, the best and the median output throughput over the trials, the
polls answered per second, and the CPU seconds each server process (and the poller)
took per run (``/proc/PID/stat``: what a loaded machine disturbs far less than wall
time); then the polled runs' medians over the quiet ones', the HTTP front's CPU per
poll (its CPU beyond a quiet run's, over the polls answered), and whether the polled
median throughput lies within the quiet trials' range (their spread is the noise).

With ``--pin`` the server runs on the last core (its worker with one torch thread)
and the poller and this script's own client on the others: the poller's CPU then
comes from a core the model does not use, and what is left is the server's own cost
of being polled.

With ``--fronts keeper,protocol`` two servers run side by side, their trials
interleaved: one whose front hands kept-alive poll connections to its native poll
keeper (the default, ``http/poll_keeper.py``), one started with
``RADIXSERVE_POLL_KEEPER=0``, whose front's protocol answers every poll itself; a
table per front, then one row per front.

    python bench/dashboard_polling.py [--model smollm2] [--trials 3] [--polls-per-s 1000] [--pin]
                                      [--fronts keeper,protocol]

The figures are built in the scheduler at most once a second and the HTTP front keeps
them encoded for a second, answering a poll before FastAPI's routing
(``http/dashboard.py``), so a poll costs the front one cached response and the
scheduler nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.benchmark.backends import RadixserveBackend  # noqa: E402
from radixserve.benchmark.metrics import summarize  # noqa: E402
from radixserve.benchmark.runner import run  # noqa: E402
from radixserve.benchmark.server import LaunchedServer  # noqa: E402
from radixserve.benchmark.workloads import TokenSource, shared_prefix  # noqa: E402

DATA, PAGE, FAILED = 0, 1, 2  # the poller's counters: answered 200 (figures, page), other
STOP_CHECK_S = 0.05  # how often the poller looks at the stop event


def poll(url: str, per_s: float, connections: int, stop, counts, cpus: set[int] | None) -> None:
    """Ask for the figures at ``per_s`` in all over ``connections`` keep-alive
    connections, and for the page once a second over one more, until ``stop`` is set;
    count the answers in ``counts`` (``DATA``, ``PAGE``, ``FAILED``)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    asyncio.run(_poll(urlparse(url), per_s, connections, stop, counts))


async def _poll(target, per_s: float, connections: int, stop, counts) -> None:
    running = [True]

    async def watch() -> None:  # an mp.Event is too dear to ask on every poll
        while not stop.is_set():
            await asyncio.sleep(STOP_CHECK_S)
        running[0] = False

    async def client(path: str, interval: float, slot: int, due: float) -> None:
        reader, writer = await asyncio.open_connection(target.hostname, target.port)
        request = f"GET {path} HTTP/1.1\r\nHost: {target.netloc}\r\n\r\n".encode()
        try:
            while running[0]:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = _content_length(head)
                if length:
                    await reader.readexactly(length)
                counts[slot if head[9:12] == b"200" else FAILED] += 1
                due += interval
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                elif wait < -1.0:  # a second behind: go on from now, not in a burst
                    due = time.monotonic()
        finally:
            writer.close()

    # Each connection polls every ``interval``, their turns spread evenly over it.
    interval, now = connections / per_s, time.monotonic()
    tasks = [client("/dashboard/data", interval, DATA, now + i / per_s) for i in range(connections)]
    await asyncio.gather(watch(), client("/dashboard", 1.0, PAGE, now), *tasks)


def _content_length(head: bytes) -> int:
    at = head.lower().find(b"\r\ncontent-length:")
    if at < 0:
        return 0
    return int(head[at + 17 : head.index(b"\r\n", at + 2)])


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


def trial(server: LaunchedServer, mode: str, args, client_cpus: set[int] | None) -> dict:
    """One run of the workload, quiet or polled: its throughput, the polls answered
    during it, and the CPU seconds each process took."""
    workload = shared_prefix(
        TokenSource.random(32000, 0, exclude=range(0, 4)), args.groups, args.prompts,
        args.system_len, args.question_len, args.output_len,
    )  # fmt: skip
    stop, counts = mp.Event(), mp.Array("q", 3, lock=False)
    pids = dict(server.pids)
    poller = None
    if mode == "polled":
        poller = mp.Process(
            target=poll,
            args=(server.http_url, args.polls_per_s, args.poll_connections, stop, counts,
                  client_cpus),
        )  # fmt: skip
        poller.start()
        pids["poller"] = poller.pid  # type: ignore[assignment]
        time.sleep(1.0)  # polling at full rate before the run starts
    try:
        polls0, start, cpu0 = counts[DATA], time.monotonic(), cpu_seconds(pids)
        m = asyncio.run(one_run(server.endpoint, workload, args.page_size))
        wall = time.monotonic() - start
        cpu = {k: v - cpu0[k] for k, v in cpu_seconds(pids).items()}
        polls = counts[DATA] - polls0
    finally:
        stop.set()
        if poller is not None:
            poller.join()
    if counts[FAILED]:
        raise RuntimeError(f"{counts[FAILED]} polls were not answered 200")
    cpu.setdefault("poller", 0.0)
    return {"tok_s": m["output_tok_s"], "polls": polls, "polls_s": polls / wall,
            "failed": m["failed"], **cpu}  # fmt: skip


def report(rows: dict[str, list[dict]], names: list[str]) -> dict:
    """The table of one server's trials; its summary returned (``summary_row``)."""
    keys = ["tok_s", "polls_s", *names]
    med = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in rows.items()}
    head = f"{'mode':8s} {'best tok/s':>11s} {'median tok/s':>13s} {'polls/s':>9s}"
    print("\n" + head + "".join(f" {k + ' CPU s':>15s}" for k in names))
    for mode, rs in rows.items():
        m = med[mode]
        line = f"{mode:8s} {max(r['tok_s'] for r in rs):11.1f} {m['tok_s']:13.1f}"
        print(line + f" {m['polls_s']:9.0f}" + "".join(f" {m[k]:15.2f}" for k in names))
    print("\npolled / quiet, medians:")
    for k in ["tok_s", *(n for n in names if n != "poller")]:
        what = "output tok/s" if k == "tok_s" else f"{k} CPU s"
        quiet = med["quiet"][k]  # CPU is counted in ticks: a quiet front may take none
        print(f"  {what:18s} " + (f"{med['polled'][k] / quiet:.3f}" if quiet else "-"))
    if "http" in names:
        per_poll = [(r["http"] - med["quiet"]["http"]) / r["polls"] for r in rows["polled"]]
        poller = [r["poller"] / r["polls"] for r in rows["polled"]]
        print(f"HTTP front CPU per poll (beyond a quiet run's): "
              f"{1e3 * statistics.median(per_poll):.3f} ms; "
              f"the poller's own: {1e3 * statistics.median(poller):.3f} ms")  # fmt: skip
    quiet = [r["tok_s"] for r in rows["quiet"]]
    lo, hi, mid = min(quiet), max(quiet), med["quiet"]["tok_s"]
    polled = med["polled"]["tok_s"]
    within = "within" if lo <= polled <= hi else "outside"
    print(f"quiet trials: {lo:.1f} to {hi:.1f} tok/s (spread {100 * (hi - lo) / mid:.1f}% of "
          f"their median); the polled median {polled:.1f} is {within} that range "
          f"({100 * (polled / mid - 1):+.1f}%)")  # fmt: skip
    per_poll = [(r["http"] - med["quiet"]["http"]) / r["polls"] for r in rows["polled"]]
    return {"quiet": mid, "lo": lo, "hi": hi, "polled": polled, "within": within,
            "polls_s": med["polled"]["polls_s"], "per_poll": statistics.median(per_poll),
            "poller": statistics.median(r["poller"] / r["polls"] for r in rows["polled"])}  # fmt: skip


def summary_rows(summaries: dict[str, dict]) -> None:
    print(
        "\n| front | quiet tok/s median (range) | polled tok/s median | polled / quiet | "
        "within the quiet range | polls/s | front CPU per poll | poller CPU per poll |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for front, m in summaries.items():
        print(f"| {front} | {m['quiet']:.1f} ({m['lo']:.1f}-{m['hi']:.1f}) | {m['polled']:.1f} | "
              f"{m['polled'] / m['quiet']:.3f} | {'yes' if m['within'] == 'within' else 'no'} | "
              f"{m['polls_s']:.0f} | {1e3 * m['per_poll']:.3f} ms | {1e3 * m['poller']:.3f} ms |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--polls-per-s", type=float, default=1000.0)
    p.add_argument("--poll-connections", "--poll-threads", type=int, default=64)
    p.add_argument("--pin", action="store_true",
                   help="the server on the last core, the poller and the client on the others")  # fmt: skip
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--fronts", default="keeper",
                   help="keeper (the poll keeper on), protocol (RADIXSERVE_POLL_KEEPER=0), or both, "
                        "comma-separated")  # fmt: skip
    args = p.parse_args()

    server_args = ["--model", args.model, "--dashboard", "--http-port", "0"]
    server_args += ["--page-size", str(args.page_size)]
    client_cpus = None
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            p.error("--pin needs two cores at least")
        client_cpus = set(cores[:-1])
        os.sched_setaffinity(0, {cores[-1]})  # the server's processes inherit it
        server_args += ["--threads", "1"]
    fronts = args.fronts.split(",")
    if not fronts or not set(fronts) <= {"keeper", "protocol"}:
        p.error("--fronts: keeper, protocol or both")
    rows = {f: {"quiet": [], "polled": []} for f in fronts}
    names: list[str] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for front in fronts:
            os.environ["RADIXSERVE_POLL_KEEPER"] = "0" if front == "protocol" else "1"
            servers[front] = stack.enter_context(LaunchedServer(server_args))
            print(f"server ({front}): {servers[front].summary}", file=sys.stderr)
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        for t in range(args.trials):
            for front in fronts if t % 2 == 0 else fronts[::-1]:
                server = servers[front]
                for mode in ("quiet", "polled") if t % 2 == 0 else ("polled", "quiet"):
                    r = trial(server, mode, args, client_cpus)
                    rows[front][mode].append(r)
                    cpu = " ".join(f"{k}={r[k]:.2f}" for k in [*server.pids, "poller"])
                    print(f"trial {t} {front:8s} {mode:6s}: {r['tok_s']:8.1f} output tok/s, "
                          f"{r['polls_s']:7.0f} polls/s, CPU s {cpu}", file=sys.stderr)  # fmt: skip
                names = [*server.pids, "poller"]
    summaries = {}
    for front in fronts:
        print(f"\n## front: {front}")
        summaries[front] = report(rows[front], names)
    summary_rows(summaries)
    if any(r["failed"] for f in rows.values() for rs in f.values() for r in rs):
        print("some requests failed", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

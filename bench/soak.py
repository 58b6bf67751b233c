"""Soak: hostile and ordinary clients against one launched server under KV pressure.

    .venv/bin/python bench/soak.py --minutes 3   (or --duration SECONDS)

For ``--minutes`` it runs, all at once:
- ``--clients`` threads of ordinary clients (radixserve.client) sending random
  greedy and sampled requests (prompts up to ``--max-prompt`` tokens, ``n`` up to 3,
  streaming or not), aborting some, and abandoning some connections mid-request;
- one fuzzing peer sending hostile frames (random bytes, truncated and
  bit-flipped messages, wrong types, huge integers) on a raw DEALER socket;
- a connection flood every ``--flood-every`` seconds: ``--flood-connections`` idle
  TCP connections opened at once to the public port (and to the HTTP front's, with
  ``--server-args "--http-port 0"``), held ``--flood-hold`` seconds, then closed;
  the connection limits refuse what does not fit while the clients go on;
- a monitor sampling each server process's RSS (``/proc/PID/status``).

The KV pool is small (``--num-pages``), so eviction and retraction run all the
time. At the end it waits for idle, runs the scheduler's idle check (a leaked
page or lock fails it), SIGKILLs the launcher and checks that no child outlives
it. It prints the counts of frames and requests, crashes (the server exiting),
hangs (a request past ``--timeout``), the leak check, and each process's RSS at
start, its peak, and at the end, with a series of the worker's RSS against the
requests sent and the slope over the run's second half (a plateau is the
allocator's high-water mark, steady growth a leak).

Then ``--kill-rounds`` rounds, each against a fresh server launched with
``--http-port 0`` (four children): clients put requests in flight (streaming and
not), then one process is ended, in turn: SIGKILL of the worker, the scheduler,
the tokenizer, the HTTP front, SIGSTOP of the worker (the server runs with
``--watchdog-timeout 10``, so the scheduler's watchdog must fire), SIGKILL of the
launcher. Each round checks that the launcher exits (code 1 where a child died)
within ``--exit-bound`` seconds, that no process of the server is left (by pid,
and by a scan of /proc for command lines naming its run dir), that the run dir
is gone, that every request in flight ended with an error (``ServerError`` or
``ConnectionLost``, not ``RequestTimeout``) within a few seconds of the
heartbeat or watchdog timeout, and how a new client against the dead endpoint
ends. It prints one table row per round. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

import msgpack
import zmq

from radixserve import protocol as P
from radixserve.client import Client, ConnectionLost, RequestTimeout, ServerError

HEARTBEAT_S = P.HEARTBEAT_TIMEOUT_MS / 1000
WATCHDOG_S = 10.0  # --watchdog-timeout of the SIGSTOP round (a loaded CPU's step takes seconds)
SLACK_S = 5.0  # how much longer than the heartbeat (or watchdog) timeout a client may wait
KILLS = ["worker", "scheduler", "tokenizer", "http", "worker:SIGSTOP", "launcher"]


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


class Launched:
    """One ``radixserve launch`` subprocess: its endpoint, child pids and run dir."""

    def __init__(self, args: argparse.Namespace, *extra: str, stderr: object = None) -> None:
        cmd = [sys.executable, "-m", "radixserve", "launch", "--port", "0", "--num-pages",
               str(args.num_pages), "--max-running-requests", "16", "--log-level", "error",
               "--exit-with-parent", *args.server_args.split(), *extra]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
        self.endpoint, self.run_dir, self.pids, self.http_url = "", "", {}, ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if m := re.search(r"serving on (\S+)", line):
                self.endpoint = m.group(1)
            if m := re.search(r"(http://\S+)", line):
                self.http_url = m.group(1)
            if "processes" in line:
                self.run_dir = line.split("run_dir=")[1].split()[0]
                self.pids = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                break
        self.proc.stdout.close()  # nothing more is printed that matters
        if not self.endpoint or not self.pids:
            raise SystemExit(f"the server did not start (exit code {self.proc.wait()})")

    def survivors(self) -> list[str]:
        """What of this server is still there: a child alive (by pid), any process whose
        command line names the run dir (the children's config does), the run dir."""
        left = [name for name, pid in self.pids.items() if running(pid)]
        known = set(self.pids.values())
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in known or not running(int(entry)):
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if self.run_dir.encode() in f.read():
                        left.append(f"pid {entry}")
            except OSError:
                pass
        return left + (["run_dir"] if os.path.exists(self.run_dir) else [])

    def wait_gone(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        while (left := self.survivors()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


def running(pid: int) -> bool:
    """Alive and not a zombie (a reaped-later zombie holds nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Soak:
    def __init__(self, args: argparse.Namespace, endpoint: str, http_url: str = "") -> None:
        self.args, self.endpoint, self.http_url = args, endpoint, http_url
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def flood(self) -> None:
        """Every ``--flood-every`` s, ``--flood-connections`` idle connections to each
        public port at once (never greeting, never sending a request), held
        ``--flood-hold`` s, then closed."""
        targets = [self.endpoint.removeprefix("tcp://")]
        if self.http_url:
            targets.append(self.http_url.removeprefix("http://").split("/")[0])
        addrs = [(host.strip("[]"), int(port)) for host, port in
                 (t.rsplit(":", 1) for t in targets)]  # fmt: skip
        while not self.stop.wait(self.args.flood_every):
            socks = []
            for addr in addrs:
                for _ in range(self.args.flood_connections):
                    s = socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET)
                    s.setblocking(False)
                    if s.connect_ex(addr) in (0, errno.EINPROGRESS):
                        socks.append(s)
                    else:
                        s.close()
            self.count("floods")
            self.count("flood_connections", len(socks))
            self.stop.wait(self.args.flood_hold)
            for s in socks:
                s.close()

    def ordinary(self, seed: int) -> None:
        rng = random.Random(seed)
        client = Client(self.endpoint, timeout=self.args.timeout)
        while not self.stop.is_set():
            prompt = [rng.randrange(10, 40000) for _ in range(rng.randint(1, self.args.max_prompt))]
            sampling = {"max_tokens": rng.randint(1, 48), "n": rng.choice([1, 1, 1, 2, 3])}
            if rng.random() < 0.5:
                sampling.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 30))
            else:
                sampling.update(temperature=0.0)
            self.count("requests")
            try:
                roll = rng.random()
                if roll < 0.1:  # abandon the connection mid-request
                    stream = client.generate_stream(input_ids=prompt, **sampling)
                    next(iter(stream), None)
                    client.close()
                    client = Client(self.endpoint, timeout=self.args.timeout)
                    self.count("abandoned")
                elif roll < 0.25:  # stream, abort part way
                    rid = f"s{seed}-{self.counts['requests']}"
                    stream = client.generate_stream(input_ids=prompt, request_id=rid, **sampling)
                    for i, _ in enumerate(stream):
                        if i == 2:
                            client.abort(rid)
                    self.count("aborted")
                else:
                    client.generate(input_ids=prompt, **sampling)
                    self.count("finished")
            except RequestTimeout:
                self.count("hangs")
            except ServerError as e:
                self.count("errors")
                if "context" not in str(e) and "fit" not in str(e):
                    self.count("unexpected_errors")
                    print(f"soak: unexpected error: {e}", file=sys.stderr)
        client.close()

    def fuzz(self, seed: int) -> None:
        rng = random.Random(seed)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        valid = msgpack.packb({"type": "generate", "v": 1, "id": "z", "input_ids": [5, 6, 7],
                               "sampling": {"max_tokens": 2}})  # fmt: skip
        wild = [None, -1, 2**64 - 1, "x" * 4000, [[[]]], {"a": {}}, 1e308]
        n = 0
        while not self.stop.is_set():
            kind = rng.random()
            if kind < 0.3:
                frames = [rng.randbytes(rng.randint(0, 64))]
            elif kind < 0.6:
                data = bytearray(valid[: rng.randint(0, len(valid))])
                if data:
                    data[rng.randrange(len(data))] ^= 0xFF
                frames = [bytes(data)]
            else:
                body = {"type": "generate", "v": 1, "id": f"z{n}", "input_ids": [5, 6],
                        "sampling": {"max_tokens": 2, rng.choice(["n", "top_k", "seed", "stop"]):
                                     rng.choice(wild)}}  # fmt: skip
                try:
                    frames = [msgpack.packb(body)]
                except (OverflowError, TypeError, ValueError):
                    frames = [rng.randbytes(9)]
            sock.send_multipart(frames)
            n += 1
            while sock.poll(0):
                sock.recv()
                self.count("fuzz_replies")
            time.sleep(0.002)
        self.count("fuzz_frames", n)
        sock.close()
        ctx.term()


def in_flight_client(
    endpoint: str, stream: bool, seed: int, started: threading.Event, out: dict
) -> None:
    """One long request (it outlasts the round); ``out`` gets how it ended and when."""
    sampling = {"max_tokens": 1000, "ignore_eos": True, "temperature": 0.0}
    prompt = [10 + (seed * 37 + i) % 30000 for i in range(40 + 20 * seed)]
    client = Client(endpoint, timeout=120)
    try:
        if stream:
            it = iter(client.generate_stream(input_ids=prompt, **sampling))
            next(it)
            started.set()
            for _ in it:
                pass
        else:
            started.set()
            client.generate(input_ids=prompt, **sampling)
        out["outcome"] = "finished"
    except ConnectionLost:
        out["outcome"] = "ConnectionLost"
    except ServerError:
        out["outcome"] = "ServerError"
    except RequestTimeout:
        out["outcome"] = "RequestTimeout"
    except Exception as e:  # noqa: BLE001 (reported: any other end is a failure)
        out["outcome"] = type(e).__name__
    out["end"] = time.monotonic()
    started.set()  # also when it failed before it started
    client.close()


def kill_round(args: argparse.Namespace, target: str, log_path: str) -> dict:
    """Launch, load, end ``target``, check; one row of the kill table."""
    stop = target.endswith(":SIGSTOP")
    name = target.split(":")[0]
    extra = ["--http-port", "0", "--watchdog-timeout", str(WATCHDOG_S if stop else 300)]
    extra += ["--num-pages", "8192"]  # room for every request in flight: none is retracted
    with open(log_path, "a") as log:
        log.write(f"--- round: {target}\n")
        log.flush()
        srv = Launched(args, *extra, stderr=log)
    row: dict = {"killed": f"{'SIGSTOP' if stop else 'SIGKILL'} {name}", "problems": []}
    outs = [{} for _ in range(args.kill_clients)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=in_flight_client,
                                args=(srv.endpoint, i % 2 == 0, i, started[i], outs[i]))
               for i in range(len(outs))]  # fmt: skip
    for t in threads:
        t.start()
    for ev in started:
        ev.wait(60)
    try:
        with Client(srv.endpoint, timeout=30) as c:  # every request admitted and running
            deadline = time.monotonic() + 60
            while c.stats()["running"] < len(outs) and time.monotonic() < deadline:
                time.sleep(0.1)
    except (ServerError, RequestTimeout) as e:
        row["problems"].append(f"the server failed before the kill: {e}")
    pid = srv.proc.pid if name == "launcher" else srv.pids[name]
    t_kill = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP if stop else signal.SIGKILL)
    try:
        rc = srv.proc.wait(args.exit_bound)
    except subprocess.TimeoutExpired:
        rc = None
        row["problems"].append("launcher did not exit")
    row["code"] = rc
    left = srv.wait_gone(max(0.0, args.exit_bound - (time.monotonic() - t_kill)))
    row["exit_s"] = time.monotonic() - t_kill
    row["orphans"] = [x for x in left if x != "run_dir"]
    row["run_dir_left"] = "run_dir" in left
    if name == "launcher":
        ok_code = rc == -signal.SIGKILL
    else:
        ok_code = rc == 1
    if rc is not None and not ok_code:
        row["problems"].append(f"exit code {rc}")
    if row["orphans"]:
        row["problems"].append(f"orphans {row['orphans']}")
    if row["run_dir_left"]:
        row["problems"].append("run dir left")
    for t in threads:
        t.join(130)
    bound = (WATCHDOG_S if stop else HEARTBEAT_S) + SLACK_S
    waits = [o["end"] - t_kill for o in outs if "end" in o]
    row["max_wait_s"] = max(waits) if waits else float("nan")
    row["outcomes"] = Counter(o.get("outcome", "hung") for o in outs)
    if any(o.get("outcome") not in ("ServerError", "ConnectionLost") for o in outs):
        row["problems"].append(f"client outcomes {dict(row['outcomes'])}")
    if any(w < 0 for w in waits):
        row["problems"].append("a request ended before the kill")
    if len(waits) < len(outs) or max(waits) > bound:
        row["problems"].append(f"a client waited past {bound:.0f} s")
    t0 = time.monotonic()  # a new client against the dead endpoint
    try:
        with Client(srv.endpoint, timeout=args.new_client_timeout) as c:
            c.generate(input_ids=[5, 6, 7], max_tokens=2)
        row["new_client"] = "answered"
        row["problems"].append("a new client was answered by a dead server")
    except (ServerError, RequestTimeout) as e:
        row["new_client"] = type(e).__name__
    row["new_client_s"] = time.monotonic() - t0
    if row["new_client_s"] > args.new_client_timeout + 1:
        row["problems"].append("the new client did not fail within its timeout")
    if stop:
        for pid_ in srv.pids.values():  # in case the stopped worker outlived the round
            if running(pid_):
                os.kill(pid_, signal.SIGKILL)
    return row


def print_kill_table(rows: list[dict]) -> None:
    print("\n| round | killed | exit code | s to exit (all gone) | max client wait s "
          "| client outcomes | orphans | run dir left | new client | ok |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
        print(f"| {i} | {r['killed']} | {r['code']} | {r['exit_s']:.1f} | "
              f"{r['max_wait_s']:.1f} | {outcomes} | {', '.join(r['orphans']) or 'none'} | "
              f"{'yes' if r['run_dir_left'] else 'no'} | "
              f"{r['new_client']} {r['new_client_s']:.1f} s | "
              f"{'; '.join(r['problems']) or 'yes'} |")  # fmt: skip


def slope_per_min(ts: list[float], xs: list[float]) -> float:
    """Least-squares slope of ``xs`` over ``ts`` (seconds), per minute."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, mx = sum(ts) / n, sum(xs) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (x - mx) for t, x in zip(ts, xs)) / var if var else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--duration", type=float, default=None, help="seconds (instead of --minutes)")
    p.add_argument("--flood-every", type=float, default=180.0, help="seconds between floods")
    p.add_argument("--flood-connections", type=int, default=3000, help="per port, per flood")
    p.add_argument("--flood-hold", type=float, default=10.0, help="seconds a flood is held")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--num-pages", type=int, default=1500, help="KV pool (page size 1): small")
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--timeout", type=float, default=300.0, help="a request past it is a hang")
    p.add_argument("--server-args", default="", help="more launch flags")
    p.add_argument(
        "--kill-rounds",
        type=int,
        default=len(KILLS),
        help=f"kill rounds after the soak, ending in turn: {', '.join(KILLS)}",
    )
    p.add_argument(
        "--kill-clients",
        type=int,
        default=4,
        help="requests in flight at each kill, half of them streaming",
    )
    p.add_argument(
        "--exit-bound",
        type=float,
        default=30.0,
        help="seconds the launcher and every child may take to be gone after a kill",
    )
    p.add_argument(
        "--new-client-timeout",
        type=float,
        default=5.0,
        help="the timeout of a new client sent to the dead endpoint",
    )
    p.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples")
    args = p.parse_args()
    if args.duration is not None:
        args.minutes = args.duration / 60
    ok = True
    if args.minutes > 0:
        ok = soak_phase(args)
    rows = []
    log_path = os.path.join(tempfile.gettempdir(), f"soak-kills-{os.getpid()}.log")
    for i in range(args.kill_rounds):
        target = KILLS[i % len(KILLS)]
        rows.append(kill_round(args, target, log_path))
        r = rows[-1]
        print(f"kill round {i + 1}: {r['killed']}: code {r['code']}, gone in {r['exit_s']:.1f} s, "
              f"max client wait {r['max_wait_s']:.1f} s, "
              f"{'; '.join(r['problems']) or 'ok'}", flush=True)  # fmt: skip
    if rows:
        print_kill_table(rows)
        failed = [r for r in rows if r["problems"]]
        print(f"\nkill rounds {len(rows)}: failed {len(failed)}, requests in flight "
              f"{sum(sum(r['outcomes'].values()) for r in rows)}, max client wait "
              f"{max(r['max_wait_s'] for r in rows):.1f} s, slowest exit "
              f"{max(r['exit_s'] for r in rows):.1f} s, orphans "
              f"{sum(len(r['orphans']) for r in rows)}, run dirs left "
              f"{sum(r['run_dir_left'] for r in rows)} (children's stderr: {log_path})")  # fmt: skip
        ok = ok and not failed
    return 0 if ok else 1


def soak_phase(args: argparse.Namespace) -> bool:
    srv = Launched(args)
    proc, endpoint, pids = srv.proc, srv.endpoint, srv.pids
    t_start = time.monotonic()
    rss = {name: [rss_mib(pid)] for name, pid in pids.items()}
    times, sent = [0.0], [0]
    soak = Soak(args, endpoint, srv.http_url)
    threads = [threading.Thread(target=soak.ordinary, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=soak.fuzz, args=(99,)))
    if args.flood_connections > 0:
        threads.append(threading.Thread(target=soak.flood))
    for t in threads:
        t.start()
    end = time.monotonic() + args.minutes * 60
    crashed = False
    while time.monotonic() < end:
        time.sleep(args.rss_every)
        times.append(time.monotonic() - t_start)
        sent.append(soak.counts["requests"])
        for name, pid in pids.items():
            rss[name].append(rss_mib(pid))
        if proc.poll() is not None:
            crashed = True
            break
    soak.stop.set()
    for t in threads:
        t.join(timeout=args.timeout + 30)
    hung_threads = sum(t.is_alive() for t in threads)
    leak_ok, leak_msg = False, "not checked (server gone)"
    if not crashed:
        with Client(endpoint, timeout=120) as c:
            for _ in range(600):
                st = c.stats()
                if st["running"] == st["waiting"] == st["in_flight"] == 0:
                    break
                time.sleep(0.1)
            check = c.check()
            leak_ok, leak_msg = bool(check["ok"]), check["error"] or "idle invariant holds"
            final = c.stats()
    os.kill(proc.pid, signal.SIGKILL)
    orphans = srv.wait_gone(8)
    c = soak.counts
    print(f"\nsoak: {args.minutes} min, {args.clients} clients + 1 fuzzing peer, "
          f"{args.num_pages} KV pages")  # fmt: skip
    print(f"requests sent {c['requests']}: finished {c['finished']}, aborted {c['aborted']}, "
          f"abandoned {c['abandoned']}, errors {c['errors']} "
          f"(unexpected {c['unexpected_errors']})")  # fmt: skip
    print(f"fuzz frames {c['fuzz_frames']}, replies {c['fuzz_replies']}")
    print(f"connection floods {c['floods']} ({c['flood_connections']} connections opened)")
    print(f"crashes {int(crashed)}, hangs {c['hangs'] + hung_threads}, leak check: {leak_msg}")
    if not crashed:
        print(f"preemptions (retractions) {final['preemptions']}, steps {final['steps']}")
    print(f"left 8 s after SIGKILL of the launcher: {orphans or 'none'}")
    print("\n| process | RSS start MiB | peak | end | growth |\n|---|---|---|---|---|")
    for name, xs in rss.items():
        xs = [x for x in xs if x is not None]
        print(f"| {name} | {xs[0]:.0f} | {max(xs):.0f} | {xs[-1]:.0f} | {xs[-1] - xs[0]:+.0f} |")
    half = len(times) // 2
    print("\n| process | RSS slope, 2nd half, MiB/min | MiB per 1000 requests |\n|---|---|---|")
    for name, xs in rss.items():
        pts = [(t, x, n) for t, x, n in zip(times[half:], xs[half:], sent[half:]) if x is not None]
        if len(pts) < 2:
            continue
        ts, ys, ns = zip(*pts)
        per_min = slope_per_min(list(ts), list(ys))
        req_per_min = slope_per_min(list(ts), [float(n) for n in ns])
        per_k = 1000 * per_min / req_per_min if req_per_min else float("nan")
        print(f"| {name} | {per_min:+.2f} | {per_k:+.2f} |")
    step = max(1, len(times) // 12)
    print("\nworker RSS over time (s, requests sent, MiB): " + ", ".join(
        f"{times[i]:.0f} {sent[i]} {rss['worker'][i]:.0f}" for i in range(0, len(times), step)
        if rss["worker"][i] is not None))  # fmt: skip
    bad = crashed or c["hangs"] or hung_threads or not leak_ok or orphans or c["unexpected_errors"]
    return not bad


if __name__ == "__main__":
    sys.exit(main())

"""Soak: hostile and ordinary clients against one launched server under KV pressure.

    .venv/bin/python bench/soak.py --minutes 3

For ``--minutes`` it runs, all at once:
- ``--clients`` threads of ordinary clients (radixserve.client) sending random
  greedy and sampled requests (prompts up to ``--max-prompt`` tokens, ``n`` up to 3,
  streaming or not), aborting some, and abandoning some connections mid-request;
- one fuzzing peer sending hostile frames (random bytes, truncated and
  bit-flipped messages, wrong types, huge integers) on a raw DEALER socket;
- a monitor sampling each server process's RSS (``/proc/PID/status``).

The KV pool is small (``--num-pages``), so eviction and retraction run all the
time. At the end it waits for idle, runs the scheduler's idle check (a leaked
page or lock fails it), SIGKILLs the launcher and checks that no child outlives
it. It prints the counts of frames and requests, crashes (the server exiting),
hangs (a request past ``--timeout``), the leak check, and each process's RSS at
start, its peak, and at the end. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import msgpack
import zmq

from radixserve.client import Client, RequestTimeout, ServerError


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str, dict[str, int]]:
    cmd = [sys.executable, "-m", "radixserve", "launch", "--port", "0", "--num-pages",
           str(args.num_pages), "--max-running-requests", "16", "--log-level", "error",
           "--exit-with-parent", *args.server_args.split()]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    endpoint, pids = "", {}
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"serving on (\S+)", line):
            endpoint = m.group(1)
        if "processes" in line:
            pids = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
            break
    if not endpoint or not pids:
        raise SystemExit("the server did not start")
    return proc, endpoint, pids


class Soak:
    def __init__(self, args: argparse.Namespace, endpoint: str) -> None:
        self.args, self.endpoint = args, endpoint
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--num-pages", type=int, default=1500, help="KV pool (page size 1): small")
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--timeout", type=float, default=300.0, help="a request past it is a hang")
    p.add_argument("--server-args", default="", help="more launch flags")
    args = p.parse_args()
    proc, endpoint, pids = launch(args)
    rss = {name: [rss_mib(pid)] for name, pid in pids.items()}
    soak = Soak(args, endpoint)
    threads = [threading.Thread(target=soak.ordinary, args=(i,)) for i in range(args.clients)]
    threads.append(threading.Thread(target=soak.fuzz, args=(99,)))
    for t in threads:
        t.start()
    end = time.monotonic() + args.minutes * 60
    crashed = False
    while time.monotonic() < end:
        time.sleep(2)
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
    time.sleep(8)
    orphans = [name for name, pid in pids.items() if rss_mib(pid) is not None]
    c = soak.counts
    print(f"\nsoak: {args.minutes} min, {args.clients} clients + 1 fuzzing peer, "
          f"{args.num_pages} KV pages")  # fmt: skip
    print(f"requests sent {c['requests']}: finished {c['finished']}, aborted {c['aborted']}, "
          f"abandoned {c['abandoned']}, errors {c['errors']} "
          f"(unexpected {c['unexpected_errors']})")  # fmt: skip
    print(f"fuzz frames {c['fuzz_frames']}, replies {c['fuzz_replies']}")
    print(f"crashes {int(crashed)}, hangs {c['hangs'] + hung_threads}, leak check: {leak_msg}")
    if not crashed:
        print(f"preemptions (retractions) {final['preemptions']}, steps {final['steps']}")
    print(f"children alive 8 s after SIGKILL of the launcher: {orphans or 'none'}")
    print("\n| process | RSS start MiB | peak | end | growth |\n|---|---|---|---|---|")
    for name, xs in rss.items():
        xs = [x for x in xs if x is not None]
        print(f"| {name} | {xs[0]:.0f} | {max(xs):.0f} | {xs[-1]:.0f} | {xs[-1] - xs[0]:+.0f} |")
    bad = crashed or c["hangs"] or hung_threads or not leak_ok or orphans or c["unexpected_errors"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Mixed-traffic soak: every feature at once against one launched server, with floods.

    PYTHONPATH=. .venv/bin/python bench/soak_mixed.py --minutes 60

(httpx and peft: the ``dev`` extra; ``--minutes 2 --flood-first 20 --flood-every 50``
runs both flood sizes in two minutes.)

One server (the embedded SmolLM2) is launched with everything on that combines:
``--http-port 0``, cache tiers (``--host-cache-gb`` and ``--disk-cache-dir`` in a
temporary dir), a small KV pool (``--num-pages``) and host tier (0.05 GB, about 2,300
pages) under a working set of ``--docs`` documents of about 7,000 tokens, so prefixes
move between the pool, the host tier and the disk tier all the time,
``--schedule-policy priority``, ngram speculative decoding, and a LoRA adapter (``--lora-modules soak-lora=...``: a rank-8 PEFT adapter
of SmolLM2 written at start by ``peft`` with random weights). The server accepts all of
these together, so nothing is split across servers; per request, the adapter, the
priority, structured output, ``n`` and streaming are chosen at random.

For ``--minutes`` it runs, all at once:
- ``--http-clients`` threads on the OpenAI HTTP API (httpx): ``/v1/completions`` and
  ``/v1/chat/completions``, streaming and not, ``n`` up to 3, ``logprobs``, priorities,
  the base model or the adapter by ``model``, ``response_format`` json_schema (a
  finished answer must parse and hold the required keys); streams closed part way
  (a disconnect) and raw sockets closed in the middle of a request body;
- ``--zmq-clients`` threads on the ZeroMQ client (radixserve.client): the same mix by
  ``lora=``/``priority``/``structured``, streams aborted part way (``client.abort``),
  streams closed early, and clients closed mid-request;
- a flood every ``--flood-every`` seconds (the first ``--flood-first`` seconds in):
  idle TCP connections to the public ZeroMQ port and as many to the HTTP port, held
  ``--flood-hold`` seconds (longer if the probes take longer), then closed. Floods take
  the sizes of ``--flood-conns`` (2000,7000 per port) in turn: 7000 idle connections
  cost the tokenizer's routing-id gate 21,000 descriptors, past a 20,000 `ulimit -n` (the
  bench raises its own limit to the hard one, and caps the floods if that is short). While they are held, one ordinary request goes through a ZeroMQ client and
  one through an HTTP client, both connected before the flood (the probe: it must be
  answered within ``--probe-timeout``), and one each through new connections (reported
  only: a server that limits connections per peer may rightly refuse these, as it may
  refuse the traffic threads' new connections during a flood: those are counted
  apart, not as failures);
- a monitor sampling every ``--rss-every`` seconds the RSS (``/proc/PID/status``) of
  the launcher and each child (tokenizer, scheduler, worker, http).

At the end it waits for idle, runs the scheduler's idle check (every KV page of the
pool free or held by exactly one tree node, no lock, slot, grammar or adapter count
left, no copy between tiers in flight; the host and disk tiers are checked by their own
``check``), prints the pool's pages, then flushes the cache and checks that every pool
page is free and the host and disk tiers are empty. Then SIGTERM to the launcher: it
must exit 0 and leave no process.

It prints requests by kind and outcome, the HTTP status histogram, crashes (the
launcher exiting, with its code and the server log's tail), hangs (a request past
``--timeout``), the floods (connections opened, closed by the server during the hold,
and the probes), the RSS curve (a row per interval: each process's RSS in MiB) and a
verdict on RSS flatness. Warm-up is the run's first half; over the second half each
process's least-squares slope must be at most ``--rss-slope-max`` MiB/hour (25: a leak
of 600 MiB a day, which would need restarts, is caught; the allocator's plateau is not)
and its max - min at most ``--rss-range-max`` MiB (64). Runs shorter than
``--rss-min-minutes`` (20) print the curve without a verdict: their second half is
still warm-up.

Fails (exit 1) on: a crash, any 5xx, any other unexpected answer (a 4xx to a valid
request, an error event in a stream, a structured answer that does not parse, a
ServerError), a hang, a failed probe, the idle check, a page not free after the flush,
RSS not flat, the launcher not exiting 0 or leaving a process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque

import httpx
from soak import rss_mib, running, slope_per_min  # bench/soak.py, beside this file

from radixserve.client import Client, ConnectionLost, RequestTimeout, ServerError
from radixserve.sampling_params import StructuredOutput

ADAPTER = "soak-lora"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}
PRIORITIES = [-1, 0, 0, 0, 1, 2, 5]
WORDS = (
    "cache page tree node prefix token request batch step worker scheduler tier host disk "
    "river stone light garden window market paper letter engine signal harbor winter field "
    "number table answer simple quiet bright early often always never under between"
)


def write_adapter(out: str) -> None:
    """A rank-8 PEFT LoRA adapter of the embedded SmolLM2 with random (nonzero) weights."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from radixserve.models.embedded import ensure_smollm2

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(ensure_smollm2()), dtype=torch.float32)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                          target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])  # fmt: skip
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.02)
    pm.save_pretrained(out)


class Server:
    """One ``radixserve launch``: endpoint, HTTP URL, pids, run dir, a log of its output."""

    def __init__(self, cmd: list[str], log_path: str) -> None:
        self.log = open(log_path, "w")  # noqa: SIM115 (open for the server's life)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.endpoint, self.http_url, self.run_dir = "", "", ""
        self.pids: dict[str, int] = {}
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            if m := re.search(r"serving on (\S+)", line):
                self.endpoint = m.group(1)
            if m := re.search(r"http on (\S+)", line):
                self.http_url = m.group(1)
            if "processes" in line:
                self.run_dir = line.split("run_dir=")[1].split()[0]
                self.pids = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
                break
        self.log.flush()
        if not self.endpoint or not self.http_url or not self.pids:
            rc = self.proc.wait()
            self.log.close()
            raise SystemExit(f"the server did not start (exit code {rc}); log: {log_path}\n"
                             + tail(log_path))  # fmt: skip
        threading.Thread(target=self._drain, daemon=True).start()
        self.zmq_port = int(self.endpoint.rsplit(":", 1)[1])
        self.http_port = int(self.http_url.rstrip("/").rsplit(":", 1)[1])

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()

    def survivors(self) -> list[str]:
        left = [name for name, pid in self.pids.items() if running(pid)]
        return left + (["run_dir"] if os.path.exists(self.run_dir) else [])


def tail(path: str, n: int = 20) -> str:
    """The last ``n`` lines of a log, runs of lines equal but for their time stamp as one
    line with a count."""
    try:
        with open(path, errors="replace") as f:
            lines = list(deque(f, 20000))
    except OSError:
        return ""
    runs: list[list] = []
    for line in lines:
        key = re.sub(r"^\S+ \S+ ", "", line.rstrip("\n"))
        if runs and runs[-1][0] == key:
            runs[-1][1] += 1
        else:
            runs.append([key, 1, line.rstrip("\n")])
    return "\n".join(f"  {r[2]}" + (f"  [x{r[1]}]" if r[1] > 1 else "") for r in runs[-n:])


class Soak:
    def __init__(self, args: argparse.Namespace, srv: Server, base_model: str) -> None:
        self.args, self.srv, self.base_model = args, srv, base_model
        self.stop = threading.Event()
        self.crashed = threading.Event()
        self.flooding = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.status: Counter[int] = Counter()
        self.status_down: Counter[int] = Counter()  # answered while a process was down
        self.problems: list[str] = []  # samples of unexpected answers
        self.floods: list[dict] = []
        rng, words = random.Random(1234), WORDS.split()
        self.docs = [" ".join(rng.choice(words) for _ in range(rng.randint(150, 320)))
                     for _ in range(args.docs)]  # fmt: skip

    # -- bookkeeping
    def count(self, kind: str, outcome: str, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[kind, outcome] += 1
            if problem is not None and len(self.problems) < 40:
                self.problems.append(f"{kind}: {problem}")

    def gone_or(self, kind: str, outcome: str, problem: str) -> None:
        """A connection failure: after a crash it is the crash's, during a flood it may
        be a refused connection (counted apart), otherwise a failure."""
        if self.down():
            self.count(kind, "server_gone")
        elif self.flooding.is_set():
            self.count(kind, "refused_in_flood")
        else:
            self.count(kind, outcome, problem)

    def down(self) -> bool:
        """The server crashed, or is going down: the launcher or a child has exited."""
        if self.crashed.is_set():
            return True
        return not all(running(pid) for pid in [self.srv.proc.pid, *self.srv.pids.values()])

    def prompt(self, rng: random.Random) -> str:
        doc = rng.choice(self.docs)
        ask = rng.choice(["Repeat the first words of the text.", "Summarize the text.",
                          "Which words repeat?", "Continue the text:"])  # fmt: skip
        return f"{doc}\n\n{ask}"

    # -- HTTP traffic
    def http_client(self, seed: int) -> None:
        rng = random.Random(seed)
        to = httpx.Timeout(self.args.timeout, connect=10.0)
        h = httpx.Client(base_url=self.srv.http_url, timeout=to)
        while not self.stop.is_set():
            roll = rng.random()
            try:
                if roll < 0.06:
                    self.raw_half_body(rng)
                elif roll < 0.40:
                    self.http_completion(h, rng)
                else:
                    self.http_chat(h, rng)
            except httpx.TimeoutException as e:
                if isinstance(e, httpx.ConnectTimeout):
                    self.gone_or("http", "conn_error", repr(e))
                else:
                    self.count("http", "hang", f"past {self.args.timeout} s: {e!r}")
            except (httpx.TransportError, OSError) as e:
                self.gone_or("http", "conn_error", repr(e))
                self.stop.wait(0.5)  # no spinning against a refusing port
            except Exception as e:  # noqa: BLE001 (counted: a failure of the soak)
                self.count("http", "exception", repr(e)[:200])
                self.stop.wait(0.5)
        h.close()

    def _common(self, rng: random.Random) -> dict:
        body: dict = {
            "model": ADAPTER if rng.random() < 0.3 else self.base_model,
            "max_tokens": rng.randint(4, 40),
            "n": rng.choice([1, 1, 1, 2, 3]),
            "priority": rng.choice(PRIORITIES),
        }
        if rng.random() < 0.5:
            body.update(temperature=0.0)
        else:
            body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 30))
        return body

    def _status(self, kind: str, r: httpx.Response) -> bool:
        with self.lock:
            self.status[r.status_code] += 1
        if r.status_code == 200:
            return True
        with contextlib.suppress(httpx.HTTPError):
            r.read()
        if self.down():  # the answer of a front whose backend died: the crash's
            with self.lock:
                self.status_down[r.status_code] += 1
            self.count(kind, "server_gone", f"{r.status_code} while down: {r.text[:200]}")
            return False
        outcome = "5xx" if r.status_code >= 500 else f"{r.status_code // 100}xx"
        self.count(kind, outcome, f"{r.status_code} {r.text[:200]}")
        return False

    def _stream(self, h: httpx.Client, kind: str, path: str, body: dict, cut: int | None) -> None:
        """A streamed request; ``cut``: close the connection after that many events."""
        with h.stream("POST", path, json=body) as r:
            if not self._status(kind, r):
                return
            events = 0
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                if '"error"' in data and "error" in json.loads(data):
                    self.count(kind, "stream_error", data[:200])
                    return
                events += 1
                if cut is not None and events >= cut:
                    self.count(kind, "disconnected")
                    return  # leaving the block closes the connection mid-stream
        self.count(kind, "ok")

    def http_completion(self, h: httpx.Client, rng: random.Random) -> None:
        body = self._common(rng) | {"prompt": self.prompt(rng)}
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(1, 3)
        if rng.random() < 0.5:
            cut = rng.randint(1, 4) if rng.random() < 0.3 else None
            kind = "http_completion_stream"
            self._stream(h, kind, "/v1/completions", body | {"stream": True}, cut)
            return
        r = h.post("/v1/completions", json=body)
        if self._status("http_completion", r):
            choices = r.json()["choices"]
            if len(choices) != body["n"]:
                self.count("http_completion", "bad_answer", f"{len(choices)} choices")
            else:
                self.count("http_completion", "ok")

    def http_chat(self, h: httpx.Client, rng: random.Random) -> None:
        body = self._common(rng)
        body["messages"] = [{"role": "system", "content": rng.choice(self.docs)},
                            {"role": "user", "content": self.prompt(rng)[-60:]}]  # fmt: skip
        structured = rng.random() < 0.35
        if structured:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "person", "schema": SCHEMA}}  # fmt: skip
            body["max_tokens"] = 48
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        kind = "http_chat_json" if structured else "http_chat"
        if not structured and rng.random() < 0.5:
            cut = rng.randint(1, 4) if rng.random() < 0.3 else None
            self._stream(h, "http_chat_stream", "/v1/chat/completions", body | {"stream": True},
                         cut)  # fmt: skip
            return
        r = h.post("/v1/chat/completions", json=body)
        if not self._status(kind, r):
            return
        choices = r.json()["choices"]
        if len(choices) != body["n"]:
            self.count(kind, "bad_answer", f"{len(choices)} choices")
            return
        if structured:
            for c in choices:
                if c["finish_reason"] != "stop":
                    continue  # cut by max_tokens: a prefix of valid JSON
                try:
                    obj = json.loads(c["message"]["content"])
                    ok = isinstance(obj, dict) and {"name", "age"} <= obj.keys()
                except ValueError:
                    ok = False
                if not ok:
                    self.count(kind, "bad_json", repr(c["message"]["content"][:200]))
                    return
        self.count(kind, "ok")

    def raw_half_body(self, rng: random.Random) -> None:
        """A request whose body stops part way, then the socket closes."""
        body = json.dumps({"model": self.base_model, "prompt": self.prompt(rng),
                           "max_tokens": 8}).encode()  # fmt: skip
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        with socket.create_connection(("127.0.0.1", self.srv.http_port), timeout=10) as s:
            s.sendall(head + body[: rng.randint(0, len(body) - 1)])
            time.sleep(rng.random() * 0.2)
        self.count("http_half_body", "disconnected")

    # -- ZeroMQ traffic
    def zmq_client(self, seed: int) -> None:
        rng = random.Random(seed)
        c = Client(self.srv.endpoint, timeout=self.args.timeout)
        n_req = 0
        while not self.stop.is_set():
            n_req += 1
            kind = "zmq"
            sampling: dict = {"max_tokens": rng.randint(4, 40), "n": rng.choice([1, 1, 2, 3]),
                              "priority": rng.choice(PRIORITIES)}  # fmt: skip
            if rng.random() < 0.5:
                sampling.update(temperature=0.0)
            else:
                sampling.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 30))
            if rng.random() < 0.3:
                sampling["logprobs"] = rng.randint(0, 3)
            lora = ADAPTER if rng.random() < 0.3 else None
            prompt = self.prompt(rng)
            roll = rng.random()
            try:
                if roll < 0.15:
                    kind = "zmq_json"
                    sampling.update(structured=StructuredOutput.json(SCHEMA), max_tokens=48)
                    out = c.generate(prompt, lora=lora, **sampling)
                    for res in out if isinstance(out, list) else [out]:
                        if res.finish_reason == "stop":
                            try:
                                obj = json.loads(res.text)
                                ok = isinstance(obj, dict) and {"name", "age"} <= obj.keys()
                            except ValueError:
                                ok = False
                            if not ok:
                                self.count(kind, "bad_json", repr(res.text[:200]))
                                break
                    else:
                        self.count(kind, "ok")
                elif roll < 0.30:
                    kind = "zmq_stream_abort"
                    rid = f"soak{seed}-{n_req}"
                    reasons = []
                    for i, chunk in enumerate(
                        c.generate_stream(prompt, request_id=rid, lora=lora, **sampling)
                    ):
                        if i == 1:
                            c.abort(rid)
                        if chunk.finish_reason is not None:
                            reasons.append(chunk.finish_reason)
                    self.count(kind, "aborted" if "abort" in reasons else "ok")
                elif roll < 0.40:
                    kind = "zmq_stream_close"
                    it = c.generate_stream(prompt, lora=lora, **sampling)
                    next(it, None)
                    it.close()  # closing the iterator aborts the request
                    self.count(kind, "aborted")
                elif roll < 0.47:
                    kind = "zmq_abandon"
                    it = c.generate_stream(prompt, lora=lora, **sampling)
                    next(it, None)
                    c.close()  # the client goes away mid-request
                    with contextlib.suppress(Exception):  # its abort has no socket left
                        it.close()
                    c = Client(self.srv.endpoint, timeout=self.args.timeout)
                    self.count(kind, "disconnected")
                elif roll < 0.70:
                    kind = "zmq_stream"
                    for _ in c.generate_stream(prompt, lora=lora, **sampling):
                        pass
                    self.count(kind, "ok")
                else:
                    out = c.generate(prompt, lora=lora, **sampling)
                    got = len(out) if isinstance(out, list) else 1
                    if got != sampling["n"]:
                        self.count(kind, "bad_answer", f"{got} results for n={sampling['n']}")
                    else:
                        self.count(kind, "ok")
            except RequestTimeout as e:
                self.count(kind, "hang", str(e)[:200])
            except ConnectionLost as e:
                self.gone_or(kind, "conn_error", str(e)[:200])
                c.close()
                if self.stop.wait(0.5) or self.down():
                    return
                c = Client(self.srv.endpoint, timeout=self.args.timeout)
            except ServerError as e:
                if self.down():
                    self.count(kind, "server_gone")
                else:
                    self.count(kind, "error", str(e)[:200])
            except Exception as e:  # noqa: BLE001 (counted: a failure of the soak)
                self.count(kind, "exception", repr(e)[:200])
                self.stop.wait(0.5)
        c.close()

    # -- floods
    def flood_loop(self) -> None:
        next_at = time.monotonic() + self.args.flood_first
        while not self.stop.wait(max(0.0, next_at - time.monotonic())):
            if self.crashed.is_set():
                return
            self.flood()
            next_at = time.monotonic() + self.args.flood_every

    def flood(self) -> None:
        a = self.args
        size = a.flood_sizes[len(self.floods) % len(a.flood_sizes)]
        row: dict = {"t": time.monotonic(), "opened": Counter(), "failed": Counter()}
        zc = Client(self.srv.endpoint, timeout=a.probe_timeout)
        hc = httpx.Client(base_url=self.srv.http_url, timeout=a.probe_timeout)
        try:  # connect both probes before the flood
            zc.health()
            hc.get("/health")
        except (ServerError, RequestTimeout, httpx.HTTPError) as e:
            row["setup"] = repr(e)[:120]
        socks: dict[str, list[socket.socket]] = {"zmq": [], "http": []}

        def open_many(name: str, port: int) -> None:
            """Up to ``size`` connections; a server that refuses or stops accepting ends
            it sooner (20 failures in a row, or 30 s)."""
            in_a_row, until = 0, time.monotonic() + 30
            for _ in range(size):
                if in_a_row >= 20 or time.monotonic() > until:
                    row["failed"][f"{name} gave up"] += 1
                    return
                try:
                    socks[name].append(socket.create_connection(("127.0.0.1", port), timeout=3))
                    in_a_row = 0
                except OSError as e:
                    row["failed"][f"{name} {type(e).__name__}"] += 1
                    in_a_row += 1

        self.flooding.set()
        t0 = time.monotonic()
        openers = [threading.Thread(target=open_many, args=("zmq", self.srv.zmq_port)),
                   threading.Thread(target=open_many, args=("http", self.srv.http_port))]  # fmt: skip
        for t in openers:
            t.start()
        for t in openers:
            t.join()
        row["open_s"] = time.monotonic() - t0
        row["opened"] = {k: len(v) for k, v in socks.items()}
        probes: dict[str, str] = {}

        def probe(name: str, fn) -> None:  # noqa: ANN001
            t = time.monotonic()
            try:
                fn()
                probes[name] = f"ok {time.monotonic() - t:.1f}s"
            except Exception as e:  # noqa: BLE001 (reported)
                probes[name] = f"FAIL {type(e).__name__}"

        body = {"model": self.base_model, "prompt": "Hello", "max_tokens": 2}

        def http_post(client: httpx.Client) -> None:
            r = client.post("/v1/completions", json=body)
            with self.lock:
                self.status[r.status_code] += 1
                if r.status_code != 200 and self.down():
                    self.status_down[r.status_code] += 1
            r.raise_for_status()

        def new_http() -> None:
            with httpx.Client(base_url=self.srv.http_url, timeout=a.probe_timeout) as c:
                http_post(c)

        def new_zmq() -> None:
            with Client(self.srv.endpoint, timeout=a.probe_timeout) as c:
                c.generate("Hello", max_tokens=2)

        threads = [
            threading.Thread(target=probe, args=(n, f), daemon=True)
            for n, f in [
                ("zmq", lambda: zc.generate("Hello", max_tokens=2)),
                ("http", lambda: http_post(hc)),
                ("zmq_new", new_zmq),
                ("http_new", new_http),
            ]  # fmt: skip
        ]
        for t in threads:
            t.start()
        time.sleep(a.flood_hold)
        for t in threads:
            t.join(a.probe_timeout + 5)
        for name in ("zmq", "http", "zmq_new", "http_new"):
            probes.setdefault(name, "FAIL hung")
        row["probes"] = probes
        row["held_s"] = time.monotonic() - t0
        closed = Counter()
        for name, lst in socks.items():
            for s in lst:
                try:
                    s.setblocking(False)
                    if s.recv(1, socket.MSG_PEEK) == b"":
                        closed[name] += 1
                except BlockingIOError:
                    pass
                except OSError:
                    closed[name] += 1
                s.close()
        row["closed_by_server"] = dict(closed)
        self.flooding.clear()
        zc.close()
        hc.close()
        with self.lock:
            self.floods.append(row)
        print(f"  flood {len(self.floods)}: opened {row['opened']} in {row['open_s']:.1f} s, "
              f"failed {dict(row['failed']) or 0}, closed by the server {dict(closed) or 0}, "
              f"probes {probes}", flush=True)  # fmt: skip


def fmt_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def server_cmd(args: argparse.Namespace, adapter: str, disk: str) -> list[str]:
    return [sys.executable, "-m", "radixserve", "launch", "--port", "0", "--http-port", "0",
            "--num-pages", str(args.num_pages), "--host-cache-gb", str(args.host_cache_gb),
            "--disk-cache-dir", disk, "--disk-cache-gb", str(args.disk_cache_gb),
            "--schedule-policy", "priority", "--speculative-algorithm", "ngram",
            "--lora-modules", f"{ADAPTER}={adapter}", "--max-running-requests", "16",
            "--log-level", "warning", "--exit-with-parent", *args.server_args.split()]  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--http-clients", type=int, default=3)
    p.add_argument("--zmq-clients", type=int, default=2)
    p.add_argument("--num-pages", type=int, default=1200, help="KV pool (page size 1): small")
    p.add_argument("--host-cache-gb", type=float, default=0.05, help="~2,300 pages of SmolLM2")
    p.add_argument("--disk-cache-gb", type=float, default=0.5)
    p.add_argument("--docs", type=int, default=24,
                   help="distinct documents prompts start with (~7,000 tokens in all)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=300.0, help="a request past it is a hang")
    p.add_argument("--flood-every", type=float, default=180.0)
    p.add_argument("--flood-first", type=float, default=30.0)
    p.add_argument("--flood-conns", default="2000,7000",
                   help="connections per port, floods taking these sizes in turn")  # fmt: skip
    p.add_argument("--flood-hold", type=float, default=5.0)
    p.add_argument("--probe-timeout", type=float, default=120.0)
    p.add_argument("--rss-every", type=float, default=10.0)
    p.add_argument("--rss-slope-max", type=float, default=25.0, help="MiB/hour, 2nd half")
    p.add_argument("--rss-range-max", type=float, default=64.0, help="MiB, 2nd half")
    p.add_argument("--rss-min-minutes", type=float, default=20.0)
    p.add_argument("--server-args", default="", help="more launch flags")
    p.add_argument("--keep", action="store_true", help="keep the temporary dir (logs)")
    p.add_argument("--write-adapter", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.write_adapter:
        write_adapter(args.write_adapter)
        return 0
    try:
        args.flood_sizes = [int(x) for x in args.flood_conns.split(",")]
    except ValueError:
        p.error(f"--flood-conns: a comma-separated list of integers, not {args.flood_conns!r}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * max(args.flood_sizes) + 512
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))
    if (have := resource.getrlimit(resource.RLIMIT_NOFILE)[0]) < need:
        cap = (have - 512) // 2
        print(f"note: the descriptor limit ({have}) caps floods at {cap} connections per port")
        args.flood_sizes = [min(cap, x) for x in args.flood_sizes]
    tmp = tempfile.mkdtemp(prefix="soak-mixed-")
    try:
        return run(args, tmp)
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: str) -> int:
    adapter, disk, log_path = f"{tmp}/adapter", f"{tmp}/disk", f"{tmp}/server.log"
    os.makedirs(disk)
    subprocess.run([sys.executable, __file__, "--write-adapter", adapter], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    cmd = server_cmd(args, adapter, disk)
    print("server: " + " ".join(cmd[1:]), flush=True)
    t_launch = time.monotonic()
    srv = Server(cmd, log_path)
    with httpx.Client(base_url=srv.http_url, timeout=60) as h:
        base_model = h.get("/v1/models").json()["data"][0]["id"]
    print(f"up in {time.monotonic() - t_launch:.0f} s: {srv.endpoint}, {srv.http_url}, "
          f"pids {srv.pids}", flush=True)  # fmt: skip
    procs = {"launcher": srv.proc.pid, **srv.pids}
    soak = Soak(args, srv, base_model)
    threads = [threading.Thread(target=soak.http_client, args=(i,), daemon=True)
               for i in range(args.http_clients)]  # fmt: skip
    threads += [threading.Thread(target=soak.zmq_client, args=(100 + i,), daemon=True)
                for i in range(args.zmq_clients)]  # fmt: skip
    flooder = threading.Thread(target=soak.flood_loop, daemon=True)
    t0 = time.monotonic()
    for t in [*threads, flooder]:
        t.start()
    times: list[float] = []
    rss: dict[str, list[float | None]] = {k: [] for k in procs}
    end = t0 + args.minutes * 60
    next_sample, next_report = t0, t0 + 60
    crash_rc = None
    while time.monotonic() < end:
        now = time.monotonic()
        if now >= next_sample:
            times.append(now - t0)
            for k, pid in procs.items():
                rss[k].append(rss_mib(pid))
            next_sample += args.rss_every
        if now >= next_report:
            with soak.lock:
                outcomes = Counter(soak.outcomes)
            done = sum(n for (_, o), n in outcomes.items() if o == "ok")
            print(f"  {(now - t0) / 60:.0f} min: {sum(outcomes.values())} requests "
                  f"({done} ok), RSS worker {rss['worker'][-1] or 0:.0f} MiB", flush=True)  # fmt: skip
            next_report += 60
        if (crash_rc := srv.proc.poll()) is not None:
            soak.crashed.set()
            print(f"  CRASH at {(now - t0) / 60:.1f} min: the launcher exited with {crash_rc}",
                  flush=True)  # fmt: skip
            break
        time.sleep(0.5)
    soak.stop.set()
    join_by = time.monotonic() + (10 if soak.crashed.is_set() else args.timeout + 30)
    for t in [*threads, flooder]:
        t.join(max(0.1, join_by - time.monotonic()))
    hung_threads = sum(t.is_alive() for t in [*threads, flooder])
    ran_s = time.monotonic() - t0
    checks: list[tuple[str, bool, str]] = []
    idle_msg, pages_msg, stats = "not checked (server gone)", "not checked", {}
    idle_ok = pages_ok = False
    if srv.proc.poll() is None:
        try:
            with Client(srv.endpoint, timeout=120) as c:
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    st = c.stats()
                    if st["running"] == st["waiting"] == st["in_flight"] == 0 and not st.get(
                        "copies_in_flight"
                    ):
                        break
                    time.sleep(0.2)
                check = c.check()
                idle_ok = bool(check["ok"])
                stats = c.stats()
                idle_msg = check["error"] or (
                    f"holds: pool pages free {stats['pages_free']} + held by the tree "
                    f"{stats['pages_cached']} = {stats['num_pages']}"
                )
                freed = c.flush_cache()
                after = c.stats()
                pages_ok = (after["pages_free"] == after["num_pages"]
                            and after.get("host_pages_cached", 0) == 0
                            and after.get("disk_pages_cached", 0) == 0)  # fmt: skip
                pages_msg = (f"flush freed {freed}: pool free {after['pages_free']}/"
                             f"{after['num_pages']}, host tier {after.get('host_pages_cached')}, "
                             f"disk tier {after.get('disk_pages_cached')}")  # fmt: skip
        except (ServerError, RequestTimeout) as e:
            idle_msg = f"the check failed: {e}"
    crashed = crash_rc is not None or srv.proc.poll() is not None
    if crashed and crash_rc is None:
        crash_rc = srv.proc.returncode
    exit_rc, left = crash_rc, []
    if not crashed:
        srv.proc.send_signal(signal.SIGTERM)
        try:
            exit_rc = srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            exit_rc = None
    deadline = time.monotonic() + 15
    while (left := srv.survivors()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in srv.pids.values():  # whatever is left goes now
        if running(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if srv.proc.poll() is None:
        srv.proc.kill()

    # -- report
    a = args
    print(f"\nsoak_mixed: {ran_s / 60:.1f} of {a.minutes:g} min, {a.http_clients} HTTP + "
          f"{a.zmq_clients} ZeroMQ clients, {a.num_pages} KV pages, host tier "
          f"{a.host_cache_gb:g} GB, disk tier {a.disk_cache_gb:g} GB, priority scheduling, "
          f"ngram speculation, LoRA '{ADAPTER}'; log {log_path}")  # fmt: skip
    kinds = sorted({k for k, _ in soak.outcomes})
    outs = sorted({o for _, o in soak.outcomes})
    rows = [[k, *(soak.outcomes[k, o] or "" for o in outs), sum(soak.outcomes[k, o] for o in outs)]
            for k in kinds]  # fmt: skip
    rows.append(["all", *(sum(soak.outcomes[k, o] for k in kinds) for o in outs),
                 sum(soak.outcomes.values())])  # fmt: skip
    print("\nrequests by kind and outcome\n" + fmt_table(["kind", *outs, "total"], rows))
    print("\nHTTP status: " + ", ".join(f"{s}: {n}" for s, n in sorted(soak.status.items()))
          + (f" (answered while a process was down: {dict(soak.status_down)})"
             if soak.status_down else ""))  # fmt: skip
    if soak.problems:
        print("unexpected answers (first ones):\n  " + "\n  ".join(soak.problems[:15]))
    fail_outcomes = {"5xx", "4xx", "3xx", "1xx", "stream_error", "bad_json", "bad_answer",
                     "error", "conn_error", "hang", "exception"}  # fmt: skip
    bad = {o: sum(soak.outcomes[k, o] for k in kinds) for o in outs if o in fail_outcomes}
    n5xx = sum(n for s, n in soak.status.items() if s >= 500)
    hangs = bad.pop("hang", 0) + hung_threads
    if soak.floods:
        frows = []
        for i, f in enumerate(soak.floods, 1):
            frows.append([i, f"{(f['t'] - t0) / 60:.1f}", f"{f['opened'].get('zmq', 0)}",
                          f"{f['opened'].get('http', 0)}", f"{f['open_s']:.1f}",
                          dict(f["failed"]) or 0, f["closed_by_server"] or 0,
                          f"{f['held_s']:.1f}", f["probes"]["zmq"], f["probes"]["http"],
                          f["probes"]["zmq_new"], f["probes"]["http_new"]])  # fmt: skip
        print("\nfloods\n" + fmt_table(
            ["#", "at min", "zmq conns", "http conns", "open s", "connect failures",
             "closed by server", "held s", "probe zmq", "probe http", "new zmq (info)",
             "new http (info)"], frows))  # fmt: skip
    probes_failed = sum(f["probes"][n].startswith("FAIL") for f in soak.floods
                        for n in ("zmq", "http"))  # fmt: skip
    print(f"\nfloods run {len(soak.floods)}, probes over held connections failed {probes_failed}")
    print(f"crashes {int(crashed)}" + (f" (launcher exit code {crash_rc})" if crashed else ""))
    if crashed:
        print("server log, last lines:\n" + tail(log_path))
    print(f"hangs {hangs} (requests past {a.timeout:g} s, and threads still running)")
    if stats:
        keys = ["steps", "preemptions", "priority_preemptions", "evicted_pages", "pages_demoted",
                "pages_promoted", "pages_loaded", "pages_written", "hit_tokens_l2",
                "hit_tokens_l3", "host_pages", "host_pages_cached", "disk_pages_cached",
                "disk_pages_max", "spec_draft_tokens", "spec_accepted_tokens"]  # fmt: skip
        print("scheduler: " + ", ".join(f"{k} {stats[k]}" for k in keys if k in stats))
    print(f"idle check: {idle_msg}")
    print(f"pages at the end: {pages_msg}")
    print(f"shutdown: launcher exit {exit_rc}, left {left or 'nothing'}")

    # RSS curve and verdict
    n = len(times)
    idx = sorted({round(i * (n - 1) / min(30, max(1, n - 1))) for i in range(min(31, n))})
    names = list(procs)
    print("\nRSS MiB\n" + fmt_table(["min", *names], [
        [f"{times[i] / 60:.1f}", *(f"{rss[k][i]:.0f}" if rss[k][i] is not None else "-"
                                   for k in names)] for i in idx]))  # fmt: skip
    judged = ran_s >= a.rss_min_minutes * 60 and not crashed
    rss_ok = True
    vrows = []
    for k in names:
        pts = [(t, x) for t, x in zip(times[n // 2 :], rss[k][n // 2 :]) if x is not None]
        if len(pts) < 2:
            continue
        ts, xs = zip(*pts)
        sl, rng_ = 60 * slope_per_min(list(ts), list(xs)), max(xs) - min(xs)
        flat = abs(sl) <= a.rss_slope_max and rng_ <= a.rss_range_max
        rss_ok &= flat or not judged
        vrows.append([k, f"{sl:+.1f}", f"{rng_:.0f}",
                      ("flat" if flat else "NOT FLAT") if judged else "not judged"])  # fmt: skip
    print(f"\nRSS over the second half (warm-up: the first half), flat = |slope| <= "
          f"{a.rss_slope_max:g} MiB/h and max-min <= {a.rss_range_max:g} MiB"
          + ("" if judged else f" (not judged: run under {a.rss_min_minutes:g} min or crashed)")
          + "\n" + fmt_table(["process", "slope MiB/h", "max-min MiB", "verdict"], vrows))  # fmt: skip

    checks = [
        ("no crash", not crashed, f"exit code {crash_rc}" if crashed else ""),
        (
            "no 5xx",
            n5xx == 0,
            f"{n5xx}, {sum(v for k, v in soak.status_down.items() if k >= 500)}"
            " of them while a process was down",
        ),
        ("no unexpected answer", not any(bad.values()), str({k: v for k, v in bad.items() if v})),
        ("no hang", hangs == 0, str(hangs)),
        (
            "floods answered",
            probes_failed == 0 and (a.minutes * 60 < a.flood_first or bool(soak.floods)),
            f"{probes_failed} failed of {2 * len(soak.floods)}",
        ),  # fmt: skip
        ("idle check", idle_ok, idle_msg if not idle_ok else ""),
        ("every page free", pages_ok, pages_msg if not pages_ok else ""),
        ("RSS flat", rss_ok, "" if judged else "not judged"),
        ("clean shutdown", crashed or (exit_rc == 0 and not left), f"{exit_rc} {left}"),
    ]
    print("\nchecks")
    for name, ok, why in checks:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}" + (f"  ({why})" if why else ""))
    ok = all(c[1] for c in checks)
    print("\nsoak_mixed: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

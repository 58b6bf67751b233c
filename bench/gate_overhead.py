"""What the routing-id gate (radixserve/utils/zmtp_gate.py) costs a ZeroMQ client.

An echo ROUTER and the gate in front of it run in a process of their own (as the
tokenizer's ROUTER and gate do: the gate's thread shares that process with the
ROUTER's loop); the clients run here. The ROUTER is reached directly on its ipc
endpoint (as the HTTP front reaches the tokenizer), directly on TCP, and on TCP
through the gate (its Python relay, and its native one where built); and the
gate's own ZMTP server (``zmtp``: no ROUTER behind it, as the tokenizer serves NULL
TCP clients where it is built) is echoed by the same loop; side by side
in one run, interleaved trial by trial: round trips
of small messages (a request's or a chunk's size), of 1 MiB and 6 MiB ones (long
prompts), and one-way streams of small messages (a stream's chunks). Prints
per-operation times (the best of ``--trials``), the gate's ratios to ipc, and the
native relay's and the ZMTP server's to direct TCP. A second table gives the server process's CPU time per operation
(all its threads, ``/proc/PID/task/*/schedstat``), which a loaded machine disturbs
far less than wall time: the gate's own cost is the difference to ipc.

    python bench/gate_overhead.py [--trials 5] [--busy]

``--busy`` adds a thread to the server process that runs Python without pause, as
the tokenizer's loop does under load: the Python relay then waits for the GIL at
every hop, the native one never takes it.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import tempfile
import threading
import time

import zmq


def spin(stop) -> None:
    """Pure Python work without pause, holding the GIL as a busy tokenizer's loop does
    (tokenizing, detokenizing, msgpack)."""
    x = 0
    while not stop.is_set():
        for i in range(10_000):
            x = (x + i * i) % 1_000_003


def serve(path: str, ready, stop, busy: bool) -> None:
    """The echo ROUTER on ``ipc://path`` and on a TCP port, and the gate; sends their
    endpoints through ``ready``, echoes until ``stop`` is set."""
    from radixserve.utils import zmtp_gate
    from radixserve.utils.zmtp_gate import RoutingIdGate

    native_relay = getattr(zmtp_gate, "native_relay", None)  # None: a gate without one
    try:
        from radixserve.utils.zmtp_server import ZmtpServer, built
    except ImportError:  # a checkout from before the ZMTP server
        ZmtpServer, built = None, lambda: False  # noqa: N806

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 0)
    router.setsockopt(zmq.RCVHWM, 0)
    router.bind("ipc://" + path)
    tcp = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    python_only = {"native": False} if native_relay is not None else {}
    gates = {"py": RoutingIdGate("127.0.0.1", 0, path, **python_only).start()}
    if native_relay is not None:
        gates["C"] = RoutingIdGate("127.0.0.1", 0, path, native=True).start()
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    server = None
    if built():
        # As the ROUTER here: no high-water marks; and as the tokenizer's: heartbeats.
        unbounded = {"max_queued": 1 << 30, "max_unread": 1 << 30}
        server = ZmtpServer(**unbounded, heartbeat_ivl_ms=1000, heartbeat_timeout_ms=3000)
        gates["zmtp"] = RoutingIdGate("127.0.0.1", 0, None, server=server).start()
        poller.register(server.fd, zmq.POLLIN)
    if busy:
        threading.Thread(target=spin, args=(stop,), daemon=True).start()
    ready.send({"ipc": "ipc://" + path, "tcp": tcp} | {k: g.endpoint for k, g in gates.items()})
    while not stop.is_set():
        events = dict(poller.poll(100))
        if router in events:
            while True:
                try:
                    router.send_multipart(router.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
        if server is not None and server.fd in events:
            for rid, frames in server.take():
                if frames is not None:
                    server.send(rid, frames)
    for gate in gates.values():
        gate.close()
    ctx.destroy(linger=0)


def cpu_ns(pid: int) -> int:
    """CPU time (ns) the threads of process ``pid`` have had (Linux schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
            total += int(f.read().split()[0])
    return total


def client(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.SNDHWM, 0)
    d.setsockopt(zmq.RCVHWM, 0)
    d.connect(endpoint)
    d.send(b"hello")
    d.recv()  # connected
    return d


def round_trips(ctx: zmq.Context, endpoint: str, payload: bytes, n: int) -> float:
    d = client(ctx, endpoint)
    start = time.perf_counter()
    for _ in range(n):
        d.send(payload, copy=False)
        d.recv(copy=False)
    spent = time.perf_counter() - start
    d.close(0)
    return spent / n


def stream(ctx: zmq.Context, endpoint: str, payload: bytes, n: int) -> float:
    d = client(ctx, endpoint)
    start = time.perf_counter()
    for _ in range(n):
        d.send(payload)
    for _ in range(n):
        d.recv()
    spent = time.perf_counter() - start
    d.close(0)
    return spent / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--small", type=int, default=2000, help="small round trips per trial")
    ap.add_argument(
        "--busy",
        action="store_true",
        help="a thread of the server process runs Python without pause (a busy tokenizer)",
    )
    args = ap.parse_args()
    path = os.path.join(tempfile.mkdtemp(prefix="rs-"), "pub")
    mpc = mp.get_context("spawn")
    ready_r, ready_w = mpc.Pipe(duplex=False)
    stop = mpc.Event()
    server = mpc.Process(target=serve, args=(path, ready_w, stop, args.busy), daemon=True)
    server.start()
    endpoints = ready_r.recv()
    ctx = zmq.Context()
    cases = [
        ("round trip, 200 B", round_trips, bytes(200), args.small),
        ("round trip, 1 MiB", round_trips, bytes(1 << 20), 100),
        ("round trip, 6 MiB", round_trips, bytes(6 << 20), 30),
        ("stream, 200 B each", stream, bytes(200), 5000),
    ]
    # ipc, tcp, py (the Python relay), C (the native one), zmtp (the ZMTP server)
    kinds = list(endpoints)
    cpu = {}  # (case, kind) -> the server process's CPU time per operation, best trial
    head = f"{'case':<22}" + "".join(f"{k + ' us':>10}" for k in kinds)
    head += "".join(f"{k + '/ipc':>10}" for k in kinds[2:])
    native = [k for k in ("C", "zmtp") if k in kinds]
    print("wall time per operation (best of the trials)")
    print(head + "".join(f"{k + '/tcp':>10}" for k in native))
    for name, fn, payload, n in cases:
        best = dict.fromkeys(kinds, 1e9)
        for _ in range(args.trials):  # interleaved, so a noisy moment hits each alike
            for key in kinds:
                before = cpu_ns(server.pid)
                best[key] = min(best[key], fn(ctx, endpoints[key], payload, n))
                spent = (cpu_ns(server.pid) - before) / n / 1e3
                cpu[name, key] = min(cpu.get((name, key), 1e9), spent)
        row = f"{name:<22}" + "".join(f"{best[k] * 1e6:>10.1f}" for k in kinds)
        row += "".join(f"{best[k] / best['ipc']:>10.2f}" for k in kinds[2:])
        row += "".join(f"{best[k] / best['tcp']:>10.2f}" for k in native)
        print(row, flush=True)
    print("\nCPU time of the server process (echo ROUTER + gates) per operation, us")
    print(f"{'case':<22}" + "".join(f"{k:>10}" for k in kinds)
          + "".join(f"{k + '-ipc':>10}" for k in kinds[2:]))  # fmt: skip
    for name, *_ in cases:
        row = f"{name:<22}" + "".join(f"{cpu[name, k]:>10.1f}" for k in kinds)
        row += "".join(f"{cpu[name, k] - cpu[name, 'ipc']:>10.1f}" for k in kinds[2:])
        print(row)
    stop.set()
    server.join(10)
    ctx.destroy(linger=0)


if __name__ == "__main__":
    main()

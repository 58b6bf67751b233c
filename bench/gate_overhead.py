"""What the routing-id gate (radixserve/utils/zmtp_gate.py) costs a ZeroMQ client.

An echo ROUTER in a thread, reached directly on TCP and through the gate, side by
side in one run: round trips of small messages (a request's or a chunk's size) and
of 1 MiB ones (a long prompt), and one-way streams of small messages (a stream's
chunks). Prints per-operation times and gate/direct ratios.

    python bench/gate_overhead.py [--trials 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import zmq

from radixserve.utils.zmtp_gate import RoutingIdGate


def echo(router: zmq.Socket, stop: threading.Event) -> None:
    while not stop.is_set():
        if router.poll(100):
            router.send_multipart(router.recv_multipart())


def round_trips(endpoint: str, payload: bytes, n: int) -> float:
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    d.send(payload)
    d.recv()  # connected
    start = time.perf_counter()
    for _ in range(n):
        d.send(payload)
        d.recv()
    spent = time.perf_counter() - start
    d.close(0)
    return spent / n


def stream(endpoint: str, payload: bytes, n: int) -> float:
    ctx = zmq.Context.instance()
    d = ctx.socket(zmq.DEALER)
    d.connect(endpoint)
    d.send(payload)
    d.recv()
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
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    path = os.path.join(tempfile.mkdtemp(prefix="rs-"), "pub")
    router.bind("ipc://" + path)
    direct = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    gate = RoutingIdGate("127.0.0.1", 0, path).start()
    stop = threading.Event()
    threading.Thread(target=echo, args=(router, stop), daemon=True).start()
    cases = [
        ("round trip, 200 B", round_trips, bytes(200), 2000),
        ("round trip, 1 MiB", round_trips, bytes(1 << 20), 100),
        ("stream, 200 B each", stream, bytes(200), 5000),
    ]
    print(f"{'case':<22}{'direct us':>12}{'gate us':>12}{'gate/direct':>13}")
    for name, fn, payload, n in cases:
        d = min(fn(direct, payload, n) for _ in range(args.trials))
        g = min(fn(gate.endpoint, payload, n) for _ in range(args.trials))
        print(f"{name:<22}{d * 1e6:>12.1f}{g * 1e6:>12.1f}{g / d:>13.2f}")
    stop.set()
    gate.close()


if __name__ == "__main__":
    main()

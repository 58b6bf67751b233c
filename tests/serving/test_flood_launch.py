"""A server whose descriptor limit is 256, flooded on its ZeroMQ and HTTP ports with
many times that many connections: every process lives, clients are answered
during and after, and the descriptors return to their count before the flood.

Without the connection limits the tokenizer (its gate) and then the HTTP front
(asyncio's accept loop) ran out of descriptors and libzmq aborted them
(``Too many open files (src/ipc_listener.cpp)``).
"""

from __future__ import annotations

import http.client
import os
import socket
import sys
import time

import pytest

from radixserve.client import Client
from tests.helpers.server import Server
from tests.serving.conftest import SERVER_ARGS

# Runs the launcher with RLIMIT_NOFILE 256, soft and hard: every process inherits it.
LOW_LIMIT = [
    sys.executable,
    "-c",
    "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
    "os.execvp(sys.argv[1], sys.argv[1:])",
]
FLOOD = 1500  # per port


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def http_status(port: int, source: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    try:
        conn.request("GET", "/v1/models")
        return conn.getresponse().status
    finally:
        conn.close()


def open_flood(port: int) -> list[socket.socket]:
    socks = []
    for _ in range(FLOOD):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.timeout(240)
def test_a_connection_flood_at_a_low_descriptor_limit_stops_no_process(model_dir):
    srv = Server(model_dir, *SERVER_ARGS, "--http-port", "0", wrapper=LOW_LIMIT)
    try:
        port = int(srv.endpoint.rsplit(":", 1)[1])
        http_port = int(srv.http_url.rsplit(":", 1)[1])
        pids = {k: srv.pids[k] for k in ("tokenizer", "http")}
        before = {k: descriptors(p) for k, p in pids.items()}
        established = Client(srv.endpoint, timeout=60)
        assert established.generate("hello")
        flood = open_flood(port) + open_flood(http_port)
        time.sleep(1)  # the flood is accepted (and mostly refused) by now
        assert established.generate("during")
        assert http_status(http_port, "127.0.0.2") == 200
        with Client(f"tcp://127.0.0.2:0;127.0.0.1:{port}", timeout=60) as newcomer:
            assert newcomer.generate("a new client during the flood")
        for s in flood:
            s.close()
        assert http_status(http_port, "127.0.0.1") == 200
        established.close()
        deadline = time.monotonic() + 30  # liveness: closes are noticed at once
        while time.monotonic() < deadline:
            now = {k: descriptors(p) for k, p in pids.items()}
            if now == before:
                break
            time.sleep(0.1)
        assert now == before
        with Client(srv.endpoint, timeout=60) as after:
            assert after.generate("after")
        assert srv.proc.poll() is None
        assert all(os.path.exists(f"/proc/{p}") for p in srv.pids.values())
    finally:
        assert srv.stop() == 0

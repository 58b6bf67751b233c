"""Prefill/decode disaggregation with real servers, one command:
``radixserve launch --pd 1,1`` starts a prefill and a decode server and the router in
its PD mode.

Greedy tokens equal the Engine's; a turn whose history the decode server holds has
only its new pages sent; a prefill server whose worker hangs (stopped) answers no
pull: every request is still answered, prefilled by the decode server once its pull
times out, and no page leaks; once that worker is killed, requests are still answered. The transfer engines' ports listen on loopback only
(``--kv-transfer-host``'s default).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from radixserve.client import Client  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.server import REPO_ROOT, wait_idle  # noqa: E402
from tests.serving.test_router import wait_until  # noqa: E402

PAGE = 4


def launch_pd(model_dir) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--pd", "1,1", "--model",
           str(model_dir), "--port", "0", "--num-pages", "256", "--page-size", str(PAGE),
           "--chunked-prefill-size", "64", "--dtype", "float64", "--kv-transfer-timeout", "1",
           "--log-level", "warning", "--exit-with-parent"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    info: dict = {}
    for line in proc.stdout:  # type: ignore[union-attr]
        if m := re.search(r"serving on (\S+)", line):
            info["endpoint"] = m.group(1)
        elif m := re.search(r"1 prefill and 1 decode servers \(\w+\): (\S+) (\S+)", line):
            info["prefill"], info["decode"] = m.group(1), m.group(2)
        elif "processes" in line:
            info["pids"] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
            break
    assert {"endpoint", "prefill", "decode"} <= set(info), f"exit code {proc.poll()}"
    return proc, info


@pytest.fixture(scope="module")
def pd(model_dir):
    proc, info = launch_pd(model_dir)
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def transfer_stats(endpoint: str) -> dict:
    with Client(endpoint, timeout=30) as c:
        return {k: v for k, v in c.stats().items() if k.startswith("kv_transfer")}


def test_outputs_equal_one_server_and_only_missing_pages_travel(pd, engine):
    rng = np.random.default_rng(5)
    history = rng.integers(5, 500, 60).tolist()
    with Client(pd["endpoint"], timeout=60) as c:
        first = c.generate(input_ids=history, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert first.token_ids == engine.generate([history], greedy(8))[0].token_ids
        before = transfer_stats(pd["decode"])
        assert before["kv_transfer_pages_sent"] == 59 // PAGE  # all but the last token
        # The next turn: the decode server holds the history, the rest is pulled.
        turn = history + first.token_ids + rng.integers(5, 500, 20).tolist()
        chunks = list(c.generate_stream(input_ids=turn, max_tokens=8, temperature=0.0,
                                        ignore_eos=True))  # fmt: skip
        got = [t for ch in chunks for t in ch.token_ids]
        assert got == engine.generate([turn], greedy(8))[0].token_ids
        after = transfer_stats(pd["decode"])
        held = (len(history) + 7) // PAGE  # the history and first answer's KV, whole pages
        assert after["kv_transfer_pages_skipped"] - before["kv_transfer_pages_skipped"] == held
        sent = (len(turn) - 1) // PAGE - held
        assert after["kv_transfer_pages_sent"] - before["kv_transfer_pages_sent"] == sent
        wait_idle(c)
        assert c.check() == {"ok": True, "error": None}


def listening_addresses(pid: int) -> list[str]:
    """The local addresses (hex, as /proc writes them) of ``pid``'s listening TCP sockets."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    found.append(cols[1].split(":")[0])
    return found


def test_the_transfer_engines_listen_on_loopback_only(pd):
    loopback = ("0100007F", "0000000000000000FFFF00000100007F")  # 127.0.0.1, ::ffff:127.0.0.1
    for name in ("dp0_worker", "dp1_worker"):
        addresses = listening_addresses(pd["pids"][name])
        assert len(addresses) >= 2, addresses  # the engine's handshake and data ports
        assert all(a in loopback for a in addresses), (name, addresses)


def test_a_hung_prefill_server_costs_a_timeout_not_an_answer_nor_a_page(pd, engine):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(5, 500, 90).tolist() for _ in range(2)]
    worker = pd["pids"]["dp0_worker"]  # the prefill server's
    with Client(pd["endpoint"], timeout=60) as c:
        os.kill(worker, signal.SIGSTOP)  # its pages never come
        start = time.monotonic()
        results = [
            c.generate(input_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True) for p in prompts
        ]
        assert time.monotonic() - start < 60
        for p, r in zip(prompts, results):
            assert r.token_ids == engine.generate([p], greedy(4))[0].token_ids
    with Client(pd["decode"], timeout=30) as d:
        stats = d.stats()
        assert stats["kv_transfer_fallbacks"] >= 1
        # The reserved pages come back once the quarantine (2 x the timeout) is over.
        wait_until(lambda: d.stats()["kv_transfer_quarantined_pages"] == 0, timeout=30,
                   what="quarantine over")  # fmt: skip
        wait_idle(d)
        assert d.check() == {"ok": True, "error": None}
    # Killed now: its server stops (the launcher starts it again later); meanwhile
    # the decode server prefills what it gets itself.
    os.kill(worker, signal.SIGKILL)
    with Client(pd["endpoint"], timeout=60) as c:
        r = c.generate(input_ids=prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert r.token_ids == engine.generate([prompts[0]], greedy(4))[0].token_ids

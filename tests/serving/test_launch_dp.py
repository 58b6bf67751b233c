"""``radixserve launch --dp 2 --http-port 0``: two replicas and a router, one command.

One launch for the module. The official ``openai`` client through the HTTP front
in front of the router gets what the ZeroMQ client gets through the router
(completions, streamed completions, chat), and a repeated prompt comes back with
cached tokens (it went to the replica holding it). Greedy tokens through the
router equal the Engine's; stats, /health and /metrics cover both replicas
(per-replica labels); a replica whose worker is killed is started again on its
port and routed to again, and the summed counters do not fall; SIGTERM stops
everything.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from radixserve import SamplingParams
from radixserve.client import Client
from tests.helpers.server import REPO_ROOT, _running, wait_idle


def launch_dp(model_dir) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "radixserve.cli", "launch", "--dp", "2", "--model",
           str(model_dir), "--port", "0", "--http-port", "0", "--num-pages", "64",
           "--page-size", "4", "--dtype", "float64", "--exit-with-parent"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    info: dict = {}
    for line in proc.stdout:  # type: ignore[union-attr]
        if m := re.search(r"serving on (\S+)", line):
            info["endpoint"] = m.group(1)
        elif m := re.search(r"http on (\S+)", line):
            info["url"] = m.group(1)
        elif "processes" in line:
            info["pids"] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}
            break
    assert "endpoint" in info and "url" in info, f"exit code {proc.poll()}"
    return proc, info


def wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def dp(model_dir):
    proc, info = launch_dp(model_dir)
    try:
        yield info
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    alive = [name for name, pid in info["pids"].items()
             if name != "dp1_worker" and _running(pid)]  # fmt: skip
    assert alive == []


def test_the_openai_client_through_the_router(dp):
    url, greedy = dp["url"] + "/v1", {"ignore_eos": True}
    prompt = "The quick brown fox jumps over the lazy dog, then runs"
    chat = [{"role": "user", "content": "What is a radix tree?"}]
    with (
        Client(dp["endpoint"], timeout=60) as c,
        openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as oai,
    ):
        wait_for(lambda: all(r["up"] for r in c.stats()["replicas"]))
        model = oai.models.list().data[0].id
        want = c.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
        one = oai.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=greedy
        )
        assert (one.choices[0].text, one.choices[0].finish_reason) == (want.text, "length")
        assert one.usage.prompt_tokens == want.usage.prompt_tokens
        # The same prompt again: routed to the replica that holds it.
        assert one.usage.prompt_tokens_details.cached_tokens > 0
        stream = oai.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                        stream=True, extra_body=greedy)  # fmt: skip
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want.text
        want_chat = c.generate(messages=chat, max_tokens=8, temperature=0, ignore_eos=True)
        reply = oai.chat.completions.create(
            model=model, messages=chat, max_tokens=8, temperature=0, extra_body=greedy
        )
        assert reply.choices[0].message.content == want_chat.text
        assert reply.usage.prompt_tokens == want_chat.usage.prompt_tokens
        wait_idle(c)


def test_launch_dp_serves_through_the_router_and_restarts_a_dead_replica(dp, engine):
    info = dp
    pids = info["pids"]
    with Client(info["endpoint"], timeout=60) as c:
        wait_for(lambda: all(r["mirror_seq"] >= 0 and r["up"] for r in c.stats()["replicas"]))
        prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13] + [20 + i] for i in range(4)]
        for ids in prompts + prompts:
            r = c.generate(input_ids=ids, max_tokens=5, temperature=0.0)
            want = engine.generate([ids], SamplingParams(max_tokens=5, temperature=0.0))
            assert r.token_ids == want[0].token_ids
        stats = c.stats()
        assert stats["hit_tokens"] > 0 and len(stats["replicas"]) == 2
        assert stats["query_tokens"] == sum(r["stats"]["query_tokens"]
                                            for r in stats["replicas"])  # fmt: skip
        with urllib.request.urlopen(info["url"] + "/health") as resp:
            assert resp.status == 200
        with urllib.request.urlopen(info["url"] + "/metrics") as resp:
            text = resp.read().decode()
        for row in stats["replicas"]:
            up = rf'radixserve:replica_up\{{model_name="[^"]+",replica="{row["endpoint"]}"\}} 1\.0'
            assert re.search(up, text), up
        # Kill one replica's worker: the launcher starts that replica again.
        queries = c.stats()["query_tokens"]
        os.kill(pids["dp1_worker"], signal.SIGKILL)
        wait_for(lambda: not c.stats()["replicas"][1]["up"], 30)
        wait_for(lambda: c.stats()["replicas"][1]["up"], 90)
        before = c.stats()["replicas"][1]["routed"]
        for i in range(4):
            c.generate(input_ids=[300 + i, 1, 2, 3, 4], max_tokens=2, temperature=0.0)
        stats = c.stats()
        assert stats["replicas"][1]["routed"] > before
        # The dead life's counters still count (router/totals.py).
        assert stats["query_tokens"] > queries
        wait_idle(c)
        assert c.check() == {"ok": True, "error": None}

"""Prefill/decode disaggregation with real servers: one ``--disaggregation prefill``
and one ``--disaggregation decode`` server, and the router in PD mode in this process.

Greedy tokens equal the Engine's; a turn whose history the decode server holds has
only its new pages sent; a prefill server whose worker hangs (stopped) answers no
pull: every request is still answered, prefilled by the decode server once its pull
times out, and no page leaks.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from radixserve.client import Client  # noqa: E402
from radixserve.router.policy import PolicyConfig  # noqa: E402
from radixserve.router.server import RouterConfig  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.server import Server, wait_idle  # noqa: E402
from tests.serving.test_router import RouterThread, wait_until  # noqa: E402

PAGE = 4
ARGS = ("--num-pages", "256", "--page-size", str(PAGE), "--chunked-prefill-size", "64",
        "--kv-events", "tcp://127.0.0.1:0")  # fmt: skip


@pytest.fixture(scope="module")
def pd(model_dir):
    prefill = Server(model_dir, *ARGS, "--disaggregation", "prefill")
    decode = Server(model_dir, *ARGS, "--disaggregation", "decode", "--kv-transfer-timeout", "1")
    config = RouterConfig(
        replicas=(decode.endpoint,),
        prefill=(prefill.endpoint,),
        port=0,
        policy=PolicyConfig("cache_aware"),
    )
    rt = RouterThread(config, model_dir)
    wait_until(lambda: all(r.up for r in rt.router.replicas), what="servers up")
    yield rt, prefill, decode
    rt.close()
    for s in (prefill, decode):
        if s.proc.poll() is None:
            s.stop()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def transfer_stats(endpoint: str) -> dict:
    with Client(endpoint, timeout=30) as c:
        return {k: v for k, v in c.stats().items() if k.startswith("kv_transfer")}


def test_outputs_equal_one_server_and_only_missing_pages_travel(pd, engine):
    rt, prefill, decode = pd
    rng = np.random.default_rng(5)
    history = rng.integers(5, 500, 60).tolist()
    with Client(rt.router.endpoint, timeout=60) as c:
        first = c.generate(input_ids=history, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert first.token_ids == engine.generate([history], greedy(8))[0].token_ids
        before = transfer_stats(decode.endpoint)
        assert before["kv_transfer_pages_sent"] == 59 // PAGE  # all but the last token
        # The next turn: the decode server holds the history, the rest is pulled.
        turn = history + first.token_ids + rng.integers(5, 500, 20).tolist()
        chunks = list(c.generate_stream(input_ids=turn, max_tokens=8, temperature=0.0,
                                        ignore_eos=True))  # fmt: skip
        got = [t for ch in chunks for t in ch.token_ids]
        assert got == engine.generate([turn], greedy(8))[0].token_ids
        after = transfer_stats(decode.endpoint)
        held = (len(history) + 7) // PAGE  # the history and first answer's KV, whole pages
        assert after["kv_transfer_pages_skipped"] - before["kv_transfer_pages_skipped"] == held
        sent = (len(turn) - 1) // PAGE - held
        assert after["kv_transfer_pages_sent"] - before["kv_transfer_pages_sent"] == sent
        wait_idle(c)
        assert c.check() == {"ok": True, "error": None}


def test_a_hung_prefill_server_costs_a_timeout_not_an_answer_nor_a_page(pd, engine):
    rt, prefill, decode = pd
    rng = np.random.default_rng(6)
    prompts = [rng.integers(5, 500, 90).tolist() for _ in range(2)]
    with Client(rt.router.endpoint, timeout=60) as c:
        os.kill(prefill.pids["worker"], signal.SIGSTOP)  # its pages never come
        start = time.monotonic()
        results = [
            c.generate(input_ids=p, max_tokens=4, temperature=0.0, ignore_eos=True) for p in prompts
        ]
        assert time.monotonic() - start < 60
        for p, r in zip(prompts, results):
            assert r.token_ids == engine.generate([p], greedy(4))[0].token_ids
    with Client(decode.endpoint, timeout=30) as d:
        stats = d.stats()
        assert stats["kv_transfer_fallbacks"] >= 1
        # The reserved pages come back once the quarantine (2 x the timeout) is over.
        wait_until(lambda: d.stats()["kv_transfer_quarantined_pages"] == 0, timeout=30,
                   what="quarantine over")  # fmt: skip
        wait_idle(d)
        assert d.check() == {"ok": True, "error": None}
    os.kill(prefill.pids["worker"], signal.SIGKILL)  # the prefill server stops with it

"""The shared KV store through real launches: two servers started separately over
one ``mooncake_master`` on loopback.

A long prompt served by server A is then served by server B with at least 90% of
its tokens read from the store, and B's tokens equal A's and a cold run's
(float32). The master killed mid-run: both servers keep serving (misses, no
request fails); started again on its address, they use it again. Another dtype
reads nothing of it. Nothing of the store listens beyond loopback.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from radixserve import Engine, SamplingParams
from radixserve.client import Client
from radixserve.utils.mooncake import MooncakeMaster
from tests.helpers.server import Server, wait_idle
from tests.utils.test_kv_store import listening

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
STORE_CONFIG = '{"segment_mb": 32, "buffer_mb": 16, "timeout_s": 1}'
ARGS = ("--dtype", "float32", "--page-size", "4", "--num-pages", "512")


def _prompt(seed: int, n: int = 400) -> list[int]:
    return np.random.default_rng(seed).integers(4, 500, n).tolist()


@pytest.fixture(scope="module")
def master():
    m = MooncakeMaster()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def servers(model_dir, master):
    store = ("--kv-store", master.url, "--kv-store-config", STORE_CONFIG)
    a = Server(model_dir, *ARGS, *store, wait=False)
    b = Server(model_dir, *ARGS, *store, wait=False)  # both start at once
    a.wait_started()
    b.wait_started()
    yield a, b
    for srv in (a, b):
        assert srv.stop() == 0
        assert srv.orphans() == []


@pytest.fixture(scope="module")
def cold(model_dir):
    """The oracle: the same model in float32, no store."""
    return Engine(str(model_dir), dtype="float32", page_size=4, num_pages=512, warmup=False)


def test_a_prefix_computed_by_one_server_is_read_by_another(servers, cold, model_dir, master):
    a, b = servers
    prompt = _prompt(1)
    want = cold.generate([prompt], GREEDY)[0].token_ids
    with Client(a.endpoint, timeout=120) as ca, Client(b.endpoint, timeout=120) as cb:
        ra = ca.generate(input_ids=prompt, sampling_params=GREEDY)
        wait_idle(ca)  # its pages are in the store once its copies are done
        rb = cb.generate(input_ids=prompt, sampling_params=GREEDY)
        assert ra.token_ids == rb.token_ids == want
        assert ra.usage.cached_tokens == 0
        assert rb.usage.cached_tokens_by_tier[3] >= 0.9 * len(prompt)
        assert rb.usage.cached_tokens == rb.usage.cached_tokens_by_tier[3]
        wait_idle(cb)
        stats = cb.stats()
        assert stats["hit_tokens_store"] == rb.usage.cached_tokens
        assert stats["store_hit_pages"] * 4 == rb.usage.cached_tokens
        assert stats["store_read_bytes"] > 0 and ca.stats()["store_written_bytes"] > 0
    # Mooncake's client binds every interface: the launcher makes it bind the master's.
    for srv in (a, b):
        ports = listening(srv.pids["worker"])
        assert ports and {host for host, _ in ports} <= {"127.0.0.1", "::ffff:127.0.0.1"}, ports
    # Another dtype: its page keys are rooted in another identity, nothing is read.
    other = Engine(
        str(model_dir), dtype="float64", page_size=4, num_pages=512, warmup=False,
        kv_store=master.url, kv_store_config=STORE_CONFIG,
    )  # fmt: skip
    try:
        r = other.generate([prompt], GREEDY)[0]
        assert r.usage.cached_tokens == 0 and other.stats()["store_miss_pages"] > 0
    finally:
        other.close()


def test_the_master_killed_and_back(servers, cold, master):
    """No request fails while the master is gone (the store is a miss); once it is
    back on its address, a prefix written by A is read by B again."""
    a, b = servers
    master.stop()
    prompts = [_prompt(s, 120) for s in (2, 3)]
    want = [r.token_ids for r in cold.generate(prompts, GREEDY)]
    with Client(a.endpoint, timeout=120) as ca, Client(b.endpoint, timeout=120) as cb:
        for c in (ca, cb):
            got = [c.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
            assert [r.token_ids for r in got] == want
            assert all(r.finish_reason == "length" for r in got)
        wait_idle(ca)
        wait_idle(cb)
        master.start()  # the same address, an empty store
        time.sleep(2.5)  # the servers' back-off after a failure (StoreIO.retry_s)
        prompt = _prompt(4, 200)
        ra = ca.generate(input_ids=prompt, sampling_params=GREEDY)
        wait_idle(ca)
        rb = cb.generate(input_ids=prompt, sampling_params=GREEDY)
        assert ra.token_ids == rb.token_ids
        assert rb.usage.cached_tokens_by_tier[3] >= 0.9 * len(prompt)

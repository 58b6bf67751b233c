"""``GET /metrics``, parsed with prometheus_client's own parser: counters move by exactly
what shared-prefix requests should add, gauges describe the pool, counters never drop."""

from __future__ import annotations

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import wait_idle
from tests.http.conftest import MODEL

MAX = 6


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample by (full sample name, sorted labels). The parser drops ``_total`` from
    family names, so samples are looked up by their own names."""
    text = httpx.get(url + "/metrics", timeout=60).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(f"radixserve:{name}", tuple(sorted(labels.items())))]


def test_counters_after_shared_prefix_requests(http_server, zmq_client):
    url = http_server.http_url
    rng = np.random.default_rng(5)
    prefix = rng.integers(4, 512, 64).tolist()
    prompts = [prefix + [7, 8, 9], prefix + [10, 11]]
    zmq_client.flush_cache()
    before = scrape(url)
    for p in prompts:
        body = {
            "model": MODEL,
            "prompt": p,
            "max_tokens": MAX,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    # The second prompt found the first's 64-token prefix (4-token pages) in the tree.
    assert moved("prefix_cache_hits_total") == 64
    assert moved("prefix_cache_queries_total") == 67 + 66
    assert moved("prompt_tokens_total") == 67 + 66
    assert moved("generation_tokens_total") == 2 * MAX
    assert moved("requests_total", finish_reason="length") == 2
    assert moved("requests_total", finish_reason="abort") == 0
    assert moved("preemptions_total") == 0
    assert moved("prefix_cache_evicted_pages_total", policy="lru") == 0  # no pressure
    # Queue time, kept by the scheduler per priority: both requests were admitted.
    key = ("radixserve:request_queue_time_seconds_count", (("priority", "0"),))
    assert after[key] - before.get(key, 0) == 2
    inf = ("radixserve:request_queue_time_seconds_bucket", (("le", "+Inf"), ("priority", "0")))
    assert after[inf] == after[key]
    assert moved("time_to_first_token_seconds_count") == 2
    assert moved("e2e_request_latency_seconds_count") == 2
    assert moved("inter_token_latency_seconds_count") == 2 * (MAX - 1)  # one token per step
    assert value(after, "e2e_request_latency_seconds_bucket", le="+Inf") == value(
        after, "e2e_request_latency_seconds_count"
    )
    stats = zmq_client.stats()
    pages = [value(after, "kv_pages", state=s) for s in ("free", "used", "cached")]
    assert sum(pages) == stats["num_pages"]
    assert pages[2] >= 64 // 4  # the shared prefix is cached
    assert value(after, "num_requests_running") == value(after, "num_requests_waiting") == 0

    # Flushing empties the cache gauge but never lowers a counter.
    zmq_client.flush_cache()
    flushed = scrape(url)
    assert value(flushed, "kv_pages", state="cached") == 0
    for key, v in after.items():
        if key[0].endswith("_total"):
            assert flushed[key] >= v, key


def test_abort_is_counted_when_the_client_leaves(http_server, zmq_client):
    url = http_server.http_url
    before = scrape(url)
    body = {"model": MODEL, "prompt": "leave early", "max_tokens": 400, "ignore_eos": True}
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r,
    ):
        next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_idle(zmq_client)
    after = scrape(url)
    aborted = value(after, "requests_total", finish_reason="abort")
    assert aborted - value(before, "requests_total", finish_reason="abort") == 1

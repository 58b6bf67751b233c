"""Speculative decoding in a launched server: ``--speculative-algorithm radix`` over
ZeroMQ and HTTP (one small launch).

A prompt sent twice (the second time drafted from the first's output in the tree)
and a prompt that repeats itself (ngram drafts) give the greedy tokens of the
in-process Engine without speculation, streamed or not; a stop string inside an
accepted run ends the text and the tokens where the plain Engine ends them; the
scheduler's counters and the Prometheus ones move; the server ends idle.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve import Engine, SamplingParams
from radixserve.client import Client
from tests.helpers.server import Server, wait_idle
from tests.serving.conftest import SERVER_ARGS, model_dir  # noqa: F401  (a shared fixture)

MAX = 16


@pytest.fixture(scope="module")
def spec_server(model_dir):  # noqa: F811
    srv = Server(model_dir, *SERVER_ARGS, "--speculative-algorithm", "radix", "--http-port", "0")
    yield srv
    assert srv.stop() == 0
    assert srv.orphans() == []


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == f"radixserve:{name}":
                return s.value
    raise AssertionError(f"no metric {name}")


def test_speculative_server_gives_the_plain_greedy_tokens(spec_server, model_dir):  # noqa: F811
    rng = np.random.default_rng(9)
    loop = rng.integers(4, 512, 10).tolist()
    prompts = [rng.integers(4, 512, 30).tolist(), loop * 3]
    greedy = dict(max_tokens=MAX, temperature=0.0, ignore_eos=True)
    with Engine(str(model_dir), dtype="float64", page_size=4, num_pages=1024, warmup=False) as e:
        want = [r.token_ids for r in e.generate(prompts, SamplingParams(**greedy))]
        text = e.generate(prompts[0], SamplingParams(**greedy))[0].text
        stop = text[len(text) // 2 :][:2]
        cut = e.generate(prompts[0], SamplingParams(**greedy, stop=[stop]))[0]
    url = spec_server.http_url
    before = metric(url, "spec_decode_accepted_tokens_total")
    with Client(spec_server.endpoint, timeout=120) as c:
        for _ in range(2):
            for p, w in zip(prompts, want):
                assert c.generate(input_ids=p, **greedy).token_ids == w
        chunks = list(c.generate_stream(input_ids=prompts[0], **greedy))
        assert [t for ch in chunks for t in ch.token_ids] == want[0]
        assert any(len(ch.token_ids) > 1 for ch in chunks)  # accepted drafts arrive together
        r = c.generate(input_ids=prompts[0], stop=[stop], **greedy)
        assert (r.text, r.token_ids, r.finish_reason) == (cut.text, cut.token_ids, "stop")
        stats = wait_idle(c)
        assert c.check()["ok"]
    assert stats["spec_accepted_tokens"] >= MAX
    assert metric(url, "spec_decode_accepted_tokens_total") - before >= MAX

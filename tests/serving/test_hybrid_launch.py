"""A hybrid model (Nemotron-H: Mamba-2 layers) served for real: its steps' state
restores and saves cross the scheduler-worker socket, and the tokens equal the
in-process cache-off Engine's."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve import Engine, SamplingParams
from radixserve.client import AsyncClient, Client
from tests.helpers.server import Server, wait_idle
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("served-nemotron_h"), "nemotron_h", seed=3)


def test_served_hybrid_hits_its_snapshots(nemotron_dir):
    """Three prompts sharing a 40-token prefix, sent together (the prefix computed
    once), then again: the second round hits at least the shared prefix and, for some,
    their own snapshots beyond it; every reply equals the cache-off Engine's."""
    import asyncio

    rng = np.random.default_rng(1)
    shared = rng.integers(4, 512, 40).tolist()
    prompts = [shared + rng.integers(4, 512, n).tolist() for n in (5, 9, 14)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cold = Engine(str(nemotron_dir), dtype="float64", cache="none")
    want = [r.token_ids for r in cold.generate(prompts, sp)]

    async def both(endpoint: str) -> list:
        async with AsyncClient(endpoint, timeout=120) as client:
            return await asyncio.gather(*(
                client.generate(input_ids=p, max_tokens=12, temperature=0.0, ignore_eos=True)
                for p in prompts
            ))  # fmt: skip

    srv = Server(nemotron_dir, "--page-size", "4", "--chunked-prefill-size", "16")
    try:
        first = asyncio.run(both(srv.endpoint))
        assert [r.token_ids for r in first] == want
        assert sorted(r.usage.cached_tokens for r in first) == [0, 40, 40]
        second = asyncio.run(both(srv.endpoint))
        assert [r.token_ids for r in second] == want
        hits = [r.usage.cached_tokens for r in second]
        assert all(40 <= h < len(p) and h % 4 == 0 for h, p in zip(hits, prompts, strict=True))
        assert max(hits) > 40  # a prompt's own snapshot, past the shared prefix
        with Client(srv.endpoint) as client:
            wait_idle(client)
    finally:
        assert srv.stop() == 0
    assert srv.orphans() == []

"""A model with sliding layers served for real: the window pool's pages go over the
wire in every step, the banner shows the pool, and the tokens are the Engine's."""

from __future__ import annotations

import numpy as np

from radixserve import Engine, SamplingParams
from radixserve.client import Client
from tests.helpers.server import Server, wait_idle
from tests.helpers.tiny_models import make_tiny_model

ARGS = ("--num-pages", "256", "--page-size", "4", "--chunked-prefill-size", "16",
        "--max-running-requests", "4")  # fmt: skip


def test_gemma3_with_a_window_pool_over_the_wire(tmp_path):
    folder = make_tiny_model(tmp_path / "gemma3", "gemma3", seed=5)
    rng = np.random.default_rng(8)
    shared = rng.integers(4, 512, 30).tolist()
    prompts = [shared + rng.integers(4, 512, 10 + i).tolist() for i in range(3)]
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eng = Engine(str(folder), dtype="float64", num_pages=256, page_size=4,
                 chunked_prefill_size=16, max_running_requests=4)  # fmt: skip
    want = [r.token_ids for r in eng.generate(prompts, sp)]
    eng.close()
    srv = Server(folder, *ARGS)
    try:
        assert "window_pages=" in srv.summary and "window=16" in srv.summary
        with Client(srv.endpoint, timeout=120) as c:
            for _ in range(2):  # the second round hits the cache past the window
                got = [c.generate(input_ids=p, sampling_params=sp).token_ids for p in prompts]
                assert got == want
            wait_idle(c)
            assert c.check() == {"ok": True, "error": None}
            assert c.stats()["hit_tokens"] >= 3 * 28
    finally:
        assert srv.stop() == 0

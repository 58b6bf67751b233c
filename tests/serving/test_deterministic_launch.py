"""``radixserve launch --deterministic`` for real: a request's tokens and logprobs are the
same bits alone, among concurrent neighbours, and from the cache, over the wire
(docs/deterministic.md)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from radixserve import SamplingParams
from radixserve.client import AsyncClient, Client
from tests.helpers.server import Server, wait_idle
from tests.helpers.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def sig(result) -> tuple:
    lps = [(t.logprob, tuple((c.token_id, c.logprob) for c in t.top)) for t in result.logprobs]
    return tuple(result.token_ids), tuple(lps)


def test_launch_deterministic_alone_in_a_batch_and_cached(tmp_path):
    folder = make_tiny_model(
        tmp_path / "llama", "llama", seed=7, dtype=torch.bfloat16, hidden_size=128,
        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2,
    )  # fmt: skip
    rng = np.random.default_rng(3)
    target = rng.integers(4, 500, 90).tolist()
    others = [rng.integers(4, 500, int(n)).tolist() for n in rng.integers(5, 120, 7)]
    srv = Server(folder, "--deterministic", "--dtype", "bfloat16", "--page-size", "16",
                 "--chunked-prefill-size", "32")  # fmt: skip
    try:
        with Client(srv.endpoint, timeout=120) as c:
            c.flush_cache()
            alone = sig(c.generate(input_ids=target, sampling_params=GREEDY))
            cached = sig(c.generate(input_ids=target, sampling_params=GREEDY))
            assert cached == alone
            c.flush_cache()

            async def together():
                async with AsyncClient(srv.endpoint, timeout=120) as ac:
                    prompts = others[:3] + [target] + others[3:]
                    return await asyncio.gather(
                        *(ac.generate(input_ids=p, sampling_params=GREEDY) for p in prompts)
                    )

            results = asyncio.run(together())
            assert sig(results[3]) == alone
            wait_idle(c)
            assert c.check() == {"ok": True, "error": None}
    finally:
        assert srv.stop() == 0

"""Cache tiers through a real launch: the tier copies travel in the step message, and
usage and stats report hits by tier through the tokenizer and the client.

A pool of 48 pages, a host tier of 8 pages and a disk tier: the first round's
prompts cannot stay in the pool nor all in host memory, so the second round's
prefixes come back from the host and from disk; the tokens must equal the
in-process Engine's (the session's oracle, a roomy pool without tiers).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

from radixserve import SamplingParams
from radixserve.client import Client
from tests.helpers.server import Server, wait_idle

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 8  # the tiny model's page at page size 4, float64


def test_tiers_through_a_launch(model_dir, engine):
    rng = np.random.default_rng(7)
    firsts = [rng.integers(4, 512, 60).tolist() for _ in range(4)]
    seconds = [p + rng.integers(4, 512, 5).tolist() for p in firsts]
    want = [r.token_ids for r in engine.generate(firsts + seconds, GREEDY)]
    disk = tempfile.mkdtemp(prefix="rs-kv-")
    host_gib = 8 * PAGE_BYTES / (1 << 30)
    srv = Server(
        model_dir,
        *("--num-pages", "48", "--page-size", "4", "--decode-reserve-ratio", "0"),
        *("--host-cache-gb", repr(host_gib), "--disk-cache-dir", disk),
    )
    try:
        with Client(srv.endpoint, timeout=120) as c:
            got = [c.generate(input_ids=p, sampling_params=GREEDY) for p in firsts + seconds]
            assert [r.token_ids for r in got] == want
            tiers = [r.usage.cached_tokens_by_tier for r in got[4:]]
            assert all(sum(t) == r.usage.cached_tokens for t, r in zip(tiers, got[4:]))
            wait_idle(c)
            stats = c.stats()
            assert stats["hit_tokens_l2"] > 0 and stats["hit_tokens_l3"] > 0
            assert stats["hit_tokens_l2"] == sum(t[1] for t in tiers)
            assert stats["hit_tokens_l3"] == sum(t[2] for t in tiers)
            assert stats["host_pages"] == 8 and stats["pages_written"] > 0
            assert c.check() == {"ok": True, "error": None}  # after the copies in flight
            assert c.stats()["copies_in_flight"] == 0
            assert any(n.endswith(".kv") for n in os.listdir(disk))
            on_disk = c.stats()["disk_pages_cached"]
            c.flush_cache(keep_disk=True)
            stats = c.stats()
            assert stats["disk_pages_cached"] == on_disk > 0
            assert stats["host_pages_cached"] == stats["pages_cached"] == 0
            c.flush_cache()
            assert c.stats()["disk_pages_cached"] == 0
        assert srv.stop() == 0
        assert srv.orphans() == []
    finally:
        srv.stop()
        shutil.rmtree(disk, ignore_errors=True)

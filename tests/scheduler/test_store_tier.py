"""The shared KV store's scheduler side (``store_tier.py``, ``TieredCache.fetch``)
against the simulated worker and an in-process store double (``MemoryStore``).

Several simulated replicas share one store. ``SimWorker`` keeps, for every KV
position, a digest of the whole prefix before it, so a page read from the store
that holds the right tokens after another prefix fails the run at once: the
outputs are right only if every page read from the store is the page of exactly
that prefix (the hash chain of page keys), whatever the store evicts meanwhile and
whatever the replicas' pools evict.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.scheduler.request import ReqStatus
from radixserve.utils.kv_store import MemoryStore
from tests.scheduler.test_scheduler import (
    VOCAB,
    check_outputs,
    greedy,
    make,
    run,
    run_workload,
    workloads,
)

# The scheduler never connects to the store (the worker does): any well-formed URL.
STORE = "mooncake://127.0.0.1:50051"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workloads(),
    st.integers(0, 6),
    st.sampled_from([0.0, 0.2, 0.6]),
    st.integers(0, 3),
    st.integers(0, 2**16),
    st.sampled_from(["insert", "evict"]),
)
def test_replicas_sharing_a_store_read_only_their_prefixes_kv(
    w, host_pages, evict, delay, seed, write
):
    """Two replicas run the same random workloads (tight pools: eviction and
    retraction) one after the other over one store that evicts at random, pages
    written as computed or as evicted: every output is right (a page of another
    prefix would change it), pages held by abandoned reads are conserved, the
    second replica's hits add up by tier."""
    w = {**w, "cache": "radix"}
    store = MemoryStore(capacity=10**6, evict_rate=evict, seed=seed)
    kw = dict(
        kv_store=STORE,
        kv_store_config=f'{{"write": "{write}"}}',
        store=store,
        host_pages=host_pages,
        copy_delay=delay,
    )
    first = run_workload(w, **kw)
    second = run_workload(w, **kw)
    for sched in (first, second):
        assert sched.hit_tokens == sum(sched.tier_hit_tokens)
        stats = sched.stats()
        assert stats["copies_in_flight"] == 0
    if evict == 0.0 and host_pages == 0 and write == "insert":
        # Whatever the first replica computed in whole pages, the second can read.
        assert second.tier_hit_tokens[3] >= first.tier_hit_tokens[3]


def _prompts(n, length, seed=1):
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(3, VOCAB, length).tolist() for i in range(n)}


def test_a_second_replica_reads_the_first_ones_pages():
    """Replica B answers prompts replica A served from A's pages in the store, up to
    its last whole page before the last token, and its outputs are right."""
    store = MemoryStore()
    prompts = _prompts(4, 70)
    results = []
    for _ in range(2):
        sched, worker = make(page_size=4, kv_store=STORE, store=store)
        for rid, p in prompts.items():
            sched.add_request(rid, p, greedy(5))
        res = run(sched, worker)
        check_outputs(res, prompts, dict.fromkeys(prompts, 5))
        sched.check_idle()
        results.append((sched, res))
    (a, _), (b, res_b) = results
    assert a.tier_hit_tokens[3] == 0 and a.stats()["store_hit_pages"] == 0
    assert b.tier_hit_tokens[3] == 4 * 68  # 69 tokens may match: 17 whole pages each
    assert all(r["out"].cached_tokens_by_tier == [0, 0, 0, 68] for r in res_b.values())
    stats = b.stats()
    assert stats["store_hit_pages"] == 4 * 17 and stats["store_miss_pages"] == 0
    assert stats["hit_tokens_store"] == 4 * 68


def test_another_model_reads_nothing():
    """A replica with another model identity (model, dtype, KV layout...) finds
    none of the pages: its keys are rooted elsewhere."""
    store = MemoryStore()
    prompts = _prompts(2, 40)
    for identity, hits in (("sim-a", 0), ("sim-b", 0), ("sim-a", 2 * 36)):
        sched, worker = make(page_size=4, kv_store=STORE, store=store, identity=identity)
        for rid, p in prompts.items():
            sched.add_request(rid, p, greedy(3))
        check_outputs(run(sched, worker), prompts, dict.fromkeys(prompts, 3))
        assert sched.tier_hit_tokens[3] == hits


def test_a_match_stops_at_the_first_page_the_store_lost():
    """The store dropped page 5 of a prompt: the reader takes pages 0-4 from it and
    computes from page 5 on (not the pages after the hole)."""
    store = MemoryStore()
    prompt = _prompts(1, 41)["r0"]
    sched, worker = make(page_size=4, kv_store=STORE, store=store)
    sched.add_request("a", prompt, greedy(2, ignore_eos=True))
    run(sched, worker)
    stored = list(store._objects)
    assert len(stored) == 10
    store.evict(stored[5])
    sched2, worker2 = make(page_size=4, kv_store=STORE, store=store)
    sched2.add_request("b", prompt, greedy(2))
    res = run(sched2, worker2)
    check_outputs(res, {"b": prompt}, {"b": 2})
    assert res[("b", 0)]["out"].cached_tokens == 20
    assert sched2.stats()["store_miss_pages"] == 5


def test_a_request_aborted_while_its_pages_come_in_frees_them_after():
    """Aborted while LOADING from the store: the pages being filled are not free
    until the ticket is done, then they are (no leak, no early reuse)."""
    store = MemoryStore()
    prompt = _prompts(1, 41)["r0"]
    sched, worker = make(page_size=4, kv_store=STORE, store=store)
    sched.add_request("a", prompt, greedy(2, ignore_eos=True))
    run(sched, worker)
    sched, worker = make(page_size=4, kv_store=STORE, store=store, num_pages=64)
    worker.hold_copies = True  # tickets finish only in a step with nothing to compute
    sched.add_request("b", prompt, greedy(2, ignore_eos=True))
    # Shorter than a page and a token: computed at once, nothing to ask the store.
    sched.add_request("other", [5, 6, 7, 8], greedy(6, ignore_eos=True))
    sched.step(worker.step)
    (b,) = [r for r in sched.running if r.rid == "b"]
    assert b.status is ReqStatus.LOADING
    sched.abort_request("b")
    sched.step(worker.step)
    held = sched.kv.tiers.store.pages_held
    assert len(held) == 10 and sched.allocator.is_allocated(held).all()
    run(sched, worker)
    sched.check_idle()
    assert len(sched.kv.tiers.store.pages_held) == 0


def test_a_page_after_another_prefix_is_not_read():
    """The store holds X+Y and Z+W; a request for Z+Y hits Z and not Y (Y's page
    there is the KV of Y after X). With page keys not chained it would read Y's
    page, and the simulated worker would fail: its KV belongs to another prefix."""
    store = MemoryStore()
    x, y, z, w = (list(range(s, s + 8)) for s in (10, 30, 50, 70))
    for prompt in (x + y + [3], z + w + [3]):
        sched, worker = make(page_size=8, kv_store=STORE, store=store)
        sched.add_request("a", prompt, greedy(2))
        run(sched, worker)
    sched, worker = make(page_size=8, kv_store=STORE, store=store)
    prompt = z + y + [3]
    sched.add_request("b", prompt, greedy(2))
    res = run(sched, worker)
    check_outputs(res, {"b": prompt}, {"b": 2})
    assert res[("b", 0)]["out"].cached_tokens_by_tier == [0, 0, 0, 8]


def test_written_on_eviction_only_pages_that_left_the_pool_are_shared():
    """``write: evict``: a replica writes a page when its pool evicts it. The second
    prompt evicts the first one's pages (a pool of one prompt): another replica then
    reads the first prompt from the store, not the second (still in the pool)."""
    store = MemoryStore()
    first, second = _prompts(2, 41).values()
    config = '{"write": "evict"}'
    sched, worker = make(
        page_size=4, num_pages=14, kv_store=STORE, kv_store_config=config, store=store
    )
    for rid, prompt in (("a", first), ("b", second)):
        sched.add_request(rid, prompt, greedy(2))
        check_outputs(run(sched, worker), {rid: prompt}, {rid: 2})
    assert len(store) == 10  # the first prompt's whole pages, evicted for the second
    other, worker2 = make(page_size=4, kv_store=STORE, kv_store_config=config, store=store)
    prompts = {"a": first, "b": second}
    for rid, prompt in prompts.items():
        other.add_request(rid, prompt, greedy(2))
    res = run(other, worker2)
    check_outputs(res, prompts, dict.fromkeys(prompts, 2))
    assert res[("a", 0)]["out"].cached_tokens_by_tier == [0, 0, 0, 40]
    assert res[("b", 0)]["out"].cached_tokens == 0

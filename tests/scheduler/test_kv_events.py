"""KV cache events: a mirror rebuilt from them matches the scheduler's tree after every step.

Random workloads (salts, tight pools that force eviction and retraction, aborts,
flushes, page sizes 1/4, both tree implementations) run on the scheduler with
``SimWorker``; after every step the step's batch is encoded, decoded and applied
to a ``KVMirror``, which must then hold exactly the tree's page-aligned prefixes
with the keys ``page_keys`` computes from scratch. A second mirror that drops
batches recovers through the log's replay (and a snapshot once its gap is older
than the buffer) and ends equal too.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve import protocol as P
from radixserve.router.mirror import KVMirror, MirrorOutOfSync
from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_events import page_keys, salt_tag
from radixserve.scheduler.kv_publisher import KVEventLog
from radixserve.scheduler.radix_impl import NATIVE_AVAILABLE
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scheduler.sim_worker import SimWorker
from tests.scheduler.test_radix_cache_property import tree_contents

VOCAB = 64  # small: prompts collide often, so they share prefixes
IMPLS = ["python", "native"] if NATIVE_AVAILABLE else ["python"]


def tree_paths(sched: Scheduler) -> set:
    """The scheduler's tree as (salt, tokens) prefixes, whatever the implementation."""
    inner = sched.cache.inner
    while hasattr(inner, "inner"):  # the recorder under cache tiers
        inner = inner.inner
    if hasattr(inner, "_roots"):
        return set(tree_contents(inner))
    return None  # the native tree: compared through peek_prefix below


def check_mirror(sched: Scheduler, mirror: KVMirror) -> None:
    paths = mirror.paths()
    assert len(paths) == mirror.num_pages == sched.cache.cached_pages
    exact = tree_paths(sched)
    if exact is not None:
        assert paths == exact
    for salt, toks in paths:
        assert sched.cache.peek_prefix(np.asarray(toks, dtype=np.int32), salt) == len(toks)
    for key, page in mirror.pages.items():  # spot-check keys against a fresh chain
        parent = page.parent
        assert (
            key
            == hashlib.sha256(
                salt_tag(page.salt)
                + (parent or bytes(32))
                + np.asarray(page.tokens, "<i4").tobytes()
            ).digest()
        )


@st.composite
def workloads(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    page_size = draw(st.sampled_from([1, 4]))
    templates = [rng.integers(3, VOCAB, int(rng.integers(4, 40))).tolist() for _ in range(3)]
    reqs = []
    for i in range(draw(st.integers(1, 16))):
        t = templates[int(rng.integers(3))]
        prompt = (
            t[: int(rng.integers(1, len(t) + 1))]
            + rng.integers(3, VOCAB, int(rng.integers(0, 12))).tolist()
        )
        reqs.append(
            dict(
                rid=f"q{i}",
                prompt=prompt,
                max_tokens=int(rng.integers(1, 12)),
                arrive=int(rng.integers(0, 16)),
                salt=[None, None, "a", "b"][int(rng.integers(4))],
                abort=int(rng.integers(1, 20)) if rng.random() < 0.1 else None,
            )
        )
    longest = max(-(-(len(r["prompt"]) + r["max_tokens"]) // page_size) for r in reqs)
    return dict(
        page_size=page_size,
        num_pages=longest + draw(st.integers(0, 2 * longest)),  # tight: evictions
        reqs=reqs,
        flushes=set(draw(st.lists(st.integers(0, 40), max_size=3))),
        impl=draw(st.sampled_from(IMPLS)),
        slots=draw(st.integers(1, 4)),
        drops=set(draw(st.lists(st.integers(1, 60), max_size=6))),
        buffer=draw(st.sampled_from([2, 1024])),
        host_pages=draw(st.sampled_from([0, 0, 3, 16])),  # cache tiers below the tree
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_mirror_from_events_matches_the_tree_after_every_step(w):
    cfg = SchedulerConfig(
        num_pages=w["num_pages"],
        page_size=w["page_size"],
        max_context_len=4096,
        eos_token_ids=(2,),
        radix_impl=w["impl"],
        max_running_requests=w["slots"],
        chunked_prefill_size=max(16, w["page_size"]),
        host_pages=w["host_pages"],
    )
    sched = Scheduler(cfg)
    log = KVEventLog(sched.record_kv_events(), "r0", buffer_size=w["buffer"], epoch=7)
    worker = SimWorker(
        cfg.num_pages, cfg.page_size, cfg.max_running_requests, VOCAB, host_slots=cfg.host_pages
    )
    mirror, lossy = KVMirror(), KVMirror()

    def publish():
        batch = log.next_batch({"running": sched.num_running})
        if batch is None:
            return
        mirror.apply(P.decode(batch.encode(), P.KV_STREAM))
        if batch.seq in w["drops"]:
            return  # this subscriber never sees it
        try:
            lossy.apply(batch)
        except MirrorOutOfSync:
            resync(lossy, log)

    def after_change():
        publish()
        check_mirror(sched, mirror)

    drive(sched, worker, w, after_change)
    sched.check_idle()
    resync(lossy, log)  # a drop at the very end shows only in a heartbeat
    assert lossy.pages == mirror.pages and lossy.seq == mirror.seq == log.seq


def drive(sched: Scheduler, worker: SimWorker, w: dict, after_change) -> None:
    """Run workload ``w`` (arrivals, aborts, flushes) to idle, calling
    ``after_change()`` after every flush and every step."""
    step = 0
    while step < 20 or sched.has_work():
        for r in w["reqs"]:
            if r["arrive"] == step:
                sp = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0)
                sched.add_request(r["rid"], r["prompt"], sp, salt=r["salt"])
            if r["abort"] == step and r["arrive"] < step:
                sched.abort_request(r["rid"])
        if step in w["flushes"]:
            sched.flush_cache()
            after_change()
        sched.step(worker.step)
        after_change()
        step += 1
        assert step < 3000


def resync(mirror: KVMirror, log: KVEventLog) -> None:
    """What the router's subscriber does on a gap: replay, or load the snapshot."""
    answer = P.decode(log.replay(mirror.seq, {}).encode(), P.KV_REPLAY_REPLIES)
    if isinstance(answer, P.KVSnapshot):
        mirror.load_snapshot(answer)
        return
    for batch in answer.batches:
        mirror.apply(batch)


def test_keys_are_a_sha256_chain_over_salt_parent_and_tokens():
    toks = [5, 6, 7, 8, 9, 10, 11, 12]
    k = page_keys(toks, 4, "t")
    first = hashlib.sha256(b"\x01" + (1).to_bytes(4, "little") + b"t" + bytes(32)
                           + np.asarray(toks[:4], "<i4").tobytes()).digest()  # fmt: skip
    assert k[0] == first
    assert page_keys(toks[4:], 4, "t", parent=first) == k[1:]
    assert page_keys(toks, 4, None) != k and page_keys(toks, 4, "u") != k
    assert page_keys(toks[:7], 4, "t") == k[:1]  # whole pages only


def test_a_mirror_refuses_gaps_other_epochs_and_orphans():
    m = KVMirror()
    stored = P.KVEvent("stored", b"".join(page_keys([1, 2], 1)), None, np.array([1, 2], np.int32))
    m.apply(P.KVEventBatch("r", 1, 1, 0.0, 1, [stored]))
    with pytest.raises(MirrorOutOfSync):
        m.apply(P.KVEventBatch("r", 1, 3, 0.0, 1, []))  # seq 2 is missing
    with pytest.raises(MirrorOutOfSync):
        m.apply(P.KVEventBatch("r", 2, 2, 0.0, 1, []))  # the replica restarted
    orphan = P.KVEvent("stored", bytes(32), b"\x01" * 32, np.array([3], np.int32))
    with pytest.raises(MirrorOutOfSync):
        m.apply(P.KVEventBatch("r", 1, 2, 0.0, 1, [orphan]))
    assert m.seq == 1 and m.match(page_keys([1, 2, 3], 1)) == 2


def test_one_batch_mixes_salts_each_stored_event_names_its_own():
    """The schema's choice (docs/protocol.md): the salt is per ``stored`` event, since
    one step's batch mixes tenants; ``removed`` carries none (the key holds it)."""
    cfg = SchedulerConfig(num_pages=8, page_size=4, max_context_len=256, eos_token_ids=(2,),
                          max_running_requests=2, chunked_prefill_size=64)  # fmt: skip
    sched = Scheduler(cfg)
    log = KVEventLog(sched.record_kv_events(), "r0", epoch=1)
    worker = SimWorker(cfg.num_pages, cfg.page_size, cfg.max_running_requests, VOCAB)
    prompt = list(range(10, 19))  # two whole pages and one token
    for rid, salt in (("a", "tenant-a"), ("b", None)):
        sched.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), salt=salt)
    sched.step(worker.step)  # both prefills in one step
    batch = P.decode(log.next_batch({}).encode(), P.KV_STREAM)
    stored = {e.salt: e for e in batch.events if e.kind == "stored"}
    assert set(stored) == {"tenant-a", None}
    for salt, e in stored.items():  # same tokens, other salt: other keys
        assert e.hashes == b"".join(page_keys(prompt, 4, salt))[: len(e.hashes)]
    while sched.has_work():
        sched.step(worker.step)
    sched.flush_cache()
    flushed = P.decode(log.next_batch({}).encode(), P.KV_STREAM)
    gone = [e for e in flushed.events if e.kind in ("removed", "cleared")]
    assert gone and all(e.salt is None and e.parent is None for e in gone)
    assert (batch.replica, batch.seq, flushed.seq) == ("r0", 1, log.seq) and flushed.ts > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_mirror_follows_demotions_and_promotions_under_cache_tiers(page_size):
    """With a host tier the events describe the pool: a demoted page is removed, a
    promoted one stored again, and the mirror matches the tree after every step."""
    cfg = SchedulerConfig(
        num_pages=20 // page_size + 1,
        page_size=page_size,
        max_context_len=4096,
        eos_token_ids=(2,),
        host_pages=32,
    )
    sched = Scheduler(cfg)
    log = KVEventLog(sched.record_kv_events(), "r0", epoch=1)
    worker = SimWorker(cfg.num_pages, page_size, 64, VOCAB, host_slots=cfg.host_pages)
    mirror = KVMirror()
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [[5] * 12, [6] * 16, [5] * 12 + [7, 8], [6] * 16 + [9]]
    for i, prompt in enumerate(prompts):
        sched.add_request(f"r{i}", prompt, sp)
        while sched.has_work():
            sched.step(worker.step)
            batch = log.next_batch({})
            if batch is not None:
                mirror.apply(batch)
            check_mirror(sched, mirror)
    stats = sched.stats()
    assert stats["pages_demoted"] > 0 and stats["pages_promoted"] > 0
    assert stats["hit_tokens_l2"] >= 12 + 16 - 2 * page_size
    sched.check_idle()

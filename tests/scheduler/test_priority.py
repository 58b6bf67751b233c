"""Priorities, preemption and timeouts (docs/scheduler.md, "Priorities, preemption
and timeouts"), on the simulated worker: its next token is a function of the whole
context, so a request that was preempted and resumed from the cache must produce
exactly the tokens of an uninterrupted run.
"""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.sampling_params import SamplingParams
from radixserve.scheduler.request import ReqStatus
from tests.scheduler.test_scheduler import _collect, check_outputs, expected_tokens, make, run


def params(max_tokens: int, priority: int = 0, **kw) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority, **kw
    )


def expected(prompt, n):
    return expected_tokens(prompt, n, ignore_eos=True)


def finish(sched, worker, results: dict) -> dict:
    """Step to idle, adding every output to ``results``."""
    for _ in range(100_000):
        if not sched.has_work():
            return results
        for out in sched.step(worker.step):
            _collect(results, out)
    raise AssertionError("did not finish")


@pytest.mark.parametrize("shortage", ["slots", "pages"])
def test_a_high_priority_request_preempts_a_flood_of_low_priority_ones(shortage):
    """The flood holds every slot (or every page); the urgent request is admitted in
    the very next step, and the preempted requests end with the tokens they would
    have produced anyway."""
    if shortage == "slots":
        sched, worker = make(num_pages=4096, page_size=4, schedule_policy="priority",
                             max_running_requests=4)  # fmt: skip
    else:
        sched, worker = make(num_pages=96, page_size=4, schedule_policy="priority",
                             max_running_requests=16)  # fmt: skip
    rng = np.random.default_rng(5)
    prompts = {f"low{i}": rng.integers(3, 64, 40).tolist() for i in range(6)}
    for rid, p in prompts.items():
        sched.add_request(rid, p, params(30, priority=5))
    results: dict = {}
    for _ in range(6):  # the flood runs
        for out in sched.step(worker.step):
            _collect(results, out)
    assert len(sched.running) >= 2
    prompts["urgent"] = rng.integers(3, 64, 40).tolist()
    sched.add_request("urgent", prompts["urgent"], params(8, priority=-1))
    for out in sched.step(worker.step):
        _collect(results, out)
    urgent = sched._requests["urgent"][0]
    assert urgent.status in (ReqStatus.PREFILL, ReqStatus.DECODE), "not admitted at once"
    assert sched.num_priority_preemptions >= 1
    finish(sched, worker, results)
    for rid, p in prompts.items():
        n = 8 if rid == "urgent" else 30
        assert results[(rid, 0)]["tokens"] == expected(p, n), rid
    sched.check_idle()


def test_equal_or_better_priorities_are_never_preempted():
    sched, worker = make(num_pages=4096, schedule_policy="priority", max_running_requests=2)
    for i in range(2):
        sched.add_request(f"a{i}", list(range(3, 30)), params(20, priority=1))
    sched.step(worker.step)
    sched.add_request("same", list(range(5, 30)), params(4, priority=1))
    sched.add_request("worse", list(range(6, 30)), params(4, priority=3))
    for _ in range(3):
        sched.step(worker.step)
    assert sched.num_priority_preemptions == 0
    assert {r.rid for r in sched.running} == {"a0", "a1"}
    run(sched, worker)
    sched.check_idle()


def test_no_request_is_preempted_more_than_the_bound():
    """A stream of urgent requests against one low-priority request: it is preempted
    at most ``max_preemptions`` times, then finishes with its own tokens."""
    sched, worker = make(num_pages=4096, schedule_policy="priority", max_running_requests=1,
                         max_preemptions=2)  # fmt: skip
    low = list(range(3, 40))
    sched.add_request("low", low, params(40, priority=9))
    results: dict = {}
    for i in range(12):
        sched.add_request(f"u{i}", [7, 8, 9, 10 + i], params(2, priority=0))
        for _ in range(4):
            for out in sched.step(worker.step):
                _collect(results, out)
    finish(sched, worker, results)
    req_low = results[("low", 0)]
    assert req_low["tokens"] == expected(low, 40)
    assert sched.num_priority_preemptions == 2
    sched.check_idle()


def test_priority_orders_admission_then_lpm_within_a_level():
    sched, worker = make(num_pages=4096, schedule_policy="priority", max_running_requests=1)
    order = []
    for rid, prio in (("c", 2), ("a", 0), ("b", 1), ("a2", 0)):
        sched.add_request(rid, [3, 4, 5, len(rid) + prio], params(1, priority=prio))
    while sched.has_work():
        for out in sched.step(worker.step):
            if out.finish_reason:
                order.append(out.rid)
    assert order == ["a", "a2", "b", "c"]
    sched.check_idle()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("where", ["waiting", "running"])
def test_a_request_past_its_timeout_ends_with_an_error_and_frees_its_pages(where):
    sched, worker = make(num_pages=64, page_size=4, max_running_requests=1)
    clock = sched.clock = FakeClock()
    sched.add_request("first", list(range(3, 20)), params(50))
    sched.add_request("timed", list(range(4, 21)), params(50, request_timeout=2.5))
    if where == "running":
        sched.abort_request("first")
    results: dict = {}
    for _ in range(3):
        for out in sched.step(worker.step):
            _collect(results, out)
    timed = sched._requests["timed"][0]
    assert timed.status is (ReqStatus.WAITING if where == "waiting" else ReqStatus.DECODE)
    clock.now += 2.6
    for out in sched.step(worker.step):
        _collect(results, out)
    assert results[("timed", 0)]["finish"] == "error"
    assert "timed out after 2.5 s" in results[("timed", 0)]["out"].error
    assert sched.stats()["timeouts"] == 1
    finish(sched, worker, results)
    if where == "waiting":
        check_outputs({("first", 0): results[("first", 0)]}, {"first": list(range(3, 20))},
                      {"first": 50})  # fmt: skip
    sched.check_idle()


def test_a_request_finished_in_time_is_not_timed_out():
    sched, worker = make(num_pages=64, page_size=4)
    clock = sched.clock = FakeClock()
    sched.add_request("quick", list(range(3, 20)), params(2, request_timeout=1.0))
    res = run(sched, worker)
    assert res[("quick", 0)]["finish"] == "length"
    clock.now += 5
    assert sched.step(worker.step) == []
    assert sched.stats()["timeouts"] == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"priority": 1.5},
        {"priority": "high"},
        {"request_timeout": 0},
        {"request_timeout": -1},
        {"request_timeout": float("inf")},
        {"request_timeout": "soon"},
    ],  # fmt: skip
)
def test_bad_priority_or_timeout_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_a_retention_hint_keeps_its_prompt_cached_under_memory_pressure():
    """--radix-eviction-policy priority: the prompt of a request with cache_retention
    survives the pressure that evicts the prefixes of requests without one."""
    sched, worker = make(num_pages=64, page_size=4, radix_eviction_policy="priority")
    kept = list(range(3, 43))  # 10 pages
    sched.add_request("kept", kept, params(1, cache_retention=[50, 60.0]))
    run(sched, worker)
    for i in range(6):  # 6 x 10 pages more than the pool holds beside it
        sched.add_request(f"o{i}", [50 + i] * 40, params(1))
        run(sched, worker)
    assert sched.cache.peek_prefix(np.asarray(kept, dtype=np.int32)) == 40
    sched.check_idle()


def test_retention_is_reported_and_clipped_at_the_caps():
    """Each request's output says how many prompt tokens its hint holds; a hint that
    would take its tenant past --max-retained-share, or all past
    --max-retained-total-share, holds the head of its prompt that fits (here: nothing,
    or the part an earlier turn retained); the stats show both caps, and plain
    requests still run."""
    sched, worker = make(
        num_pages=64, page_size=4, radix_eviction_policy="priority", max_retained_share=0.25,
        max_retained_total_share=0.4,
    )  # fmt: skip
    hint = [50, 60.0]  # 16 pages a tenant, 25 in all
    prompts = {f"a{i}": [10 + i] * 40 for i in range(3)}  # 10 pages each
    prompts["b0"] = [30] * 40
    prompts["c0"] = [31] * 40
    got = {}
    for rid, prompt in prompts.items():
        salt = rid[0]
        sched.add_request(rid, prompt, params(1, cache_retention=hint), salt=salt)
        got.update(run(sched, worker))
    held = {rid: got[(rid, 0)]["out"].retained_tokens for rid in prompts}
    # a1 would take "a" past 16 pages; c0 would take all past 25
    assert held == {"a0": 40, "a1": 0, "a2": 0, "b0": 40, "c0": 0}
    stats = sched.stats()
    assert stats["retained_pages"] == 20 and stats["retained_pages_max_tenant"] == 10
    assert stats["max_retained_pages_tenant"] == 16 and stats["max_retained_pages_total"] == 25
    assert stats["retention_clipped"] == 3
    # A later turn of a0's conversation: its own 10 pages do not fit, its head does.
    sched.add_request("a0+", prompts["a0"] + [12] * 40, params(1, cache_retention=hint), "a")
    assert run(sched, worker)[("a0+", 0)]["out"].retained_tokens == 40
    assert sched.stats()["retention_clipped"] == 4
    sched.add_request("plain", [3] * 40, params(1))
    assert run(sched, worker)[("plain", 0)]["finish"] == "length"
    assert sched.cache.peek_prefix(np.asarray(prompts["a0"], np.int32), "a") == 40
    sched.check_idle()


@pytest.mark.parametrize("hinted", [True, False])
def test_a_retained_session_demoted_to_the_host_tier_outlives_unretained_pages(hinted):
    """Two sessions retain more than the pool can keep beside the traffic that follows,
    so one is demoted; in the host tier it outlives the pages of that traffic (which
    alone would fill it twice over), and returns from there. Without hints the host
    tier is plain LRU and the session is gone."""
    sched, worker = make(
        num_pages=32, page_size=4, radix_eviction_policy="priority", max_retained_share=1.0,
        host_pages=16,
    )  # fmt: skip
    hint = {"cache_retention": [50, 60.0]} if hinted else {}
    sessions = {f"s{i}": [7 + i] * 48 for i in range(2)}  # 12 pages each
    for rid, prompt in sessions.items():
        sched.add_request(rid, prompt, params(1, **hint))
        run(sched, worker)
    for i in range(4):  # 4 x 10 unretained pages through what is left
        sched.add_request(f"o{i}", [40 + i] * 40, params(1))
        run(sched, worker)
    assert sched.stats()["pages_demoted"] > 0
    back = {}
    for rid, prompt in sessions.items():  # each session's next turn
        sched.add_request(rid + "+", prompt + [3, 4, 5, 6], params(1, **hint))
        back[rid] = run(sched, worker)[(rid + "+", 0)]["out"]
    cached = sum(out.cached_tokens for out in back.values())
    if hinted:
        assert cached == 2 * 48
        assert sum(out.cached_tokens_by_tier[1] for out in back.values()) > 0  # from host
    else:
        assert cached < 48
    sched.check_idle()


def test_queue_time_is_kept_per_priority_level_and_bounded_in_levels():
    """Arrival to first admission, by the scheduler's clock: the second request waits
    for the only slot; past MAX_QUEUE_LEVELS levels, the rest share "other"."""
    from radixserve.scheduler.waiting import MAX_QUEUE_LEVELS, QUEUE_BUCKETS, QueueTimes

    sched, worker = make(num_pages=256, page_size=4, max_running_requests=1)
    clock = sched.clock = FakeClock()
    sched.add_request("a", list(range(3, 20)), params(2))
    sched.add_request("b", list(range(4, 21)), params(2, priority=3))
    results: dict = {}
    for out in sched.step(worker.step):  # "a" admitted at once
        _collect(results, out)
    clock.now += 0.3  # "b" waits for the slot
    finish(sched, worker, results)
    levels = sched.stats()["queue_time"]["levels"]
    assert set(levels) == {"0", "3"}
    assert levels["0"] == {"buckets": [1] + [0] * len(QUEUE_BUCKETS), "sum": 0.0, "count": 1}
    b = levels["3"]
    assert b["count"] == 1 and b["sum"] == pytest.approx(0.3)
    assert b["buckets"][QUEUE_BUCKETS.index(0.5)] == 1  # 0.25 < 0.3 <= 0.5

    q = QueueTimes()
    for level in range(MAX_QUEUE_LEVELS + 3):
        q.observe(level, 1000.0)  # past every bound: the +Inf bucket
    snap = q.snapshot()["levels"]
    assert len(snap) == MAX_QUEUE_LEVELS + 1 and snap["other"]["count"] == 3
    assert snap["0"]["buckets"][-1] == 1


def test_evicted_pages_count_pressure_evictions_only():
    sched, worker = make(num_pages=32, page_size=4)
    for i in range(4):  # 4 x 10 pages through a 32-page pool
        sched.add_request(f"r{i}", [50 + i] * 40, params(1))
        run(sched, worker)
    stats = sched.stats()
    assert stats["evicted_pages"] > 0 and stats["eviction_policy"] == "lru"
    evicted = stats["evicted_pages"]
    sched.flush_cache()
    assert sched.stats()["evicted_pages"] == evicted  # a flush is not counted
    sched.check_idle()


def _first_token_steps(sched, worker, results: dict, rid: str) -> tuple[int, list]:
    """Step until ``rid`` has its first token: the steps it took, and what the last
    one computed ((request id, tokens) each)."""
    computed: list = []

    def run(step):
        computed[:] = [(r.rid, n) for r, n in sched._batch]
        return worker.step(step)

    for n in range(1, 1000):
        for out in sched.step(run):
            _collect(results, out)
        if results.get((rid, 0), {}).get("tokens"):
            return n, computed
    raise AssertionError(f"{rid} never got a token")


@pytest.mark.parametrize(
    "server",
    [
        "slots full of decodes",  # the worst and newest decode makes room
        "a long prompt mid-prefill, slots free",  # no slot is short: only the budget is
        "a long prompt mid-prefill, slots full",  # the chunk is of a better level than the decodes
    ],
)
def test_an_urgent_request_gets_its_first_token_after_its_own_prefill(server):
    """Behind a full server, an urgent request's prefill is the next step's (its
    prompt fits one step's budget): it has its first token after one step, whatever
    the worse requests were doing, and that step computes no worse prompt (a chunk
    of one would delay its first token). The preempted requests end with the tokens
    of an uninterrupted run."""
    slots = 8 if "slots free" in server else 4
    sched, worker = make(num_pages=4096, page_size=4, schedule_policy="priority",
                         max_running_requests=slots, chunked_prefill_size=32)  # fmt: skip
    rng = np.random.default_rng(11)
    prompts, lengths = {}, {}
    levels = {"decodes": 5, "chunk": 3 if "slots full" in server else 5}
    for i in range(3 if "mid-prefill" in server else 6):
        prompts[f"low{i}"] = rng.integers(3, 64, 20).tolist()
        sched.add_request(f"low{i}", prompts[f"low{i}"], params(40, priority=levels["decodes"]))
        lengths[f"low{i}"] = 40
    results: dict = {}
    for _ in range(3):
        for out in sched.step(worker.step):
            _collect(results, out)
    if "mid-prefill" in server:
        prompts["long"] = rng.integers(3, 64, 400).tolist()  # 13 chunks of 32 tokens or less
        sched.add_request("long", prompts["long"], params(6, priority=levels["chunk"]))
        lengths["long"] = 6
        for _ in range(2):
            for out in sched.step(worker.step):
                _collect(results, out)
        assert sched.chunked is not None and sched.chunked.rid == "long"
    assert len(sched.running) == 4
    prompts["urgent"] = rng.integers(3, 64, 24).tolist()
    sched.add_request("urgent", prompts["urgent"], params(8, priority=-1))
    lengths["urgent"] = 8
    steps, computed = _first_token_steps(sched, worker, results, "urgent")
    assert steps == 1
    # Its step prefilled no worse prompt: the others only decoded in it.
    assert [n for rid, n in computed if rid != "urgent"] == [1] * (len(computed) - 1)
    finish(sched, worker, results)
    for rid, p in prompts.items():
        assert results[(rid, 0)]["tokens"] == expected(p, lengths[rid]), rid
    sched.check_idle()

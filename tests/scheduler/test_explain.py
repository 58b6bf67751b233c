"""The cache's explain on crafted trees (``scheduler/explain.py``): real requests run
through the scheduler with the simulated worker, then a prompt is explained. Each
case runs on the Python and the native tree, and both must give the same answer."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.explain import EvictionLog
from radixserve.scheduler.radix_impl import NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON
from radixserve.scheduler.scheduler import Scheduler
from tests.helpers.native import require_built
from tests.scheduler.test_scheduler import greedy, make, run

PS = 16


def impls():
    return ["python", "native"]


def scheduler(impl: str, **kw):
    if impl == "native":
        require_built(NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON or "", "the native radix tree")
    return make(page_size=PS, radix_impl=impl, **kw)


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def serve(sched, worker, prompts: dict[str, list[int]], salt=None, max_tokens=8):
    for rid, p in prompts.items():
        sched.add_request(rid, p, greedy(max_tokens), salt=salt)
        run(sched, worker)
    return sched


def both(case):
    """``case(impl)`` on both trees; their reports must be equal. Returns one."""
    reports = [case(impl) for impl in impls()]
    assert reports[0] == reports[1], "the Python and the native tree explain differently"
    return reports[0]


def test_a_prompt_diverging_mid_page():
    base = prompt(0, 80)

    def case(impl):
        sched, worker = scheduler(impl)
        serve(sched, worker, {"a": base, "b": base[:48] + prompt(1, 40)})
        # Agrees with the cache for 40 tokens: 2 whole pages are hit, 8 tokens of the
        # third page agree but are recomputed.
        q = base[:40] + [499 - t for t in base[40:70]]
        return sched.explain(q)

    r = both(case)
    assert r["tiers"] == {"pool": 32} and r["hit_tokens"] == 32
    assert r["agreed_tokens"] == 40 and r["stop"] == "partial_page"
    miss = r["miss"]
    assert miss["position"] == 40 and miss["token_id"] == 499 - base[40]
    assert miss["before_ids"] == base[16:40]
    # Inside the edge shared by both cached prompts up to 48: one continuation, under
    # which both cached sequences go on.
    assert miss["continuations"] == 1
    assert miss["most_common"]["sequences"] == 2
    assert miss["most_common"]["token_ids"][:8] == base[40:48]
    assert miss["evicted"] is None
    assert r["namespace"] == {"cache_salt": None, "adapter": None}


def test_a_prompt_diverging_at_a_branch_names_the_most_common_continuation():
    base = prompt(0, 64)

    def case(impl):
        sched, worker = scheduler(impl)
        tails = {"a": prompt(1, 40), "b": prompt(2, 40), "c": prompt(2, 40)[:20] + [7] * 20}
        serve(sched, worker, {k: base[:48] + t for k, t in tails.items()})
        return sched.explain(base[:48] + [9] * 20), tails

    r, tails = case("python")
    if NATIVE_AVAILABLE:
        assert case("native")[0] == r
    assert r["hit_tokens"] == 48 and r["stop"] == "diverged"
    miss = r["miss"]
    assert miss["position"] == 48 and miss["continuations"] == 2
    # "b" and "c" share their first 20 tokens (a whole page): the branch two cached
    # sequences take.
    assert miss["most_common"]["sequences"] == 2
    assert miss["most_common"]["token_ids"][:16] == tails["b"][:16]


def test_after_an_eviction_the_longer_match_and_when():
    long = prompt(0, 200)
    now = [1000.0]

    def case(impl):
        sched, worker = scheduler(impl, num_pages=24)
        sched.kv.evictions.clock = lambda: now[0]
        serve(sched, worker, {"long": long})
        now[0] = 1010.0
        # Two unrelated prompts take the pool: the long prompt's tail is evicted.
        serve(sched, worker, {"x": prompt(5, 180), "y": prompt(6, 180)})
        now[0] = 1012.5
        r = sched.explain(long, None)
        sched.check_idle()
        return r

    r = both(case)
    assert r["hit_tokens"] < 192
    ev = r["miss"]["evicted"]
    assert ev is not None and ev["tokens"] > r["hit_tokens"] and ev["tokens"] <= 192
    assert ev["seconds_ago"] == 2.5


def test_a_flush_is_logged_as_an_eviction():
    p = prompt(0, 100)
    sched, worker = scheduler("python")
    serve(sched, worker, {"a": p})
    assert sched.explain(p)["stop"] == "last_token"
    assert sched.flush_cache() > 0
    r = sched.explain(p)
    assert r["hit_tokens"] == 0 and r["stop"] == "empty_namespace"
    assert r["miss"]["evicted"]["tokens"] == 96  # every whole page of the prompt


def test_another_salt_misses_and_reveals_nothing_of_the_other_namespace():
    secret = prompt(0, 64)

    def case(impl):
        sched, worker = scheduler(impl)
        serve(sched, worker, {"t1": secret}, salt="tenant-1")
        # The same prompt under another salt, and a prompt sharing a page with it.
        return sched.explain(secret, "tenant-2"), sched.explain(secret[:20] + [1] * 30, None)

    for r in both(case):
        assert r["hit_tokens"] == 0 and r["tiers"] == {"pool": 0}
        assert r["stop"] == "empty_namespace"
        miss = r["miss"]
        assert miss["position"] == 0 and miss["continuations"] == 0
        assert miss["most_common"] is None and miss["evicted"] is None
    r = both(case)[0]
    assert r["namespace"] == {"cache_salt": "tenant-2", "adapter": None}
    # Nothing in the answer but the caller's own prompt: not the other tenant's output.
    seen = set(r["miss"]["before_ids"] + r["miss"]["after_ids"])
    assert seen <= set(secret)


def test_a_hybrid_model_hit_stops_at_the_last_snapshot():
    cfg = SchedulerConfig(num_pages=64, page_size=PS, state_snapshots=4, max_context_len=512)
    sched = Scheduler(cfg)
    tree, states = sched.kv.cache, sched.kv.states
    tokens = np.asarray(prompt(0, 96), dtype=np.int32)
    pages = sched.allocator.alloc(4)
    snap = states.alloc_state()
    tree.insert(tokens[:32], pages[:2], state=snap)
    tree.insert(tokens[:64], pages)  # KV to 64, the state only at 32
    r = sched.explain(tokens)
    assert r["kv_tokens"] == 64 and r["hit_tokens"] == 32 and r["tiers"] == {"pool": 32}
    assert r["stop"] == "snapshot"
    assert r["agreed_tokens"] == 64 and r["miss"]["position"] == 64


def test_the_whole_prompt_cached_stops_at_the_last_token():
    base = prompt(0, 65)

    def case(impl):
        sched, worker = scheduler(impl)
        serve(sched, worker, {"a": base + prompt(1, 30)})
        return sched.explain(base)

    r = both(case)
    assert r["hit_tokens"] == 64 and r["stop"] == "last_token" and r["miss"] is None


def test_cache_none_says_so():
    sched, _ = make(page_size=PS, cache="none")
    r = sched.explain(prompt(0, 20))
    assert r["stop"] == "no_cache" and r["hit_tokens"] == 0


def test_bad_input_is_refused():
    sched, _ = scheduler("python")
    with pytest.raises(ValueError, match="empty"):
        sched.explain([])
    with pytest.raises(ValueError, match="NUL"):
        sched.explain([1, 2], "\0x")


def test_eviction_log_is_bounded_and_keeps_the_newest():
    log = EvictionLog(8, 1, capacity=3, clock=lambda: 5.0)
    tokens = np.arange(5, dtype=np.int32)
    log.inserted(tokens, np.arange(5, dtype=np.int32), 0, None)
    log.evicted(np.arange(5, dtype=np.int32))
    assert len(log) == 3
    assert log.longest(tokens, None, 0) == (5, 5.0)
    assert log.longest(tokens, "s", 0) is None  # another salt
    assert log.longest(tokens[:2], None, 0) is None  # dropped: the oldest


def test_with_cache_tiers_the_hit_is_split_by_tier():
    long = prompt(0, 200)
    sched, worker = scheduler("python", num_pages=24, host_pages=64)
    serve(sched, worker, {"long": long, "x": prompt(5, 180), "y": prompt(6, 180)})
    r = sched.explain(long)
    assert r["tiers"]["host"] > 0 and r["tiers"]["pool"] + r["tiers"]["host"] == r["hit_tokens"]
    assert r["hit_tokens"] == 192 and r["stop"] == "last_token"
    # The explain moved nothing: the request now really gets that split.
    sched.add_request("again", long, greedy())
    out = run(sched, worker)[("again", 0)]["out"]
    assert out.cached_tokens == 192
    assert out.cached_tokens_by_tier[:2] == [r["tiers"]["pool"], r["tiers"]["host"]]


def test_a_request_that_asks_gets_the_explain_at_arrival_in_its_last_output():
    base = prompt(0, 80)
    sched, worker = scheduler("python")
    serve(sched, worker, {"a": base})
    sched.add_request("b", base[:40] + prompt(3, 20), greedy(explain=True))
    sched.add_request("c", base, greedy())
    res = run(sched, worker)
    out = res[("b", 0)]["out"]
    assert out.explain["hit_tokens"] == out.cached_tokens == 32
    assert out.explain["stop"] == "partial_page" and out.explain["miss"]["position"] == 40
    # Another client's text in the namespace is not told to a plain request.
    assert out.explain["miss"]["most_common"] is None
    assert res[("c", 0)]["out"].explain is None


def test_siblings_that_share_the_next_token_are_all_continuations():
    base = prompt(0, 48)

    def case(impl):
        sched, worker = scheduler(impl)
        # Both part from the cache at 48 (a page boundary) and agree on token 48.
        serve(sched, worker, {"a": base + [7] + prompt(1, 39), "b": base + [7] + prompt(2, 39)})
        return sched.explain(base + [7] + [9] * 20)

    r = both(case)
    assert r["hit_tokens"] == 48 and r["agreed_tokens"] == 49 and r["stop"] == "partial_page"
    assert r["miss"]["position"] == 49 and r["miss"]["continuations"] == 2


def test_explain_changes_nothing():
    base = prompt(0, 90)

    def case(impl):
        sched, worker = scheduler(impl, num_pages=24)
        serve(sched, worker, {"a": base, "b": base[:40] + prompt(4, 60)})
        tree = sched.cache
        before = tree.export_nodes(-1)
        stats = (sched.allocator.num_free, tree.evictable_pages, tree.cached_pages)
        for q in (base, base[:40] + [1] * 30, base[:20], prompt(9, 50)):
            sched.explain(q)
            sched.explain(q, "other")
        after = tree.export_nodes(-1)
        assert before.keys() == after.keys()
        for k in before:
            same = before[k] == after[k] if k == "salts" else np.array_equal(before[k], after[k])
            assert same, k  # no split, no stamp, no new namespace
        assert stats == (sched.allocator.num_free, tree.evictable_pages, tree.cached_pages)
        sched.check_idle()
        return True

    both(case)


def test_an_unknown_adapter_is_refused():
    sched, _ = scheduler("python")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        sched.explain([1, 2, 3], lora="nope")

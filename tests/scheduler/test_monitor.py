"""The dashboard's figures (``scheduler/monitor.py``): the recent window's offline
optimum against the benchmark's offline optimum (the oracle), the history, and the
tree's largest prefixes on both trees."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.benchmark.optimal import optimal_hits
from radixserve.scheduler.monitor import WindowOptimum, outline
from radixserve.scheduler.radix_impl import NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON
from tests.helpers.native import require_built
from tests.scheduler.test_scheduler import greedy, make, run


def requests(seed: int, n: int = 40) -> list[tuple[list[int], list[int]]]:
    """Prompts that share system prompts and earlier answers, with outputs."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 500, int(rng.integers(5, 60))).tolist() for _ in range(4)]
    out, seen = [], []
    for _ in range(n):
        if seen and rng.random() < 0.3:  # a later turn of an earlier conversation
            p, o = seen[int(rng.integers(len(seen)))]
            prompt = p + o[:-1] + rng.integers(3, 500, int(rng.integers(1, 20))).tolist()
        else:
            prompt = systems[int(rng.integers(4))] + rng.integers(3, 500, 12).tolist()
        output = rng.integers(3, 500, int(rng.integers(1, 8))).tolist()
        seen.append((prompt, output))
        out.append((prompt, output))
    return out


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("seed", range(4))
def test_the_window_optimum_is_the_offline_optimum(seed, page_size):
    reqs = requests(seed)
    window = WindowOptimum(page_size, size=len(reqs))
    got = []
    for prompt, output in reqs:
        p = np.asarray(prompt, dtype=np.int32)
        got.append(window.hit(p, len(prompt) - 1, None))
        window.add(np.asarray(prompt + output[:-1], dtype=np.int32), None)
    assert got == optimal_hits(reqs, page_size)
    # Under another salt nothing of it is cached.
    assert window.hit(np.asarray(reqs[0][0], dtype=np.int32), 100, "other") == 0


def test_a_small_window_forgets_the_oldest():
    window = WindowOptimum(1, size=2)
    a, b, c = ([k] * 10 for k in (5, 6, 7))
    for seq in (a, b, c):
        window.add(np.asarray(seq, dtype=np.int32), None)
    assert window.hit(np.asarray(a + [1], dtype=np.int32), 10, None) == 0
    assert window.hit(np.asarray(c + [1], dtype=np.int32), 10, None) == 10


def test_the_scheduler_counts_what_it_served_against_the_optimum():
    sched, worker = make(page_size=4)
    now = [0.0]
    sched.monitor.clock = lambda: now[0]
    reqs = requests(7, 20)
    served = []  # (prompt, the output it got): the oracle's requests
    for i, (prompt, output) in enumerate(reqs):
        # Each request alone, so the finish order is the send order.
        sched.add_request(str(i), prompt, greedy(len(output), ignore_eos=True))
        served.append((prompt, run(sched, worker)[(str(i), 0)]["tokens"]))
        now[0] += 1.0
    m = sched.monitor
    assert m.finished_prompt_tokens == sum(len(p) for p, _ in reqs)
    assert m.optimal_tokens == sum(optimal_hits(served, 4)) > 0
    assert m.finished_hit_tokens == sched.hit_tokens <= m.optimal_tokens
    data = sched.dashboard()
    assert data["history_fields"][0] == "t" and len(data["history"]) >= 19
    last = dict(zip(data["history_fields"], data["history"][-1]))
    assert last["finished_prompt_tokens"] <= m.finished_prompt_tokens
    assert sched.dashboard() is data  # within the second: the same figures


def outline_of_a_served_tree(impl: str) -> dict:
    """Three families of prompts served, one under a salt; the 10 largest prefixes,
    checked."""
    sched, worker = make(page_size=4, radix_impl=impl)
    rng = np.random.default_rng(1)
    big, small = rng.integers(3, 500, 120).tolist(), rng.integers(3, 500, 24).tolist()
    for i in range(12):
        sched.add_request(f"b{i}", big + rng.integers(3, 500, 9).tolist(), greedy(3))
        sched.add_request(f"s{i}", small + rng.integers(3, 500, 9).tolist(), greedy(3))
        sched.add_request(f"t{i}", small + [i] * 8, greedy(2), salt="tenant")
    run(sched, worker)
    tree = outline(sched.cache, max_nodes=10)
    nodes = tree["nodes"]
    assert len(nodes) == 10 and tree["total_nodes"] > 10
    assert tree["namespaces"] == ["default", "salted"]  # no salt named
    assert nodes[0]["label_ids"] == big[:16] and nodes[0]["depth"] == 0
    sizes = [n["subtree_tokens"] for n in nodes]
    for i, n in enumerate(nodes):
        assert n["parent"] < i
        kids = [k for k in nodes if k["parent"] == i]
        assert sum(k["subtree_tokens"] for k in kids) + n["tokens"] <= n["subtree_tokens"]
        if n["parent"] >= 0:
            parent = nodes[n["parent"]]
            assert n["depth"] == parent["depth"] + parent["tokens"]
    assert sizes[0] == max(sizes)  # chosen largest first
    return tree


def test_the_outline_is_the_largest_prefixes_on_both_trees():
    tree = outline_of_a_served_tree("python")
    require_built(NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON or "", "the native radix tree")
    assert outline_of_a_served_tree("native") == tree

"""The router's policy (``radixserve.router.policy``), a pure function: no sockets."""

from __future__ import annotations

import pytest

from radixserve.router.policy import PolicyConfig, RoundRobin, choose, imbalanced


def pick(policy, matches, loads, free=None, **kw):
    cfg = PolicyConfig(policy, **kw)
    return choose(cfg, RoundRobin(), matches, loads, free or [0] * len(loads))


def test_cache_aware_prefers_the_longest_match_while_balanced():
    d = pick("cache_aware", [0, 64, 16], [3, 5, 1], balance_abs_threshold=8)
    assert (d.replica, d.reason) == (1, "cache")


def test_cache_aware_goes_to_the_least_loaded_past_both_thresholds():
    # max - min = 10 > 8 and 12 > 1.5 * 2: imbalanced
    d = pick("cache_aware", [0, 64], [2, 12], balance_abs_threshold=8)
    assert (d.replica, d.reason) == (0, "balance")
    # only the absolute threshold passed (30 <= 1.5 * 20): still by cache
    assert pick("cache_aware", [0, 64], [20, 30], balance_abs_threshold=8).replica == 1


def test_ties_go_round_robin_and_no_match_means_least_load_then_free_pages():
    cfg, rr = PolicyConfig("cache_aware"), RoundRobin()
    picks = [choose(cfg, rr, [32, 32, 0], [0, 0, 0], [5, 5, 5]).replica for _ in range(4)]
    assert picks == [0, 1, 0, 1]
    assert pick("cache_aware", [0, 0, 0], [1, 0, 0], [9, 3, 7]).replica == 2
    picks = [choose(cfg, rr, [0, 0], [0, 0], [4, 4]).replica for _ in range(4)]
    assert sorted(picks) == [0, 0, 1, 1]


def test_round_robin_and_least_load_ignore_the_cache():
    cfg, rr = PolicyConfig("round_robin"), RoundRobin()
    assert [choose(cfg, rr, [99, 0, 0], [0, 0, 0], [0, 0, 0]).replica for _ in range(4)] == [
        0, 1, 2, 0,
    ]  # fmt: skip
    assert pick("least_load", [99, 0], [3, 1]).replica == 1


def test_thresholds_and_policy_names_are_checked():
    assert imbalanced([0, 40], PolicyConfig()) and not imbalanced([30, 40], PolicyConfig())
    with pytest.raises(ValueError):
        PolicyConfig("random")
    with pytest.raises(ValueError):
        PolicyConfig(balance_rel_threshold=0.5)

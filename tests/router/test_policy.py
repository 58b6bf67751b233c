"""The router's policy (``radixserve.router.policy``), a pure function: no sockets."""

from __future__ import annotations

import pytest

from radixserve.router.policy import (
    Decision,
    KeyAffinity,
    PolicyConfig,
    RoundRobin,
    choose,
    imbalanced,
    keep_affinity,
)


def pick(policy, matches, loads, free=None, prompt_len=0, **kw):
    cfg = PolicyConfig(policy, **kw)
    return choose(cfg, RoundRobin(), matches, loads, free or [0] * len(loads), prompt_len)


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
    assert imbalanced([0, 65], PolicyConfig()) and not imbalanced([0, 64], PolicyConfig())
    assert not imbalanced([150, 220], PolicyConfig())  # 70 > 64, but 220 <= 1.5 * 150
    with pytest.raises(ValueError):
        PolicyConfig("random")
    with pytest.raises(ValueError):
        PolicyConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError):
        PolicyConfig(cache_threshold=1.5)


def test_a_match_under_the_cache_threshold_is_a_miss():
    # 16 of 100 tokens (a shared chat-template head, say) is not worth a queue:
    # the least loaded replica wins, as when nothing matches.
    d = pick("cache_aware", [16, 0], [3, 1], prompt_len=100, cache_threshold=0.3)
    assert (d.replica, d.reason) == (1, "miss")
    # 31 of 100 passes 0.3: the match wins although replica 0 is busier.
    d = pick("cache_aware", [31, 0], [3, 1], prompt_len=100, cache_threshold=0.3)
    assert (d.replica, d.reason) == (0, "cache")
    # Among misses: least loaded, then the most free pages.
    d = pick("cache_aware", [16, 8, 0], [2, 1, 1], [0, 3, 9], prompt_len=100)
    assert (d.replica, d.reason) == (2, "miss")
    # Imbalance beats any match.
    d = pick("cache_aware", [99, 0], [70, 1], prompt_len=100)
    assert (d.replica, d.reason) == (1, "balance")


def test_a_routing_key_keeps_its_replica_while_the_policy_allows():
    cfg = PolicyConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)
    miss = Decision(0, "miss")
    # A miss everywhere: the key's replica, not the least loaded one.
    assert keep_affinity(cfg, miss, 2, [0, 0, 0], [1, 1, 3]) == Decision(2, "key")
    # Another replica caches more of the prompt, or the load is imbalanced: the policy's.
    assert keep_affinity(cfg, Decision(1, "cache"), 2, [0, 64, 32], [1, 1, 1]).reason == "cache"
    assert keep_affinity(cfg, miss, 2, [0, 0, 0], [0, 0, 9]) == miss
    # No key seen before, or another policy: the decision stands.
    assert keep_affinity(cfg, miss, None, [0, 0], [0, 0]) == miss
    rr = PolicyConfig(policy="round_robin")
    assert keep_affinity(rr, miss, 1, [0, 0], [0, 0]) == miss


def test_key_affinity_keeps_the_newest_keys():
    a = KeyAffinity(max_keys=2)
    a.put((None, "k1"), 0)
    a.put(("tenant", "k1"), 1)  # the same key under another salt is another key
    a.put((None, "k1"), 2)  # used again: the newest
    a.put((None, "k2"), 0)
    assert len(a) == 2 and a.get(("tenant", "k1")) is None
    assert a.get((None, "k1")) == 2 and a.get((None, "k2")) == 0

"""The table of cache features that do not combine (``combinations.py``)."""

from __future__ import annotations

import re

import pytest

from radixserve.combinations import (
    COMBINATIONS,
    FEATURES,
    check_features,
    features_on,
    refusal,
)


@pytest.mark.parametrize("rule", COMBINATIONS, ids=lambda r: "+".join(sorted(r.together)))
def test_each_rule_refuses_its_combination(rule):
    reason = refusal(rule.together, policy="lfu", model="m")
    assert reason is not None
    # The first rule that applies speaks: it is this one unless an earlier one
    # refuses a subset of the same features.
    on = rule.together
    first = next(r for r in COMBINATIONS if r.together <= on and not r.without & on)
    assert reason == first.reason.format(policy="lfu", model="m")
    with pytest.raises(ValueError, match="^" + re.escape(reason) + "$"):
        check_features(rule.together, policy="lfu", model="m")


def test_a_requirement_is_met_by_its_feature():
    assert "needs a host tier" in refusal({"disk_tier"})
    assert refusal({"disk_tier", "host_tier"}) is None


def test_features_that_combine_pass():
    for name in FEATURES:
        if name != "disk_tier":
            assert refusal({name}) is None, name
    check_features({"host_tier", "disk_tier", "kv_events", "lora", "speculation"})
    check_features({"window_pool", "lora", "speculation", "tensor_parallel"})
    check_features({"recurrent_states", "tensor_parallel", "eviction_policy"})


def test_names_fill_the_reason_and_unknown_features_are_refused():
    assert "--radix-eviction-policy lfu needs" in refusal(
        {"native_tree", "eviction_policy"}, policy="lfu"
    )
    assert "(qwen3-next)" in refusal({"recurrent_states", "lora"}, model="qwen3-next")
    with pytest.raises(ValueError, match="unknown cache features"):
        refusal({"windows"})
    assert features_on(a=True, b=False, c=1) == {"a", "c"}

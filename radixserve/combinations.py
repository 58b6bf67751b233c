"""Which cache features combine: one table, and the one check every config runs.

A feature is a capability the KV cache is built with (see ``FEATURES``). The parts
of a server that know a feature is on (``EngineConfig`` from the user's flags,
``scheduler_config`` from the loaded model, ``SchedulerConfig`` when built alone,
the cache's composition in ``radix_impl.py``, the scheduler when KV events are
switched on) each call ``check_features`` with the features they see; the first
rule of ``COMBINATIONS`` that applies raises ``ValueError`` with its reason. So
whether two features work together is decided here and only here, and the error
a user sees is the table's reason.

A rule applies when every feature of ``together`` is on and none of ``without``
is (a rule with ``without`` is a requirement: ``disk_tier`` needs ``host_tier``).
Reasons may name ``{policy}`` (the eviction policy) or ``{model}`` (the model's
name): the caller passes them.
"""

from __future__ import annotations

from typing import NamedTuple

#: The features, and what turns each on.
FEATURES = {
    "no_cache": "--cache none: nothing is kept between requests",
    "native_tree": "--radix-impl native: the C++ radix tree",
    "eviction_policy": "--radix-eviction-policy lfu or priority (not LRU)",
    "window_pool": "a model whose sliding layers keep their K/V in a window pool",
    "recurrent_states": "a hybrid model's recurrent-state snapshots in the tree",
    "host_tier": "--host-cache-gb: the host tier (L2) below the pool",
    "disk_tier": "--disk-cache-dir: the disk tier (L3) below the host tier",
    "kv_store": "--kv-store: the KV store shared by replicas, below the host tier",
    "tensor_parallel": "--tp > 1",
    "speculation": "--speculative-algorithm ngram or radix",
    "lora": "LoRA adapters",
    "kv_events": "--kv-events: the tree's changes published as page keys",
}


class Rule(NamedTuple):
    together: frozenset[str]
    reason: str
    without: frozenset[str] = frozenset()


def _rule(together: str, reason: str, without: str = "") -> Rule:
    return Rule(frozenset(together.split()), reason, frozenset(without.split()))


#: Every combination that cannot work, in the order they are checked.
COMBINATIONS: tuple[Rule, ...] = (
    _rule(
        "host_tier no_cache",
        "cache tiers (--host-cache-gb, --disk-cache-dir) need --cache radix: "
        "--cache none keeps nothing to demote",
    ),
    _rule(
        "disk_tier",
        "--disk-cache-dir needs a host tier: pages reach the disk through host "
        "memory; pass --host-cache-gb N (an Engine: host_cache_gb=N), N GiB of host "
        "memory, e.g. 4 (radixserve launch picks one from free memory when the flag "
        "is not given)",
        without="host_tier",
    ),
    _rule(
        "disk_tier tensor_parallel",
        "the disk tier (--disk-cache-dir) does not support tensor parallelism yet "
        "(--tp > 1); the host tier does",
    ),
    _rule("kv_store no_cache", "--kv-store needs --cache radix: --cache none keeps no prefix"),
    _rule(
        "kv_store tensor_parallel",
        "the KV store (--kv-store) does not support tensor parallelism yet (--tp > 1): "
        "each rank holds its own KV heads",
    ),
    _rule(
        "kv_store window_pool",
        "the KV store (--kv-store) does not hold the sliding layers' window pages yet: "
        "use --sliding-pool-pages 0 (one pool for every layer)",
    ),
    _rule(
        "kv_store recurrent_states",
        "the KV store (--kv-store) does not hold recurrent states: {model} is a hybrid model",
    ),
    _rule(
        "native_tree eviction_policy",
        "the native radix tree evicts LRU only; --radix-eviction-policy {policy} "
        "needs --radix-impl python or auto",
    ),
    _rule(
        "native_tree window_pool",
        "the native radix tree keeps no window pages, which a model with sliding "
        "layers in a window pool needs: use --radix-impl python or auto (or "
        "--sliding-pool-pages 0)",
    ),
    _rule(
        "native_tree recurrent_states",
        "the native radix tree keeps no recurrent-state snapshots, which a hybrid "
        "model's cache needs: use --radix-impl python or auto",
    ),
    _rule(
        "window_pool host_tier",
        "cache tiers (--host-cache-gb) do not hold the sliding layers' window pages "
        "yet: use --sliding-pool-pages 0 (one pool for every layer)",
    ),
    _rule(
        "recurrent_states host_tier",
        "cache tiers (--host-cache-gb) do not hold recurrent states: {model} is a hybrid model",
    ),
    # A recurrent state cannot be rolled back past rejected drafts.
    _rule(
        "recurrent_states speculation",
        "speculative decoding (--speculative-algorithm) does not run hybrid models: "
        "{model}'s recurrent state cannot be rolled back past rejected drafts",
    ),
    _rule("recurrent_states lora", "LoRA adapters do not apply to hybrid models ({model})"),
    _rule(
        "kv_events recurrent_states",
        "KV cache events do not describe recurrent-state snapshots yet: not "
        "available for hybrid models",
    ),
    _rule(
        "kv_events window_pool",
        "KV cache events do not describe window pages yet: not available for a "
        "model whose sliding layers have a window pool (--sliding-pool-pages 0)",
    ),
)

for _r in COMBINATIONS:  # a typo in the table would silently never apply
    assert _r.together | _r.without <= FEATURES.keys(), _r


def refusal(features: set[str] | frozenset[str], **names: str) -> str | None:
    """The reason of the first rule that refuses ``features`` (None: they combine);
    ``names`` fill the reason's ``{policy}`` / ``{model}``."""
    unknown = set(features) - FEATURES.keys()
    if unknown:
        raise ValueError(f"unknown cache features {sorted(unknown)}")
    for rule in COMBINATIONS:
        if rule.together <= features and not rule.without & features:
            return rule.reason.format_map(_Names(names))
    return None


def check_features(features: set[str] | frozenset[str], **names: str) -> None:
    """Raise ValueError with the table's reason when ``features`` do not combine."""
    reason = refusal(features, **names)
    if reason is not None:
        raise ValueError(reason)


def features_on(**on: bool) -> set[str]:
    """The names given True: ``features_on(host_tier=x, disk_tier=y)``."""
    return {name for name, value in on.items() if value}


class _Names(dict):
    def __missing__(self, key: str) -> str:
        return f"the {key}"  # a caller that does not know the model's name

"""Which replica gets a request: cache-aware, round robin or least load.

``choose`` is a pure function of what the router knows at that moment, so it is
tested without sockets:

* ``matches[i]``: the pages of the request's prompt that replica i caches (from
  its mirror, ``KVMirror.match``), in the request's salt;
* ``loads[i]``: requests on replica i (running + waiting: the larger of what the
  router has in flight there and what the replica last reported);
* ``free[i]``: the pages replica i could hand out now (free + evictable).

``cache_aware`` (SGLang's router's rule, with exact matches instead of its
approximate per-worker trees):

1. the load is imbalanced when both ``max - min > balance_abs_threshold`` and
   ``max > balance_rel_threshold * min`` hold; then the least loaded replica
   wins, whatever it caches;
2. otherwise, when the longest match covers more than ``cache_threshold`` of
   the prompt (``prompt_len``: the tokens the scheduler can match), the replica
   holding it wins;
3. otherwise (a miss: nothing, or only a short common head such as a chat
   template's system prompt, which every replica soon holds) the least loaded
   wins, then the one with the most free pages (SGLang: the smallest tree).

The thresholds are counts of requests, so they only mean something beside
what a replica runs at once: ``radixserve launch --dp`` sets the absolute one
to the replicas' ``--max-running-requests`` unless told otherwise, so a
replica keeps the prompts it caches until it would queue a whole batch more
than another (64, SGLang's default, is also the replicas' default batch).
``least_load``: always the least loaded (then the most free pages).

A request with a routing key (OpenAI's ``prompt_cache_key``, within its salt) goes
to the replica that served the key last (``KeyAffinity``) under ``cache_aware``,
unless the load is imbalanced or another replica caches a longer prefix of it: an
agent session's next turn then finds its context where it left it even while that
context sits in the replica's host tier, which the mirror does not show.
``round_robin``: in turn. Ties go round robin among the tied replicas, so
prompts nobody caches spread evenly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.options import check_options, option

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class PolicyConfig:
    """The routing policy's options: ``radixserve router``'s flags, and those of
    ``radixserve launch --dp``'s router (``launch_flags.py``)."""

    policy: str = option(
        "cache_aware",
        "how the router picks a replica: cache_aware, the longest cached prefix unless "
        "the load is imbalanced; round_robin; least_load (docs/scale-out.md)",
        choices=POLICIES,
    )
    balance_abs_threshold: int = option(
        64,
        "cache_aware: the load is imbalanced when the busiest replica has more than this "
        "many requests over the least busy one (size it to what a replica runs at once, "
        "its --max-running-requests, as launch --dp does by default) ...",
        at_least=0,
    )
    balance_rel_threshold: float = option(
        1.5,
        "... and more than this times its load; then the least loaded replica wins",
        at_least=1.0,
    )
    cache_threshold: float = option(  # 1: never by the cache
        0.3,
        "cache_aware: route by the cache only when the longest match covers more than "
        "this share of the prompt; else to the least loaded replica",
        at_least=0.0,
        at_most=1.0,
    )

    def __post_init__(self) -> None:
        check_options(self)


@dataclass(frozen=True)
class Decision:
    replica: int  # index into the candidates given
    reason: str  # "cache", "balance", "miss", "least_load", "round_robin", "key"


class KeyAffinity:
    """The replica (by its index in the router) each routing key went to last: the
    ``max_keys`` most recently used keys."""

    def __init__(self, max_keys: int = 65536) -> None:
        self.max_keys = max_keys
        self._by_key: OrderedDict[tuple[str | None, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: tuple[str | None, str]) -> int | None:
        return self._by_key.get(key)

    def put(self, key: tuple[str | None, str], replica: int) -> None:
        self._by_key[key] = replica
        self._by_key.move_to_end(key)
        while len(self._by_key) > self.max_keys:
            self._by_key.popitem(last=False)


def keep_affinity(
    cfg: PolicyConfig, decision: Decision, preferred: int | None,
    matches: Sequence[int], loads: Sequence[int],
) -> Decision:  # fmt: skip
    """``decision``, or the key's ``preferred`` candidate (an index into the sequences)
    under ``cache_aware`` when the load is balanced and it caches as much as any."""
    if preferred is None or cfg.policy != "cache_aware" or preferred == decision.replica:
        return decision
    if imbalanced(loads, cfg) or matches[preferred] < max(matches):
        return decision
    return Decision(preferred, "key")


class RoundRobin:
    """A turn counter shared by every choice, so ties rotate across requests."""

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, tied: Sequence[int]) -> int:
        choice = tied[self.turn % len(tied)]
        self.turn += 1
        return choice


def imbalanced(loads: Sequence[int], cfg: PolicyConfig) -> bool:
    lo, hi = min(loads), max(loads)
    return hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo


def choose(
    cfg: PolicyConfig,
    rr: RoundRobin,
    matches: Sequence[int],
    loads: Sequence[int],
    free: Sequence[int],
    prompt_len: int = 0,
) -> Decision:
    """The replica (an index into the sequences, all of one length >= 1) for a request
    whose prompt has ``prompt_len`` matchable tokens (``matches`` in tokens too)."""
    n = len(loads)
    assert n and len(matches) == len(free) == n
    everyone = list(range(n))
    if cfg.policy == "round_robin":
        return Decision(rr.pick(everyone), "round_robin")
    reason = "least_load"
    if cfg.policy == "cache_aware":
        reason = "balance" if imbalanced(loads, cfg) else "miss"
        best = max(matches)
        if reason == "miss" and best > 0 and best > cfg.cache_threshold * prompt_len:
            return Decision(rr.pick([i for i in everyone if matches[i] == best]), "cache")
    least = min(loads)
    tied = [i for i in everyone if loads[i] == least]
    most_free = max(free[i] for i in tied)
    tied = [i for i in tied if free[i] == most_free]
    return Decision(rr.pick(tied), reason)

"""Which replica gets a request: cache-aware, round robin or least load.

``choose`` is a pure function of what the router knows at that moment, so it is
tested without sockets:

* ``matches[i]``: the pages of the request's prompt that replica i caches (from
  its mirror, ``KVMirror.match``), in the request's salt;
* ``loads[i]``: requests on replica i (running + waiting: the larger of what the
  router has in flight there and what the replica last reported);
* ``free[i]``: the pages replica i could hand out now (free + evictable).

``cache_aware`` (as SGLang's router): while the load is balanced, the replica
with the longest cached prefix wins; the load is imbalanced when both
``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``
hold, and then the least loaded replica wins. ``least_load``: always the least
loaded (then the most free pages). ``round_robin``: in turn. Ties go round
robin among the tied replicas, so prompts nobody caches spread evenly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("cache_aware", "round_robin", "least_load")


@dataclass(frozen=True)
class PolicyConfig:
    policy: str = "cache_aware"
    balance_abs_threshold: int = 32  # requests
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: absolute >= 0, relative >= 1")


@dataclass(frozen=True)
class Decision:
    replica: int  # index into the candidates given
    reason: str  # "cache", "balance", "least_load", "round_robin"


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
) -> Decision:
    """The replica (an index into the sequences, all of one length >= 1) for a request."""
    n = len(loads)
    assert n and len(matches) == len(free) == n
    everyone = list(range(n))
    if cfg.policy == "round_robin":
        return Decision(rr.pick(everyone), "round_robin")
    if cfg.policy == "cache_aware" and not imbalanced(loads, cfg):
        best = max(matches)
        if best > 0:
            return Decision(rr.pick([i for i in everyone if matches[i] == best]), "cache")
    least = min(loads)
    tied = [i for i in everyone if loads[i] == least]
    most_free = max(free[i] for i in tied)
    tied = [i for i in tied if free[i] == most_free]
    reason = "balance" if cfg.policy == "cache_aware" else "least_load"
    return Decision(rr.pick(tied), reason)

"""Admission order for waiting requests, and the in-batch shared-prefix test."""

from __future__ import annotations

from collections.abc import Iterable

from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_cache import KVCacheManager
from radixserve.scheduler.request import Request


def order_waiting(
    waiting: Iterable[Request], kv: KVCacheManager, config: SchedulerConfig
) -> list[Request]:
    """The order in which to try admitting waiting requests.

    ``fcfs``: arrival order (retracted requests first: they were queued at the
    front). ``lpm``: longest cached prefix first (``peek_prefix``, which
    changes nothing in the tree), except that a request passed over for
    ``max_wait_steps`` steps goes before every younger one, so nothing starves.
    With more than ``lpm_max_waiting`` requests waiting, lpm falls back to fcfs:
    peeking every prompt each step would cost more than it saves.
    ``priority``: lower ``priority`` first, lpm (as above) within a level.
    """
    reqs = list(waiting)
    if config.schedule_policy == "priority":
        # Stable: within a priority level the lpm order stands.
        return sorted(_lpm(reqs, kv, config), key=lambda r: r.sampling.priority)
    return _lpm(reqs, kv, config)


def _lpm(reqs: list[Request], kv: KVCacheManager, config: SchedulerConfig) -> list[Request]:
    if (
        config.schedule_policy == "fcfs"
        or not kv.enabled
        or len(reqs) > config.lpm_max_waiting
        or len(reqs) < 2
    ):
        return reqs
    limit = config.max_wait_steps
    keyed = [
        (r.waited_steps < limit, -kv.peek(r), r.arrival if r.waited_steps >= limit else 0, i)
        for i, r in enumerate(reqs)
    ]
    keyed.sort()
    return [reqs[k[3]] for k in keyed]


def shared_prefix_len(req: Request, in_flight: list[Request]) -> int:
    """The longest prefix of ``req``'s matchable tokens (``match_len``) that it
    shares with a prompt being prefilled in this step (same salt)."""
    tokens = req.tokens[: req.match_len]
    best = 0
    for other in in_flight:
        if other.salt != req.salt:
            continue
        n = min(len(tokens), other.num_tokens)
        if n <= best:
            continue
        neq = tokens[:n] != other.tokens[:n]
        best = max(best, int(neq.argmax()) if neq.any() else n)
    return best

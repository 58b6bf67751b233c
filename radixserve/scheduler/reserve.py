"""Decode reservations: the share of the pages running requests may still need that
admission keeps free for them.

Each running request reserves ``ratio`` of the pages it may still need to reach its
final length (its prompt plus ``max_tokens``, or the context). The ratio starts at
``decode_reserve_ratio``, falls each step with decodes towards
``decode_reserve_min_ratio`` (over ``decode_reserve_decay_steps`` steps) and goes back
up after a retraction: a request that asks for a whole context of output reserves it
only while it is likely to produce it, and retraction is the safety net when it does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from radixserve.scheduler.config import SchedulerConfig
from radixserve.scheduler.kv_cache import KVCacheManager
from radixserve.scheduler.request import Request


class DecodeReserve:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.ratio = config.decode_reserve_ratio

    def decay(self) -> None:
        """One step with decodes: the ratio falls one step towards its floor."""
        cfg = self.config
        floor = min(cfg.decode_reserve_min_ratio, cfg.decode_reserve_ratio)
        if cfg.decode_reserve_decay_steps == 0 or self.ratio <= floor:
            return
        step = (cfg.decode_reserve_ratio - floor) / cfg.decode_reserve_decay_steps
        self.ratio = max(floor, self.ratio - step)

    def reset(self) -> None:
        """A retraction: reservations proved too optimistic; reserve fully again."""
        self.ratio = self.config.decode_reserve_ratio

    def of(self, pages: int) -> int:
        """What a request that may still need ``pages`` pages reserves."""
        return math.ceil(pages * self.ratio)

    def held(self, running: Iterable[Request], kv: KVCacheManager) -> int:
        """The pages ``running`` requests reserve together."""
        if self.ratio == 0.0:
            return 0
        total = 0
        for r in running:
            remaining = kv.pages_missing(r, r.final_len)
            if remaining > 0:
                total += self.of(remaining)
        return total

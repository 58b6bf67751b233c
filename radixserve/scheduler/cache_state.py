"""What the KV cache keeps per request beyond its page table: ``Request.cache_state``.

Only the cache side reads or writes these (``KVCacheManager`` for recurrent states,
``RequestWindows`` for window pages); the rest of the scheduler never looks inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_NO_PAGES = np.zeros(0, dtype=np.int32)


@dataclass(eq=False, slots=True)
class RequestCacheState:
    # Hybrid models (KVCacheManager.plan_states): the tree's snapshot to restore at
    # the next step (-1: none), the snapshots this request holds outside the tree (at
    # most two) and the positions its state was saved at in them (ascending), and
    # where its match stopped short of the cached KV (a divergence point to snapshot;
    # 0: none).
    restore_state: int = -1
    own_states: list[int] = field(default_factory=list)
    own_states_at: list[int] = field(default_factory=list)
    diverge_at: int = 0
    # Models with sliding layers (KVCacheManager.plan_window): the window pages of
    # table entries [0, win_len), aligned with the page table; the request holds one
    # reference on each entry >= 0 (entries below ``win_low`` are -1: out of its
    # window); the first ``win_sent`` entries were sent to the worker.
    win: np.ndarray = field(default_factory=lambda: _NO_PAGES)
    win_low: int = 0
    win_len: int = 0
    win_sent: int = 0
    # The shared KV store (KVCacheManager.fetch_from_store): the run reading pages
    # into the request's own pages (0: none), and whether its hit counts (the
    # request's first admission).
    store_run: int = 0
    store_counts: bool = False

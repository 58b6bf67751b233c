"""What the dashboard shows of a running scheduler (docs/http.md, "Dashboard").

``CacheMonitor`` keeps, from what the scheduler already counts, a bounded history
and answers ``snapshot()`` with one small JSON-ready dict, recomputed at most every
``ttl`` seconds (the page and its JSON endpoint may be polled hard: a poll between
two recomputations costs a dict lookup):

* **history**: every ``interval`` seconds (``tick``, once per scheduler step: one
  clock read when nothing is due) a point of the cumulative counters: hit and
  prompt tokens, the offline-optimal hit tokens of the same requests, pages evicted;
  the last ``HISTORY`` points are kept, so the page draws rates over time.
* **the offline optimum of the recent window**: each finished request's prompt is
  matched against the last ``WINDOW`` requests' sequences (prompt and output with
  KV), as an infinite cache that held exactly them would serve it (whole pages, at
  most ``match_len``: ``benchmark/optimal.py``'s rule): the sequences are kept as
  bytes in sorted order, and the longest common prefix with any of them is the
  longer one with its two neighbours in that order (O(log W) comparisons and two
  prefix scans per request). Under the same salt only.
* **occupancy**: pool, host and disk pages; running and waiting requests.
* **the tree**: its ``max_nodes`` largest prefixes (by tokens in and below them),
  each with its first ``LABEL_TOKENS`` tokens (the tokenizer writes them as words),
  tokens, cached sequences, recency and whether a request holds it (``outline``).
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from radixserve.scheduler.tree_view import TreeView, core_tree

if TYPE_CHECKING:
    from radixserve.scheduler.prefix_cache import PrefixCache
    from radixserve.scheduler.request import Request


class SchedulerView(Protocol):
    """What the figures read of the scheduler (``scheduler.Scheduler``, which owns the
    monitor: typed here by its shape, so this module sits below it)."""

    monitor: CacheMonitor
    cache: PrefixCache
    kv: Any
    hit_tokens: int
    query_tokens: int

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def stats(self) -> dict: ...


HISTORY = 300  # points kept (5 minutes at one a second)
WINDOW = 256  # requests the offline optimum looks back on
MAX_SEQ_TOKENS = 8192  # tokens kept of each windowed sequence
LABEL_TOKENS = 16
MAX_NODES = 64


class WindowOptimum:
    """The offline-optimal hit of each prompt over the last ``size`` sequences."""

    def __init__(self, page_size: int, size: int = WINDOW) -> None:
        self.page_size = page_size
        self.size = size
        self._order: deque[bytes] = deque()  # arrival order, to drop the oldest
        self._sorted: list[bytes] = []

    def hit(self, prompt: np.ndarray, match_len: int, salt: str | None) -> int:
        """Tokens of ``prompt`` an infinite cache of the window would serve."""
        key = _key(prompt[:MAX_SEQ_TOKENS], salt)
        i = bisect.bisect_left(self._sorted, key)
        best = 0
        for j in (i - 1, i):
            if 0 <= j < len(self._sorted):
                best = max(best, _common_bytes(self._sorted[j], key))
        tokens = max(0, (best - len(_tag(salt))) // 4)
        usable = min(tokens, match_len)
        return usable - usable % self.page_size

    def add(self, seq: np.ndarray, salt: str | None) -> None:
        key = _key(seq[:MAX_SEQ_TOKENS], salt)
        bisect.insort(self._sorted, key)
        self._order.append(key)
        if len(self._order) > self.size:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]


def _tag(salt: str | None) -> bytes:
    return b"\0" if salt is None else b"\1" + salt.encode() + b"\0"


def _key(tokens: np.ndarray, salt: str | None) -> bytes:
    # Big-endian: byte order then follows token order, so a common byte prefix of
    # two keys covers whole tokens plus at most 3 bytes of the next one.
    return _tag(salt) + tokens.astype(">i4").tobytes()


def _common_bytes(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n)
    neq = np.flatnonzero(x != y)
    return int(neq[0]) if len(neq) else n


class CacheMonitor:
    """The dashboard's figures (module docstring)."""

    def __init__(
        self,
        page_size: int,
        interval: float = 1.0,
        ttl: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.ttl = ttl
        self.clock = clock
        self.window = WindowOptimum(page_size)
        self.optimal_tokens = 0  # offline-optimal hits of the finished requests
        self.finished_hit_tokens = 0  # their real hits
        self.finished_prompt_tokens = 0
        self.history: deque[list] = deque(maxlen=HISTORY)
        self._next_point = 0.0
        self._snapshot: dict | None = None
        self._snapshot_at = -1.0

    def finished(self, req: Request) -> None:
        """A request (one sample) left after it ran: score its prompt against the window,
        then add what it leaves in the cache."""
        if req.stats.cached_tokens < 0:
            return  # never admitted: not a query of the cache
        prompt = req.tokens[: req.prompt_len]
        self.optimal_tokens += self.window.hit(prompt, req.prompt_len - 1, req.salt)
        self.finished_hit_tokens += req.stats.cached_tokens
        self.finished_prompt_tokens += req.prompt_len
        self.window.add(req.tokens[: req.num_tokens - 1], req.salt)

    def tick(self, scheduler: SchedulerView) -> None:
        """Record a history point (``history_point``) when one is due."""
        now = self.clock()
        if now >= self._next_point:
            self._next_point = now + self.interval
            self.history.append([round(now, 3), *history_point(scheduler)])

    def snapshot(self, build: Callable[[], dict]) -> dict:
        """``build()``'s dict, rebuilt at most every ``ttl`` seconds."""
        now = self.clock()
        if self._snapshot is None or now - self._snapshot_at >= self.ttl:
            self._snapshot = build()
            self._snapshot["at"] = round(now, 3)
            self._snapshot_at = now
        return self._snapshot


def outline(cache: PrefixCache, max_nodes: int = MAX_NODES) -> dict:
    """The tree's ``max_nodes`` largest prefixes, every namespace (salts are not named:
    a namespace is "default", "salted" or "adapter"): nodes in the order chosen
    (largest first), each with its parent's index in the list (-1: a top node)."""
    tree = core_tree(cache)
    if tree is None:
        return {"namespaces": [], "nodes": []}
    view = TreeView(tree.export_nodes(LABEL_TOKENS))
    names = [
        "default" if s is None else ("adapter" if s.startswith("\0") else "salted")
        for s in view.salts
    ]
    newest = int(view.last_access.max()) if view.size else 0
    heap = [(-int(view.subtree[i]), i, -1) for i in range(*view.levels[0])]
    heapq.heapify(heap)
    nodes: list[dict] = []
    while heap and len(nodes) < max_nodes:
        _, i, parent = heapq.heappop(heap)
        mine = len(nodes)
        nodes.append(
            {
                "parent": parent,
                "namespace": int(view.namespace[i]),
                "depth": int(view.depth[i]),
                "tokens": int(view.num_tokens[i]),
                "subtree_tokens": int(view.subtree[i]),
                "sequences": int(view.leaves[i]),
                "age": newest - int(view.last_access[i]),  # LRU clock ticks since its last use
                "locked": bool(view.lock_ref[i] > 0),
                "label_ids": view.label(i).tolist(),
            }
        )
        for c in view.children(i):
            heapq.heappush(heap, (-int(view.subtree[c]), c, mine))
    return {"namespaces": names, "nodes": nodes, "total_nodes": view.size}


#: The values of each history point, after its time (``history_fields`` in the JSON).
HISTORY_FIELDS = [
    "hit_tokens",  # every admitted request's cached tokens (at admission)
    "query_tokens",  # and prompt tokens
    "finished_hit_tokens",  # the finished requests' cached tokens,
    "finished_prompt_tokens",  # prompt tokens,
    "optimal_tokens",  # and offline-optimal hits over the recent window
    "evicted_pages",
    "running",
    "waiting",
]


def history_point(s: SchedulerView) -> list:
    m = s.monitor
    return [
        s.hit_tokens,
        s.query_tokens,
        m.finished_hit_tokens,
        m.finished_prompt_tokens,
        m.optimal_tokens,
        s.kv.evicted_pages,
        s.num_running,
        s.num_waiting,
    ]


def dashboard_data(s: SchedulerView) -> dict:
    """The dashboard's JSON (token ids in the tree's labels; the tokenizer adds text)."""
    stats = s.stats()
    keep = (
        "num_pages", "page_size", "pages_free", "pages_cached", "pages_used",
        "pages_evictable", "hit_tokens", "query_tokens", "running", "waiting",
        "evicted_pages", "host_pages", "host_pages_cached", "disk_pages_cached",
        "disk_pages_max", "pages_demoted", "pages_promoted",
    )  # fmt: skip
    m = s.monitor
    return {
        "stats": {k: stats[k] for k in keep if k in stats},
        "history_fields": ["t", *HISTORY_FIELDS],
        "history": list(m.history),
        "window_requests": m.window.size,
        "tree": outline(s.cache),
    }

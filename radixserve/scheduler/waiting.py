"""The waiting queue: requests in arrival order, retracted ones at the front.

A deque would do, but removing a request from the middle of one scans it, and
requests leave the queue from anywhere (admitted out of order by the lpm policy,
aborted, failed): aborting every sample of a long queue newest-first was
quadratic. Here each request is a key of an insertion-ordered dict (``Request``
hashes by identity), so ``append``, ``appendleft`` and ``remove`` are O(1) and
iteration is arrival order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from radixserve.scheduler.request import Request


class WaitingQueue:
    """The subset of ``collections.deque`` the scheduler uses, each call O(1)
    (iteration O(n))."""

    __slots__ = ("_reqs",)

    def __init__(self, reqs: Iterable[Request] = ()) -> None:
        self._reqs: OrderedDict[Request, None] = OrderedDict.fromkeys(reqs)

    def append(self, req: Request) -> None:
        self._reqs[req] = None

    def extend(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self._reqs[req] = None

    def appendleft(self, req: Request) -> None:
        """Queue ``req`` before every other (a retracted request goes first)."""
        self._reqs[req] = None
        self._reqs.move_to_end(req, last=False)

    def remove(self, req: Request) -> None:
        """Take ``req`` out; ValueError if it is not queued (as ``deque.remove``)."""
        try:
            del self._reqs[req]
        except KeyError:
            raise ValueError("the request is not waiting") from None

    def __contains__(self, req: object) -> bool:
        return req in self._reqs

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __repr__(self) -> str:
        return f"WaitingQueue({list(self._reqs)!r})"


# Upper bounds (seconds) of the queue-time histogram's buckets; +Inf is implied.
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Priorities are any integers a client sends: the first this many levels seen get a
# series of their own, the rest share "other" (a bounded number of series).
MAX_QUEUE_LEVELS = 16


class QueueTimes:
    """Time from arrival to first admission, a histogram per priority level.

    Cumulative from the start, as Prometheus histograms are; ``snapshot()`` is the
    ``queue_time`` entry of the scheduler's stats: ``{"bounds": QUEUE_BUCKETS,
    "levels": {level: {"buckets": [count per bound, then +Inf; not cumulative],
    "sum": seconds, "count": n}}}``, each level a string ("other" past
    MAX_QUEUE_LEVELS)."""

    __slots__ = ("_levels",)

    def __init__(self) -> None:
        self._levels: dict[str, tuple[list[int], list[float]]] = {}

    def observe(self, priority: int, seconds: float) -> None:
        key = str(priority)
        if key not in self._levels and len(self._levels) >= MAX_QUEUE_LEVELS:
            key = "other"
        counts, total = self._levels.setdefault(key, ([0] * (len(QUEUE_BUCKETS) + 1), [0.0]))
        i = next((i for i, bound in enumerate(QUEUE_BUCKETS) if seconds <= bound), -1)
        counts[i] += 1
        total[0] += seconds

    def snapshot(self) -> dict:
        levels = {
            k: {"buckets": list(c), "sum": t[0], "count": sum(c)}
            for k, (c, t) in self._levels.items()
        }
        return {"bounds": list(QUEUE_BUCKETS), "levels": levels}

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

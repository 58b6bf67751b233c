"""The running requests: those holding a worker slot, in admission order, and the slots.

A request joins when it is admitted (``add``: it takes a free slot and the next
admission number) and leaves when it finishes or is retracted (``remove``: its slot
is free again). Slots are numbered 0 .. ``max_running_requests - 1``; a slot the
worker has been told of (the request was ``announced``) is named in the next step's
``release`` so the worker clears it; a LOADING request's slot never reached the
worker and is reused silently. At most one running request is the **chunked** one,
whose prompt continues next step; it stops being so when its prefill is done or it
leaves.

Contract: the request's KV is released (``KVCacheManager.release``) before it leaves,
while it still holds its slot (a hybrid model's state is saved from the slot).
"""

from __future__ import annotations

from collections.abc import Iterator

from radixserve.scheduler.request import ReqStatus, Request


class RunningSet:
    """The running requests (admission order), their slots and the chunked prefill."""

    def __init__(self, max_running_requests: int) -> None:
        self.max_running_requests = max_running_requests
        self._reqs: list[Request] = []
        self.chunked: Request | None = None  # the request whose prefill continues next step
        self._free_slots = list(range(max_running_requests - 1, -1, -1))
        self._release: list[int] = []  # slots to clear on the worker with the next step
        self._admissions = 0

    def add(self, req: Request) -> None:
        """Admit ``req``: a free slot and the next admission number."""
        req.slot = self._free_slots.pop()
        req.admitted = self._admissions
        self._admissions += 1
        self._reqs.append(req)

    def remove(self, req: Request) -> None:
        """``req`` leaves (finished or retracted); its slot is free again."""
        self._reqs.remove(req)
        if req is self.chunked:
            self.chunked = None
        if req.announced:  # a LOADING request's slot never reached the worker
            self._release.append(req.slot)
        self._free_slots.append(req.slot)
        req.slot = None

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def take_released(self) -> list[int]:
        """The slots freed since the last step, for the worker to clear; taken once."""
        release, self._release = self._release, []
        return release

    @property
    def num_releasing(self) -> int:
        """Freed slots the worker is not told of yet."""
        return len(self._release)

    def decoding(self) -> list[Request]:
        """The requests past their prefill (the chunked one aside), admission order."""
        return [r for r in self._reqs if r is not self.chunked and r.status is ReqStatus.DECODE]

    def newest(self) -> Request:
        return max(self._reqs, key=lambda r: r.admitted)

    def check_idle(self) -> None:
        assert not self._reqs, "requests are running"
        assert len(self._free_slots) == self.max_running_requests, "a slot leaked"

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __getitem__(self, i: int) -> Request:
        return self._reqs[i]

"""Host-to-device copies of a step's small index arrays without a host sync.

``tensor.to("cuda")`` from ordinary (pageable) memory blocks the host until the
copy is done, which means until every kernel queued before it has run: one such
copy per step turns the GPU's queue into a lockstep. A ``Staging`` instead owns a
pinned host buffer, reused every step, and copies from it with
``non_blocking=True``: the host returns at once and the copy runs in stream
order.

The one hazard is rewriting the pinned buffer while an earlier copy from it is
still queued. Every use records an event after its copies; the next use waits on
that event before writing (``guard``). In steady state the event has long fired
(the previous step's sampled tokens were read, which waits for everything), so
the wait costs nothing; it is there so that the contract holds without relying
on that.

On a CPU device there is nothing to pin or to wait for: the copies are plain
(synchronous) copies and ``event`` is None. Tests pass ``event_factory`` to see
the guard at work on CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

#: Entries a staging buffer starts with; it doubles when a step needs more.
INITIAL_CAPACITY = 1024


def default_event_factory(device: torch.device) -> Callable[[], Any] | None:
    """``torch.cuda.Event`` on CUDA (no timing: cheaper), None elsewhere."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.Event(enable_timing=False)


class Staging:
    """A pinned host buffer (and optionally a device one) of one dtype, reused every step.

    ``host(parts)`` packs arrays into the host buffer and returns views of it (for APIs
    that want host tensors, e.g. FlashInfer's ``plan``, which copies them itself);
    ``to_device(parts)`` also copies them into the device buffer and returns device
    views. Call ``record()`` after the last operation that reads the host views (this
    class does it itself in ``to_device``). Views returned by one call are valid until
    the next call.
    """

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        capacity: int = INITIAL_CAPACITY,
        event_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self._pin = self.device.type == "cuda"
        self._make_event = event_factory or default_event_factory(self.device)
        self._event: Any = None
        self._host = self._alloc_host(capacity)
        self._dev: torch.Tensor | None = None
        self.waits = 0  # guard() calls that found an event to wait on (for tests)
        self.grows = 0  # times a buffer was reallocated (for tests)

    def _alloc_host(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=self.dtype, pin_memory=self._pin)

    def guard(self) -> None:
        """Wait until the copies from the last use of the host buffer are done."""
        if self._event is not None:
            self._event.synchronize()
            self.waits += 1
            self._event = None

    def record(self) -> None:
        """Mark the point after which the host buffer may be rewritten."""
        if self._make_event is not None:
            self._event = self._make_event()
            self._event.record()

    def host(self, parts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Host views holding ``parts`` (after waiting for the last use's copies)."""
        self.guard()
        sizes = [len(p) for p in parts]
        n = sum(sizes)
        if n > self._host.numel():
            # The old buffer may still be read by a queued copy: torch's pinned-memory
            # allocator keeps it alive until that copy's stream has passed it.
            self._host = self._alloc_host(max(n, 2 * self._host.numel()))
            self.grows += 1
        flat = self._host[:n]
        if n:
            np.concatenate(parts, out=flat.numpy(), casting="unsafe")
        return list(flat.split(sizes))

    def to_device(self, parts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device views holding ``parts``, copied without blocking the host."""
        views = self.host(parts)
        n = sum(v.numel() for v in views)
        if self._dev is None or self._dev.numel() < n:
            # Kernels of the previous step that read the old device buffer are queued
            # before anything that reuses its memory (the caching allocator is stream-ordered).
            self._dev = torch.empty(
                max(n, self._host.numel()), dtype=self.dtype, device=self.device
            )
            self.grows += 1
        dev = self._dev[:n]
        dev.copy_(self._host[:n], non_blocking=True)
        self.record()
        return list(dev.split([v.numel() for v in views]))

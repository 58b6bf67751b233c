"""Memory that large request bodies leave behind in the HTTP front.

A failed request leaves reference cycles (an exception's traceback holds the
frames of the tasks that raised it, and the tasks hold the exception), and the
frames hold the request: its body, the parsed prompt, the message sent on. The
cyclic collector runs by counts of container objects, not by bytes, so a few
such requests of several MiB each stayed resident until a full collection that
came dozens of requests later (120 rejected 5 MiB prompts grew the front from 73
to 238 MiB). And glibc's dynamic mmap threshold, raised by the first large free,
then served the next large bodies from the heap, which keeps freed memory.

``LargeBodies`` therefore: fixes glibc's mmap threshold at ``MMAP_THRESHOLD`` in
this process (blocks that large are mapped and unmapped, so a freed body goes
back to the kernel); and after a body of at least ``LARGE_BODY_BYTES``, runs
``gc.collect()`` once that request has ended (``COLLECT_AFTER_S`` later), or
before the next large body is read, whichever comes first. Small requests never
pay for it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc

LARGE_BODY_BYTES = 1 << 20
MMAP_THRESHOLD = 1 << 20
COLLECT_AFTER_S = 0.5
M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>


def map_large_blocks() -> bool:
    """Serve blocks of ``MMAP_THRESHOLD`` and more with mmap for good (glibc only);
    whether glibc took it."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1


class LargeBodies:
    """Collects the cycles a large request leaves, soon after it."""

    def __init__(self) -> None:
        self.pending = False  # a large body was read since the last collection
        self._timer: asyncio.TimerHandle | None = None
        self.collections = 0

    def read(self, size: int) -> None:
        """A body of ``size`` bytes is about to be parsed (call in the event loop)."""
        if size < LARGE_BODY_BYTES:
            return
        if self.pending:
            self.collect()
        self.pending = True
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(COLLECT_AFTER_S, self._due)

    def _due(self) -> None:
        self._timer = None
        if self.pending:
            self.collect()

    def collect(self) -> None:
        self.pending = False
        gc.collect()
        self.collections += 1

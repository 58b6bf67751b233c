"""glibc malloc policy for the worker: keep step-sized buffers in mapped memory.

A step allocates and frees activation buffers of a few MiB to tens of MiB.
glibc serves blocks above its mmap threshold with a fresh ``mmap`` (and
``munmap`` on free), and returns the heap's free top to the kernel once it
exceeds the trim threshold; both make every step page-fault its buffers in
again. Its dynamic threshold adapts only after the first large frees, so the
first requests after start ran 2.5-4x slower in float32 (docs/warmup.md, "Warm-up
and the memory allocator"). ``tune_malloc`` fixes the policy once, at worker start:

- ``M_MMAP_THRESHOLD`` at glibc's largest accepted value (32 MiB on 64-bit;
  larger values are refused): blocks up to it come from the heap;
- ``M_TRIM_THRESHOLD`` and ``M_TOP_PAD`` large: the heap keeps what it grew to
  and grows in big steps, so steady-state steps reuse already-mapped pages.

The cost is resident memory: the heap keeps its high-water mark (about one
step's activations) instead of returning it between steps. ``malloc_tuning=False``
(``--no-malloc-tuning``) leaves glibc's defaults, e.g. when the Engine lives in a
process whose allocator its owner tunes. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("radixserve.worker")

# mallopt parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

#: The largest mmap threshold glibc accepts on 64-bit (HEAP_MAX_SIZE / 2).
MMAP_THRESHOLD = 32 << 20
#: mallopt takes an int: 2 GiB - 1, i.e. never trim in practice.
TRIM_THRESHOLD = (1 << 31) - 1
TOP_PAD = 256 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018  (musl and others have no mallopt)
    except (OSError, AttributeError):
        return None
    return libc


def tune_malloc() -> dict[str, bool]:
    """Apply the policy above; which settings glibc accepted (empty: not glibc)."""
    libc = _libc()
    if libc is None:
        return {}
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    wanted = {
        "mmap_threshold": (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
        "trim_threshold": (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        "top_pad": (M_TOP_PAD, TOP_PAD),
    }
    applied = {name: libc.mallopt(param, value) == 1 for name, (param, value) in wanted.items()}
    log.debug("malloc policy: %s", applied)
    return applied

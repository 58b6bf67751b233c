"""Bound oneDNN's caches of compiled products: a few hundred entries, not 1024 each.

torch runs bfloat16 products of more than a few rows (prefill chunks; on AMX CPUs
also decode batches) through oneDNN. Each product shape, rows included, gets a
primitive compiled for it, kept in two least-recently-used caches: oneDNN's own
(``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's, torch's wrapper around it
(``LRU_CACHE_CAPACITY``), 1024 entries each by default. An entry holds about 270 KiB
of heap whatever the shape (measured on torch 2.13's oneDNN: 64x64 and 1536x576
weights alike). A prefill's row count is its chunk's length, which almost never
repeats, so under varied prompts both caches fill with products that are never run
again: the worker's heap grew ~550 MiB before they were full (docs/warmup.md,
"Warm-up and the memory allocator").

``bound_primitive_caches`` sets both capacities to ``CAPACITY`` unless the
environment already names them. oneDNN and ideep read them once, when the process
compiles its first product, so it takes effect only before that (the worker calls it
first thing; an Engine built in a process that ran bfloat16 products before keeps
whatever that process had). ``CAPACITY`` keeps the shapes that do repeat (a
decode batch's rows times the model's few weight shapes) and bounds the rest to
about 2 x 256 x 270 KiB = 135 MiB.
"""

from __future__ import annotations

import os

#: oneDNN's and ideep's environment variables for their caches' capacities.
ENV_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
#: Entries each cache keeps.
CAPACITY = 256


def bound_primitive_caches(capacity: int = CAPACITY) -> dict[str, str]:
    """Set each of ``ENV_VARS`` the environment leaves unset to ``capacity``; the
    values in force (a value set before wins)."""
    if capacity < 0:
        raise ValueError(f"a cache capacity is at least 0, not {capacity}")
    return {name: os.environ.setdefault(name, str(capacity)) for name in ENV_VARS}

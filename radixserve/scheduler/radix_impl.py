"""Choosing the radix tree implementation."""

from __future__ import annotations

from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCache


def available_impls() -> list[str]:
    return ["python"]


def make_radix_cache(allocator: PageAllocator, page_size: int, impl: str = "auto") -> RadixCache:
    if impl not in ("auto", "python"):
        raise ValueError(f"unknown radix tree implementation {impl!r}; available: python")
    return RadixCache(allocator, page_size)

"""Attention backends, chosen by name at start (``WorkerConfig.attention_backend``)."""

from __future__ import annotations

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch
from radixserve.worker.attention.torch_backend import TorchAttention
from radixserve.worker.kv_pool import KVPool

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def create_backend(
    name: str, pool: KVPool, scale: float, sliding_windows: tuple[int, ...]
) -> AttentionBackend:
    """Instantiate the backend called ``name``; ValueError listing the known ones otherwise."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}") from None
    return cls(pool, scale, sliding_windows)


__all__ = ["AttentionBackend", "AttentionBatch", "KVPool", "TorchAttention", "create_backend"]

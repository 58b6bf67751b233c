"""Attention backends, chosen by name at start (``WorkerConfig.attention_backend``).

``"auto"`` picks ``flashinfer`` when it can run the model here (a CUDA pool,
float16/bfloat16, head_dim a multiple of 64, flashinfer importable) and
``torch`` otherwise. Naming a backend forces it; ``flashinfer`` then fails with
a ValueError that says why when it cannot run. The flashinfer module (and so
the flashinfer package) is imported only when CUDA is in play.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch
from radixserve.worker.attention.torch_backend import DECODE_KERNELS, TorchAttention
from radixserve.worker.kv_pool import KVPool


def _flashinfer(
    pool: KVPool, scale: float, windows: tuple[int, ...], num_qo_heads: int, softcap: float = 0.0
) -> AttentionBackend:
    from radixserve.worker.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(pool, scale, windows, num_qo_heads, softcap)


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": TorchAttention,
    "flashinfer": _flashinfer,
}
CHOICES = ("auto", *BACKENDS)


def resolve_backend_name(name: str, pool: KVPool) -> str:
    """The backend ``name`` means for this pool: ``auto`` resolved, others unchanged."""
    if name != "auto":
        return name
    # unsupported_reason checks the device before importing flashinfer, so a CPU
    # pool never imports it.
    from radixserve.worker.attention.flashinfer_backend import unsupported_reason

    device = pool.layers[0].device if pool.layers else torch.device("cpu")
    return (
        "flashinfer" if unsupported_reason(device, pool.dtype, pool.head_dim) is None else "torch"
    )


def create_backend(
    name: str,
    pool: KVPool,
    scale: float,
    sliding_windows: tuple[int, ...],
    num_qo_heads: int,
    decode_kernel: str = "auto",
    softcap: float = 0.0,
) -> AttentionBackend:
    """Instantiate backend ``name`` (or ``auto``); ValueError listing the known ones otherwise.

    ``scale`` multiplies q.k; ``softcap`` > 0 caps the scores (base.py's contract).
    ``decode_kernel`` (``auto``/``native``/``torch``) is the torch backend's decode
    path (``TorchAttention``); other backends ignore it.
    """
    if name not in CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; known: {list(CHOICES)}")
    resolved = resolve_backend_name(name, pool)
    if resolved == "torch":
        return TorchAttention(pool, scale, sliding_windows, num_qo_heads, decode_kernel, softcap)
    return BACKENDS[resolved](pool, scale, sliding_windows, num_qo_heads, softcap)


__all__ = [
    "CHOICES",
    "DECODE_KERNELS",
    "AttentionBackend",
    "AttentionBatch",
    "KVPool",
    "TorchAttention",
    "create_backend",
    "resolve_backend_name",
]

"""Attention backends, chosen by name at start (``WorkerConfig.attention_backend``).

Selection can only choose what runs:
1. the static rules (``flashinfer_support.static_reason``: a CUDA pool, float16 or
   bfloat16, head_dim 64/128/256, the append kernel's thread limit, the GPU's compute
   capability) and an importable flashinfer;
2. the probe (``flashinfer_probe.probe``): a tiny batch of every attention mode the
   model needs (each sliding window; prefill, decode, chunked prefill), planned,
   appended and run, and checked against the torch backend. It also loads (or
   JIT-builds) every kernel variant: the warm-up.

``"auto"`` picks ``flashinfer`` when both pass and ``torch`` otherwise, logging why.
Naming a backend forces it; ``flashinfer`` then fails at start with a ValueError
that gives the reason. The flashinfer modules (and so the flashinfer package) are
imported only when CUDA is in play.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch
from radixserve.worker.attention.torch_backend import DECODE_KERNELS, TorchAttention
from radixserve.worker.kv_pool import KVPool

log = logging.getLogger("radixserve.worker")


def _flashinfer(
    pool: KVPool,
    scale: float,
    windows: tuple[int, ...],
    num_qo_heads: int,
    softcap: float = 0.0,
    **options: Any,
) -> AttentionBackend:
    from radixserve.worker.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(pool, scale, windows, num_qo_heads, softcap, **options)


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": TorchAttention,
    "flashinfer": _flashinfer,
}
CHOICES = ("auto", *BACKENDS)


def _device(pool: KVPool) -> torch.device:
    return pool.layers[0].device if pool.layers else torch.device("cpu")


def flashinfer_reason(pool: KVPool) -> str | None:
    """The static reason flashinfer cannot run on ``pool`` (None: try it). A CPU pool
    never imports flashinfer (the device is checked first)."""
    from radixserve.worker.attention.flashinfer_support import kv_pool_reason, unsupported_reason

    reason = kv_pool_reason(pool)
    if reason is not None:
        return reason
    return unsupported_reason(_device(pool), pool.dtype, pool.head_dim, pool.num_kv_heads)


def kv_layout_for(
    backend: str,
    kv_dtype: str,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    num_kv_heads: int,
) -> str:
    """The pool layout for ``--kv-cache-dtype`` under ``--attention-backend``:
    ``token_head`` (fp8 codes and a float32 scale per token and kv head, the rows
    FlashInfer 0.7.4 reads with ``use_token_head_sf``) for an fp8 format on CUDA when
    the backend is ``flashinfer``, or ``auto`` and flashinfer can run there; ``row``
    (codes + a float16 scale per token and head) otherwise. The CPU never changes. The
    per-tensor layout (``tensor``: plain fp8 codes, scale 1.0) is no one's default: on
    SmolLM2 its e4m3 KL is 1.36x that of per-(token, head) scales, for 1.25x the tokens
    per GiB (docs/kv-cache.md, "Quantized KV cache")."""
    from radixserve.worker.attention.flashinfer_support import unsupported_reason
    from radixserve.worker.kv_quant import TOKEN_HEAD_QUANTS

    device = torch.device(device)
    if kv_dtype not in TOKEN_HEAD_QUANTS or device.type != "cuda":
        return "row"
    if backend == "flashinfer":
        return "token_head"
    if backend == "auto" and unsupported_reason(device, dtype, head_dim, num_kv_heads) is None:
        return "token_head"
    return "row"


def resolve_backend_name(name: str, pool: KVPool) -> str:
    """The backend ``name`` means for this pool by the static rules alone (no probe)."""
    if name != "auto":
        return name
    return "flashinfer" if flashinfer_reason(pool) is None else "torch"


def create_backend(
    name: str,
    pool: KVPool,
    scale: float,
    sliding_windows: tuple[int, ...],
    num_qo_heads: int,
    decode_kernel: str = "auto",
    softcap: float = 0.0,
    flashinfer_options: dict[str, Any] | None = None,
    deterministic: bool = False,
) -> AttentionBackend:
    """Instantiate backend ``name`` (or ``auto``); ValueError listing the known ones otherwise.

    ``scale`` multiplies q.k; ``softcap`` > 0 caps the scores (base.py's contract).
    ``decode_kernel`` (``auto``/``native``/``torch``) is the torch backend's decode
    path (``TorchAttention``); ``flashinfer_options`` go to ``FlashInferAttention``.
    The returned backend's ``choice_reason`` says why it was chosen.
    """
    if name not in CHOICES:
        raise ValueError(f"unknown attention backend {name!r}; known: {list(CHOICES)}")
    if deterministic:
        # Batch-invariant attention is the native CPU kernel's (TorchAttention's
        # ``deterministic``); FlashInfer's split-KV plans depend on the batch.
        if name == "flashinfer":
            raise ValueError(
                "deterministic mode runs on the torch backend's native CPU kernel; "
                "the flashinfer backend is not batch-invariant (drop --deterministic "
                "or use --attention-backend torch on the CPU)"
            )
        backend = TorchAttention(
            pool, scale, sliding_windows, num_qo_heads, decode_kernel, softcap, deterministic=True
        )
        backend.choice_reason = "deterministic: the native kernel, keys cut at fixed positions"
        return backend
    if name == "torch":
        return _torch(
            pool, scale, sliding_windows, num_qo_heads, decode_kernel, softcap, "asked for"
        )
    reason = flashinfer_reason(pool)
    backend = None
    if reason is None:
        try:
            backend = _checked_flashinfer(
                pool, scale, sliding_windows, num_qo_heads, softcap, flashinfer_options or {}
            )
        except Exception as e:  # ProbeError, or a wrapper that would not build
            reason = str(e)
    if backend is not None:
        backend.choice_reason = "asked for" if name == "flashinfer" else "auto: probe passed"
        return backend
    if name == "flashinfer":
        raise ValueError(
            f"attention backend 'flashinfer' cannot run: {reason}; "
            "use attention_backend 'torch' (--attention-backend torch)"
        )
    why = f"auto: flashinfer cannot run: {reason}"
    if _device(pool).type == "cuda":
        log.warning("attention backend torch (%s)", why)
    return _torch(pool, scale, sliding_windows, num_qo_heads, decode_kernel, softcap, why)


def _torch(pool, scale, windows, heads, decode_kernel, softcap, why) -> AttentionBackend:
    backend = TorchAttention(pool, scale, windows, heads, decode_kernel, softcap)
    backend.choice_reason = why
    return backend


def _checked_flashinfer(pool, scale, windows, heads, softcap, options) -> AttentionBackend:
    """The flashinfer backend, after the probe passed on a pool of the same shape."""
    from radixserve.worker.attention.flashinfer_probe import probe

    def make(tiny: KVPool, tiny_windows: tuple[int, ...]) -> AttentionBackend:
        return _flashinfer(tiny, scale, tiny_windows, heads, softcap, **options)

    probe(make, pool, scale, windows, heads, softcap)
    return _flashinfer(pool, scale, windows, heads, softcap, **options)


__all__ = [
    "CHOICES",
    "DECODE_KERNELS",
    "AttentionBackend",
    "AttentionBatch",
    "KVPool",
    "TorchAttention",
    "create_backend",
    "flashinfer_reason",
    "resolve_backend_name",
]

"""Python side of the native paged decode kernel (``csrc/paged_attention.cpp``).

The torch backend's decode path gathers every page a request reads into a
contiguous buffer, then runs ``scaled_dot_product_attention`` over it. The
native kernel reads K and V rows where they lie in the pool, once for all the
query heads of a GQA group, with a two-pass softmax per chunk of keys and OpenMP threads from torch's own runtime. docs/cpu-kernels.md ("Paged
decode attention") describes it; bench/results/decode_kernel.md has the numbers.

Work is given as *segments*: a KV sequence (a page list and a key range in it)
and the query rows that attend to it. A plain decode request is a one-row
segment; a cached prefix shared by several decoding requests (cascade decode)
is one segment with all of their rows, so its pages are read once, and each of
those rows is also in its request's own segment: the kernel merges a row's parts
itself. A prefill chunk is a *causal* segment (its rows see the keys up to their
own position). The kernel can also return the log-sum-exp of each row's scores.

A quantized pool (``kv_quant.py``: int8 or fp8 codes and a float16 scale per token
and head) is read as it lies: the kernel turns each block of K or V rows into the
compute type (code times scale) in a small buffer that stays in L1, at every
instruction-set level, as it does with bfloat16 rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from radixserve.layers import cpu_kernels
from radixserve.layers.cpu_kernels import AVAILABLE, UNAVAILABLE_REASON
from radixserve.layers.cpu_kernels import ext as _ext
from radixserve.worker.kv_quant import Quant

#: Storage dtypes the kernel runs (bfloat16 is computed in float32).
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
#: Items (segment x kv head x key chunk) per thread the chunking aims for.
ITEMS_PER_THREAD = 8
MIN_CHUNK, MAX_CHUNK = 64, 1024
#: The keys of every item in batch-invariant mode: a row's keys are cut at multiples of
#: it from the first, wherever its chunks, cache hits and batch put them.
FIXED_CHUNK = 256
#: Whether the built extension reads quantized pools.
QUANT_AVAILABLE = AVAILABLE and bool(getattr(_ext, "KV_QUANT", False))


def unsupported_reason(device: torch.device, dtype: torch.dtype, pool=None) -> str | None:
    """Why the native kernel cannot serve this pool (of model dtype ``dtype``; ``pool``
    a ``KVPool`` that may store another dtype), or None when it can."""
    if not AVAILABLE:
        return (
            f"the native extension radixserve.layers._cpu_kernels is missing ({UNAVAILABLE_REASON})"
        )
    if device.type != "cpu":
        return f"it runs on the CPU, the KV pool is on {device}"
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of float32, float64, bfloat16"
    if pool is not None and pool.quant is None and pool.storage_dtype != dtype:
        return f"the pool stores {pool.storage_dtype}, the model computes in {dtype}"
    if pool is not None and pool.quant is not None and pool.quant.per_tensor:
        return "the native kernels read the per-row KV layout, not the per-tensor fp8 one"
    if pool is not None and pool.quant is not None and pool.kv_layout == "token_head":
        return (
            "the native kernels read the per-row KV layout (float16 scales), not the "
            "token_head one (FlashInfer's float32 scales)"
        )
    if pool is not None and pool.quant is not None and not QUANT_AVAILABLE:
        return "the native extension predates quantized KV: rebuild it"
    return None


def _array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor (bfloat16 as int16: NumPy has no bfloat16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


@dataclass
class Segments:
    """One kernel call's work. Rows index q (and out/lse); ``kv_begin`` has one
    array per sliding window (window <= 0: all keys)."""

    row_indptr: np.ndarray
    rows: np.ndarray
    page_indptr: np.ndarray
    pages: np.ndarray
    kv_end: np.ndarray
    kv_begin: dict[int, np.ndarray]
    chunk: int
    #: uint8 per segment, or None: 1 marks a prefill chunk's rows (causal, bottom-right
    #: aligned: row r of n sees keys up to kv_end - (n - 1 - r)).
    causal: np.ndarray | None = None
    #: > 0: batch-invariant items of exactly this many keys (``--deterministic``;
    #: ``FIXED_CHUNK``), whatever ``chunk`` says.
    fixed: int = 0

    @classmethod
    def build(
        cls,
        row_groups: list[np.ndarray],
        tables: list[np.ndarray],
        kv_lens: np.ndarray,
        windows: list[int],
        num_kv_heads: int,
        causal: list[bool] | None = None,
    ) -> Segments:
        """Segment i: rows ``row_groups[i]`` attend to keys [0, kv_lens[i]) of pages
        ``tables[i]`` (the last kv_lens[i] - window of them with a window); with
        ``causal[i]``, row r of n sees only keys [0, kv_lens[i] - (n - 1 - r)): the
        rows of a prefill chunk that ends at kv_lens[i] (no window allowed then)."""
        i32 = np.int32
        row_indptr = np.zeros(len(row_groups) + 1, i32)
        row_indptr[1:] = np.cumsum([len(r) for r in row_groups])
        page_indptr = np.zeros(len(tables) + 1, i32)
        page_indptr[1:] = np.cumsum([len(t) for t in tables])
        kv_end = np.asarray(kv_lens, dtype=i32)
        kv_begin = {
            w: (np.maximum(kv_end - w, 0) if w > 0 else np.zeros_like(kv_end)).astype(i32)
            for w in windows
        }
        flags = None
        if causal is not None and any(causal):
            if any(w > 0 for w in windows):
                raise ValueError("causal segments take no sliding window")
            flags = np.asarray(causal, dtype=np.uint8)
        threads = torch.get_num_threads()
        work = int(kv_end.astype(np.int64).sum()) * num_kv_heads
        chunk = -(-work // (ITEMS_PER_THREAD * threads)) if work else MIN_CHUNK
        return cls(
            row_indptr,
            np.concatenate(row_groups).astype(i32) if row_groups else np.zeros(0, i32),
            page_indptr,
            np.concatenate(tables).astype(i32) if tables else np.zeros(0, i32),
            kv_end,
            kv_begin,
            int(min(max(chunk, MIN_CHUNK), MAX_CHUNK)),
            flags,
        )


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    seg: Segments,
    window: int,
    scale: float,
    isa: str | None = None,
    softcap: float = 0.0,
    quant: Quant | None = None,
) -> None:
    """out[r] (and lse[r], per head) for every row r of ``seg``; other rows untouched.

    q, out: contiguous [T, heads, head_dim]; kv: a layer of the pool,
    [pages, 2, page_size, kv_heads, head_dim] of q's dtype, or with ``quant`` uint8
    [..., head_dim + 2] (codes and float16 scale, ``kv_quant.py``); lse:
    float32/float64 [T, heads].
    Scores are ``scale * q.k``, capped at ``softcap * tanh(score / softcap)`` when
    ``softcap`` > 0 (the lse is of the capped scores).
    ``isa``: the instruction-set level (default ``cpu_kernels.ISA``).
    """
    _ext.paged_decode(  # type: ignore[union-attr]
        _array(q), _array(kv), _array(out), None if lse is None else lse.numpy(),
        seg.row_indptr, seg.rows, seg.page_indptr, seg.pages, seg.kv_begin[window], seg.kv_end,
        scale, torch.get_num_threads(), seg.chunk, isa or cpu_kernels.ISA, softcap=softcap,
        causal=seg.causal, fixed=seg.fixed,
        kv_quant=quant.name if quant is not None else "none", amx=cpu_kernels.AMX,
    )  # fmt: skip

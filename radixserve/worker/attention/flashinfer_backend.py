"""The ``flashinfer`` attention backend: FlashInfer's paged fa2 kernels on CUDA.

Written against flashinfer-python 0.7.4 (``BatchPrefillWithPagedKVCacheWrapper``,
``BatchDecodeWithPagedKVCacheWrapper``, ``append_paged_kv_cache``). FlashInfer is
imported only when this backend is built, so nothing on the CPU path needs it.

Per step (``begin_batch``) the wrappers are planned once from int32 CPU index
tensors; per layer (``forward``) the new K/V are appended into the pool with
``append_paged_kv_cache`` and the planned wrapper runs over that layer's pages.

- A step where every request has one new token runs the decode wrapper (its
  CUDA-core kernel for GQA groups of 1-3, else its tensor-core path). Any
  other step (fresh prefill, prefill after a cached prefix, a chunk, or a mix
  with decode rows) runs the prefill wrapper over all rows: its causal mask is
  aligned bottom-right, so a one-token row is a correct decode row, and one
  kernel over the whole batch beats splitting rows into two launches plus a
  gather and a scatter of q and the output in every layer.
- The pool layer ``[num_pages, 2, page_size, kv_heads, head_dim]`` is
  FlashInfer's single-tensor ``NHD`` paged layout; its K and V halves have
  equal strides, which fa2 requires.
- Sliding windows: one planned wrapper per distinct window among the layers
  (``window_left`` is fixed at plan time). Our window w (keys in (p - w, p])
  is FlashInfer's ``window_left = w - 1`` (keys in [p - window_left, p]).
- Scale and soft-cap: ``sm_scale`` (the model's, e.g. Gemma's
  ``query_pre_attn_scalar ** -0.5``) and ``logits_soft_cap`` (Gemma 2's
  ``attn_logit_softcapping``; 0 = none) are plan-time arguments of both wrappers,
  the same for every layer.
- All wrappers share one float workspace, allocated once: runs are sequential
  on one stream, and each wrapper keeps its plan in its own int workspace.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np
import torch

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch
from radixserve.worker.kv_pool import KVPool

#: Bytes of the float workspace shared by all wrappers (FlashInfer recommends 128 MB).
WORKSPACE_BYTES = 128 << 20
#: Device types the kernels run on. Tests that stand a CPU double in for the
#: library widen this; nothing else should.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
HALF_DTYPES = (torch.float16, torch.bfloat16)
#: GQA group sizes (query heads per KV head) FlashInfer's CUDA-core decode kernel is built
#: for. Larger groups also run faster on the tensor-core path (the fa2 prefill kernel, one
#: query row per request), so only these few small groups use the CUDA-core kernel.
CUDA_CORE_GROUPS = (1, 2, 3)
KV_LAYOUT = "NHD"


def unsupported_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashInfer cannot run this model here, or None if it can (imports flashinfer)."""
    if device.type not in DEVICE_TYPES:
        return f"it needs a CUDA device (got {device.type!r})"
    if dtype not in HALF_DTYPES:
        return f"it runs float16/bfloat16 only (got {str(dtype).removeprefix('torch.')})"
    if head_dim % 64 != 0:
        # fa2 prefill kernels fail or silently give wrong results for other sizes.
        return f"its fa2 kernels need head_dim a multiple of 64 (got {head_dim})"
    try:
        import_flashinfer()
    except ImportError as e:
        return str(e)
    return None


def import_flashinfer() -> ModuleType:
    """``flashinfer``, or ImportError saying how to install it."""
    try:
        return importlib.import_module("flashinfer")
    except Exception as e:  # a broken install (CUDA libs, ABI) must not crash "auto" either
        raise ImportError(
            f"flashinfer is not importable ({type(e).__name__}: {e}); "
            "install it with `pip install radixserve[gpu]`"
        ) from e


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self,
        pool: KVPool,
        scale: float,
        sliding_windows: tuple[int, ...],
        num_qo_heads: int,
        softcap: float = 0.0,
    ) -> None:
        super().__init__(pool, scale, sliding_windows, num_qo_heads, softcap)
        device = pool.layers[0].device if pool.layers else torch.device("cpu")
        reason = unsupported_reason(device, pool.dtype, pool.head_dim)
        if reason is not None:
            raise ValueError(
                f"attention backend 'flashinfer' cannot run: {reason}; "
                "use attention_backend 'torch' (--attention-backend torch)"
            )
        fi = import_flashinfer()
        self._fi = fi
        self._device = device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._windows = sorted(set(sliding_windows))
        # backend="fa2" everywhere: on sm90 "auto" picks fa3, whose JIT build takes many minutes.
        self._prefill = {
            w: fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, kv_layout=KV_LAYOUT, backend="fa2"
            )
            for w in self._windows
        }
        group = num_qo_heads // pool.num_kv_heads
        self._decode = {
            w: fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                kv_layout=KV_LAYOUT,
                use_tensor_cores=group not in CUDA_CORE_GROUPS,
                backend="fa2",
            )
            for w in self._windows
        }
        self._active: dict[int, Any] | None = None  # window -> planned wrapper

    def begin_batch(self, batch: AttentionBatch) -> None:
        s = self.pool.page_size
        qo_lens = batch.qo_lens.astype(np.int64)
        kv_lens = batch.kv_lens.astype(np.int64)
        page_counts = np.diff(batch.page_indptr).astype(np.int64)
        if np.any(page_counts != -(-kv_lens // s)):
            raise ValueError("each request needs exactly ceil(kv_len / page_size) pages")
        if np.any(qo_lens < 1) or np.any(qo_lens > kv_lens):
            raise ValueError("each request needs 1 <= qo_len <= kv_len")
        last_page_len = kv_lens - (page_counts - 1) * s  # in [1, page_size]
        # plan() wants int32 index tensors on the CPU (it copies them to the device itself).
        cpu = {
            "qo_indptr": batch.qo_indptr,
            "indptr": batch.page_indptr,
            "indices": batch.page_indices,
            "last": last_page_len,
        }
        cpu = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int32)) for k, v in cpu.items()}
        heads = (self.num_qo_heads, self.pool.num_kv_heads)
        decode = bool(np.all(qo_lens == 1))
        dtypes = {"q_data_type": self.pool.dtype, "kv_data_type": self.pool.dtype}
        for w in self._windows:
            common = {
                "sm_scale": self.scale,
                "logits_soft_cap": self.softcap,
                "window_left": w - 1 if w > 0 else -1,
                **dtypes,
            }
            if decode:
                self._decode[w].plan(
                    cpu["indptr"], cpu["indices"], cpu["last"], *heads, self.pool.head_dim, s,
                    pos_encoding_mode="NONE", **common,
                )  # fmt: skip
            else:
                self._prefill[w].plan(
                    cpu["qo_indptr"], cpu["indptr"], cpu["indices"], cpu["last"], *heads,
                    self.pool.head_dim, s, causal=True, **common,
                )  # fmt: skip
        self._active = dict(self._decode if decode else self._prefill)
        self._plan_append(batch, qo_lens, kv_lens, last_page_len)

    def _plan_append(
        self, batch: AttentionBatch, qo_lens: np.ndarray, kv_lens: np.ndarray, last: np.ndarray
    ) -> None:
        """Device int32 inputs of append_paged_kv_cache, sent in one host-to-device copy."""
        n, b = batch.num_tokens, batch.batch_size
        starts = np.repeat(batch.qo_indptr[:-1].astype(np.int64), qo_lens)
        batch_indices = np.repeat(np.arange(b), qo_lens)
        # Position of each new token in its request: kv_len - qo_len, ..., kv_len - 1.
        positions = np.arange(n) - starts + np.repeat(kv_lens - qo_lens, qo_lens)
        parts = [batch_indices, positions, batch.page_indices, batch.page_indptr, last]
        packed = torch.from_numpy(np.concatenate(parts).astype(np.int32)).to(self._device)
        sizes = [len(p) for p in parts]
        (self._batch_indices, self._positions, self._kv_indices, self._kv_indptr,
         self._last_page_len) = packed.split(sizes)  # fmt: skip

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._active is None:
            raise RuntimeError("begin_batch must be called before forward")
        cache = self.pool.layers[layer]
        self._fi.append_paged_kv_cache(
            k, v, self._batch_indices, self._positions, cache, self._kv_indices,
            self._kv_indptr, self._last_page_len, kv_layout=KV_LAYOUT,
        )  # fmt: skip
        return self._active[self.sliding_windows[layer]].run(q, cache)

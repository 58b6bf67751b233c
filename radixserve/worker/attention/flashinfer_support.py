"""Whether FlashInfer can run a model here: the static rules, checked before any kernel.

These are the limits of flashinfer-python 0.7.4's kernels that fail at a kernel's
first use (or silently give wrong results) rather than when a wrapper is built, so
they are checked up front; ``flashinfer_probe.py`` then runs every attention mode the
model needs once and is the final word.

- Device: CUDA only (``DEVICE_TYPES``; tests widen it for the CPU double).
- dtype: float16 or bfloat16.
- head_dim: exactly 64, 128 or 256. ``append_paged_kv_cache`` dispatches on head_dim
  64/128/256/512 only ("Unsupported head_dim" otherwise, page.cuh), and 512 is outside
  the fa2 prefill/decode set FlashInfer builds ahead of time (64, 128, 256), so a
  multiple of 64 such as 192 or 320 is refused.
- The append kernel's block: ``head_dim / max(16 / itemsize, head_dim / 32)`` threads
  per KV head times ``num_kv_heads``, which must stay within CUDA's 1024 threads per block.
- Compute capability: bfloat16 needs sm80+ (Ampere), float16 sm75+ (Turing).
- Kernels: FlashInfer JIT-builds each kernel variant at first use with nvcc unless a
  prebuilt one is installed (``pip install flashinfer-jit-cache``, matching the
  flashinfer and CUDA versions). ``kernel_build_hint`` says when neither is there; it
  is a hint, not a refusal, because an already-filled JIT cache needs neither: the probe
  decides.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
from types import ModuleType

import torch

#: Device types the kernels run on. Tests that stand a CPU double in for the
#: library widen this; nothing else should.
DEVICE_TYPES: tuple[str, ...] = ("cuda",)
HALF_DTYPES = (torch.float16, torch.bfloat16)
#: head_dims with both an append kernel and fa2 prefill/decode kernels.
SUPPORTED_HEAD_DIMS = (64, 128, 256)
#: CUDA's limit on threads per block (the append kernel's block is head_dim x kv heads).
MAX_THREADS_PER_BLOCK = 1024
#: Oldest compute capability each dtype's fa2 kernels are built for.
MIN_CAPABILITY = {torch.float16: (7, 5), torch.bfloat16: (8, 0)}


def append_threads(head_dim: int, num_kv_heads: int, itemsize: int = 2) -> int:
    """Threads per block of ``append_paged_kv_cache`` (page.cuh's launch)."""
    vec_size = max(16 // itemsize, head_dim // 32)
    return head_dim // vec_size * num_kv_heads


def device_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device`` (the CPU double replaces this)."""
    return torch.cuda.get_device_capability(device)


def kv_pool_reason(pool) -> str | None:
    """Why the flashinfer backend cannot read this KV pool's storage (None: it can):
    int8 (FlashInfer has no int8 KV), fp8 rows in the ``row`` layout (a float16 scale
    inside each 66-byte row), or a pool cast to another float dtype. FlashInfer 0.7.4
    reads fp8 KV with per-tensor scales (``run(k_scale=, v_scale=)``: the ``tensor``
    layout) or with per-(token, head) float32 scale factors in tensors of their own
    (``plan(use_token_head_sf=True)``, fa2 kernels only: the ``token_head`` layout)."""
    q = pool.quant
    if q is not None and not q.is_fp8:
        return (
            f"the KV pool stores {pool.kv_dtype_name}; FlashInfer has no int8 KV cache "
            "(int8 runs on the torch backend)"
        )
    if q is not None and pool.kv_layout == "row":
        return (
            f"the KV pool stores {pool.kv_dtype_name} rows with a float16 scale per token "
            "and head inside each row; FlashInfer's fp8 KV reads per-tensor scales (kv_layout "
            "'tensor') or float32 per-(token, head) scale factors in tensors of their own "
            "(kv_layout 'token_head', its fa2 kernels)"
        )
    if q is None and pool.storage_dtype != pool.dtype:
        return (
            f"the KV pool stores {pool.kv_dtype_name} for a {pool.dtype} model; the flashinfer "
            "backend takes a pool of the model's dtype or of an fp8 format"
        )
    return None


def static_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, num_kv_heads: int
) -> str | None:
    """Why FlashInfer cannot run this model here, or None; does not import flashinfer."""
    if device.type not in DEVICE_TYPES:
        return f"it needs a CUDA device (got {device.type!r})"
    if dtype not in HALF_DTYPES:
        return f"it runs float16/bfloat16 only (got {str(dtype).removeprefix('torch.')})"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        dims = "/".join(map(str, SUPPORTED_HEAD_DIMS))
        return f"its kernels exist for head_dim {dims} only (got {head_dim})"
    threads = append_threads(head_dim, num_kv_heads, torch.empty((), dtype=dtype).element_size())
    if threads > MAX_THREADS_PER_BLOCK:
        return (
            f"its KV append kernel would need {threads} threads per block for "
            f"{num_kv_heads} KV heads of head_dim {head_dim} (limit {MAX_THREADS_PER_BLOCK})"
        )
    major, minor = device_capability(device)
    need = MIN_CAPABILITY[dtype]
    if (major, minor) < need:
        name = str(dtype).removeprefix("torch.")
        return (
            f"its {name} kernels need compute capability {need[0]}.{need[1]}+ "
            f"(this GPU is {major}.{minor})"
        )
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


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, num_kv_heads: int = 1
) -> str | None:
    """``static_reason``, then whether flashinfer imports (only where the rules pass)."""
    reason = static_reason(device, dtype, head_dim, num_kv_heads)
    if reason is not None:
        return reason
    try:
        import_flashinfer()
    except ImportError as e:
        return str(e)
    return None


def find_nvcc() -> str | None:
    """The nvcc FlashInfer's JIT would use ($FLASHINFER_NVCC, $CUDA_HOME/bin, PATH)."""
    candidates = [os.environ.get("FLASHINFER_NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("nvcc")


def has_jit_cache() -> bool:
    """Whether the prebuilt kernels (``flashinfer-jit-cache``) are installed."""
    return importlib.util.find_spec("flashinfer_jit_cache") is not None


def kernel_build_hint() -> str | None:
    """What to do when kernels can be neither loaded prebuilt nor built, else None."""
    if has_jit_cache() or find_nvcc() is not None:
        return None
    return (
        "no prebuilt kernels (pip install flashinfer-jit-cache) and no nvcc to JIT-build "
        "them (set CUDA_HOME or FLASHINFER_NVCC)"
    )

"""Which dtype the model runs in: ``--dtype auto`` (the default) picks the fast one.

On a CPU, bfloat16 matmuls are fast only where the CPU has bf16 dot-product
instructions (AVX512_BF16, or AMX tiles): oneDNN then runs them ~1.5x faster
than float32, while on AVX2-only CPUs float32 is the faster dtype (docs/worker.md,
"dtype"). On CUDA, the dtype the checkpoint was trained in
(``torch_dtype`` in its config) when it is a half type, else bfloat16 where the
device supports it and float16 where it does not.

``choose_dtype`` returns the choice with the reason, which the worker reports and
``radixserve launch`` prints.
"""

from __future__ import annotations

from typing import Any

import torch


def cpu_has_fast_bf16() -> tuple[bool, str]:
    """Whether this CPU runs bfloat16 matmuls natively, and the feature that says so."""
    # torch's own queries (private, so each is looked up, not assumed).
    for feature, query in (
        ("AMX", "_is_amx_tile_supported"),
        ("AVX512_BF16", "_is_avx512_bf16_supported"),
    ):
        if getattr(torch.cpu, query, lambda: False)():
            return True, feature
    return False, torch.backends.cpu.get_cpu_capability()


def _model_dtype(hf_config: Any) -> torch.dtype | None:
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return dt if isinstance(dt, torch.dtype) else None


def choose_dtype(requested: str, device: torch.device, hf_config: Any = None) -> tuple[str, str]:
    """``(dtype name, why)`` for a requested dtype (``auto`` or a name) on ``device``."""
    if requested != "auto":
        return requested, "as asked"
    if device.type == "cuda":
        dt = _model_dtype(hf_config)
        if dt in (torch.float16, torch.bfloat16):
            name = str(dt).removeprefix("torch.")
            return name, f"auto: the model's config says {name}"
        if torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the device supports bfloat16"
        return "float16", "auto: the device lacks bfloat16"
    if device.type == "cpu":
        fast, feature = cpu_has_fast_bf16()
        if fast:
            return "bfloat16", f"auto: the CPU has {feature}"
        return "float32", f"auto: the CPU has no bf16 instructions ({feature}); float32 is faster"
    return "float32", f"auto: float32 on {device.type}"

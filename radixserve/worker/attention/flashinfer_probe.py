"""The start-up probe and warm-up of the flashinfer backend: run what the server will run.

Static rules (``flashinfer_support.py``) cannot see everything: a kernel that fails
to JIT-build (no nvcc), a CUDA error at launch, a wrong result. So before the
backend serves, ``probe`` builds a tiny pool of the model's shape (page size, KV
heads, head_dim, dtype, one layer per distinct sliding window) and runs, with the
model's scale and soft-cap, the steps the server runs:

1. a fresh prefill of two requests (the prefill wrappers, every window),
2. a decode step (the decode wrappers, every window),
3. a prefill chunk after cached tokens mixed with a decode row,
4. a long prefill chunk (``LONG_PREFILL`` tokens) mixed with a decode row: FlashInfer's
   prefill backend ``auto`` keeps fa2 for queries of at most 64 tokens and picks fa3 on
   Hopper above that, so without this step the first long prompt would JIT-build (minutes)
   and run an unchecked kernel inside a served step,

each with ``append_paged_kv_cache``, checked against the torch backend in float32
on the same inputs. Running them loads (or JIT-compiles: minutes each without
``flashinfer-jit-cache``) every kernel variant the server uses (the CUDA-graph
decode wrappers share the decode kernels), so this doubles as the warm-up; each
step's time is logged as progress, and at the end the backend each wrapper's plans
resolved to (``flashinfer wrappers: prefill (window -1): auto -> fa2, fa3; ...``). Any
failure raises ``ProbeError`` with the
reason: ``create_backend`` then falls back to torch under ``auto`` and refuses
under ``flashinfer``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from radixserve.worker.attention import flashinfer_support as support
from radixserve.worker.attention.base import AttentionBackend, AttentionBatch
from radixserve.worker.attention.torch_backend import TorchAttention
from radixserve.worker.kv_pool import KVPool

log = logging.getLogger("radixserve.worker")

#: Largest |flashinfer - float32 torch| accepted (half-precision inputs, outputs ~1).
TOLERANCE = 3e-2
#: (mode, new tokens of request 0, of request 1): every mode the server plans.
#: A query longer than the 64 tokens up to which FlashInfer's ``auto`` keeps fa2.
LONG_PREFILL = 80
STEPS = (
    ("prefill", 5, 3),
    ("decode", 1, 1),
    ("chunked prefill + decode", 4, 1),
    ("long prefill + decode", LONG_PREFILL, 1),
)
#: Tokens request 0 holds after every step (the larger of the two).
PROBE_TOKENS = sum(step[1] for step in STEPS)


class ProbeError(RuntimeError):
    """FlashInfer failed the start-up probe; the message is the reason."""


def probe(
    make_backend: Callable[[KVPool, tuple[int, ...]], AttentionBackend],
    pool: KVPool,
    scale: float,
    sliding_windows: tuple[int, ...],
    num_qo_heads: int,
    softcap: float = 0.0,
    progress: Callable[[str], None] = log.info,
) -> None:
    """Run each step of ``STEPS`` on ``make_backend(tiny pool, windows)``; ProbeError if any
    fails or disagrees with the torch backend."""
    windows = tuple(sorted(set(sliding_windows)))
    device = pool.layers[0].device if pool.layers else torch.device("cpu")
    shape = (len(windows), 2 * _pages_per_request(pool.page_size), pool.page_size,
             pool.num_kv_heads, pool.head_dim)  # fmt: skip
    mode = "setup"
    try:
        kv = (pool.kv_dtype, pool.kv_layout)
        backend = make_backend(KVPool(*shape, pool.dtype, device, *kv), windows)
        # The reference stores what the backend stores (an fp8 pool: the same codes, since
        # the model-dtype K/V widen to float32 exactly), then computes in float32.
        ref = TorchAttention(KVPool(*shape, torch.float32, device, *kv), scale, windows,
                             num_qo_heads, "torch", softcap)  # fmt: skip
        tolerance = probe_tolerance(pool)
        gen = torch.Generator().manual_seed(0)
        lens = [0, 0]
        for i, (mode, *new) in enumerate(STEPS, 1):
            start = time.perf_counter()
            batch = _batch(lens, new, pool.page_size)
            err = _run_step(backend, ref, batch, num_qo_heads, pool, device, gen)
            if not err <= tolerance:
                raise ProbeError(f"its {mode} step gave wrong results (max error {err:.3g})")
            progress(
                f"flashinfer warm-up {i}/{len(STEPS)}: {mode} (windows {list(windows)}, "
                f"head_dim {pool.head_dim}, {str(pool.dtype).removeprefix('torch.')}) "
                f"ok in {time.perf_counter() - start:.1f} s"
            )
        resolved = getattr(backend, "wrapper_backends", None)
        if resolved is not None:
            progress(f"flashinfer wrappers: {resolved()}")
    except ProbeError:
        raise
    except Exception as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        hint = support.kernel_build_hint()
        reason = f"its {mode} step failed ({type(e).__name__}: {message})"
        raise ProbeError(reason + (f"; {hint}" if hint else "")) from e


#: The largest |V| the probe's values reach (standard normals: 6.5 sigma, never
#: met in the few hundred values one step draws).
PROBE_VMAX = 6.5


def probe_tolerance(pool: KVPool) -> float:
    """``TOLERANCE``, plus for an fp8 pool (per-tensor or token_head layout) what
    FlashInfer's fp8 kernels may round on top of the stored codes, which the reference
    shares: the probabilities multiplied into V in the cache's format (relative half
    step 2^-(mantissa bits + 1): 2^-4 e4m3, 2^-3 e5m2), an error of at most that times
    max|V| = ``PROBE_VMAX`` (a token_head row's codes times its scale are within
    max|V| too)."""
    q = pool.quant
    if q is None or not q.is_fp8:
        return TOLERANCE
    return TOLERANCE + PROBE_VMAX * torch.finfo(q.code_dtype).eps / 2


def _pages_per_request(page_size: int) -> int:
    return -(-PROBE_TOKENS // page_size)


def _batch(lens: list[int], new: list[int], page_size: int) -> AttentionBatch:
    """Request i gets ``new[i]`` tokens after its ``lens[i]``; pages laid out in order."""
    qo, kv, counts = [0], [], []
    for i, n in enumerate(new):
        lens[i] += n
        qo.append(qo[-1] + n)
        kv.append(lens[i])
        counts.append(-(-lens[i] // page_size))
    # Request 0 owns pages 0.., request 1 the pages from the middle of the pool on.
    tables = [np.arange(c) + i * _pages_per_request(page_size) for i, c in enumerate(counts)]
    return AttentionBatch(
        qo_indptr=np.asarray(qo, np.int32),
        kv_lens=np.asarray(kv, np.int32),
        page_indptr=np.cumsum([0, *counts]).astype(np.int32),
        page_indices=np.concatenate(tables).astype(np.int32),
    )


def _run_step(backend, ref, batch, num_qo_heads, pool, device, gen) -> float:
    """Largest |backend - ref| over every layer of one step (synchronises: kernel
    errors surface here, not in the first real step)."""
    backend.begin_batch(batch)
    ref.begin_batch(batch)
    t, kvh, d = batch.num_tokens, pool.num_kv_heads, pool.head_dim
    err = 0.0
    for layer in range(ref.pool.num_layers):
        q, k, v = (
            torch.randn(t, h, d, generator=gen)
            .clamp(-PROBE_VMAX, PROBE_VMAX)
            .to(device=device, dtype=pool.dtype)
            for h in (num_qo_heads, kvh, kvh)
        )
        out = backend.forward(layer, q, k, v)
        want = ref.forward(layer, q.float(), k.float(), v.float())
        err = max(err, float((out.float() - want).abs().max()))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return err

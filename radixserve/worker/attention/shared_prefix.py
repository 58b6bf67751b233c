"""A cascade group's shared prefix through oneDNN's attention (for CPUs with AMX tiles).

When decode requests share a cached prefix, the native kernel reads it once for
all of them as one segment (``native_decode.py``). That part is a small matrix
product (every member's query heads against the same keys), and where oneDNN
runs bfloat16 products on AMX tiles (``cpu_kernels.AMX``) torch's CPU flash
attention computes it several times faster than the kernel's ``vdpbf16ps``
tiles (docs/worker.md, "CPU kernels"). Then the native kernel computes only each
member's own suffix, with the log-sum-exp of its scores, and ``attend`` merges
the two parts per row and head by their log-sum-exps: the same attention over
the concatenated keys.

Contract: ``attend`` reads rows ``plan.rows`` of ``out`` and ``lse`` (the
suffix part, already written) and overwrites those rows of ``out``. No sliding
window and no soft-cap (the planner does not form cascade groups with windows,
and the backend does not use this path with a soft-cap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available() -> bool:
    """Whether this torch has the CPU flash attention that returns the log-sum-exp."""
    return _FLASH is not None


@dataclass
class SharedPrefix:
    """One cascade group: its members' rows of q (int64), the shared pages' K rows in
    the pool viewed as ``[num_pages * 2, page_size * kv_heads * head_dim]`` (V is the
    next row), and the number of shared keys. ``run_start``: with one token per page
    and the shared pages consecutive (as the allocator usually hands out a prefill's
    pages), the first K row; attention then reads the pool in place, no gather."""

    rows: torch.Tensor
    k_rows: torch.Tensor
    kv_len: int
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V gather destinations, reused per layer
    run_start: int | None = None

    @classmethod
    def build(
        cls,
        rows: np.ndarray,
        pages: np.ndarray,
        page_size: int,
        make_buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    ) -> SharedPrefix:
        """From the members' q rows and the shared page ids; ``make_buffers(n)`` gives
        gather destinations for n pages (asked only when the pages are not a run)."""
        k_rows = pages.astype(np.int64) * 2
        run = page_size == 1 and len(pages) > 0 and bool((np.diff(pages) == 1).all())
        buffers = (torch.empty(0), torch.empty(0)) if run else make_buffers(len(pages))
        return cls(torch.from_numpy(rows.astype(np.int64)), torch.from_numpy(k_rows),
                   len(pages) * page_size, buffers, int(k_rows[0]) if run else None)  # fmt: skip


def attend(
    plan: SharedPrefix,
    q: torch.Tensor,
    pages: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_heads: int,
    scale: float,
) -> None:
    """``out[rows]`` := attention of ``q[rows]`` over the shared keys and the suffix
    part already in ``out[rows]`` / ``lse[rows]`` (float32 or float64 [T, heads])."""
    t_rows, heads, d = plan.rows.shape[0], q.shape[1], q.shape[2]
    group = heads // kv_heads
    if plan.run_start is not None:  # every second row of the pool, from run_start
        end = plan.run_start + 2 * plan.kv_len
        kb, vb = pages[plan.run_start : end : 2], pages[plan.run_start + 1 : end : 2]
    else:
        kb, vb = plan.buffers
        torch.index_select(pages, 0, plan.k_rows, out=kb)
        torch.index_select(pages, 0, plan.k_rows + 1, out=vb)
    keys = kb.view(-1, kv_heads, d)[: plan.kv_len].transpose(0, 1).unsqueeze(0)
    vals = vb.view(-1, kv_heads, d)[: plan.kv_len].transpose(0, 1).unsqueeze(0)
    # Every member's query heads of one KV head are queries of one attention call.
    qs = q.index_select(0, plan.rows).view(t_rows, kv_heads, group, d).transpose(0, 1)
    qs = qs.reshape(1, kv_heads, t_rows * group, d)
    o_shared, lse_shared = _FLASH(qs, keys, vals, scale=scale)  # type: ignore[misc]
    o_shared = o_shared.reshape(kv_heads, t_rows, group, d).transpose(0, 1)
    lse_shared = lse_shared.reshape(kv_heads, t_rows, group).transpose(0, 1)
    ct = lse.dtype
    l1 = lse.index_select(0, plan.rows).view(t_rows, kv_heads, group)
    l2 = lse_shared.to(ct)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp_().unsqueeze(-1), (l2 - m).exp_().unsqueeze(-1)
    o1 = out.index_select(0, plan.rows).view(t_rows, kv_heads, group, d).to(ct)
    merged = (o1 * w1 + o_shared.to(ct) * w2) / (w1 + w2)
    out.index_copy_(0, plan.rows, merged.reshape(t_rows, heads, d).to(out.dtype))

"""Cascade groups' shared prefixes through our prefix kernel (AMX tiles or ``vdpbf16ps``).

When decode requests share a cached prefix, the native kernel reads it once for
all of them as one segment (``native_decode.py``). That part is a small matrix
product (every member's query heads against the same keys), and where the CPU
has AMX tiles (``cpu_kernels.AMX``) our tile kernel (``cpu_kernels.prefix_attention``,
``csrc/prefix_attention.cpp``; bfloat16, head_dim a multiple of 32) or else torch's
CPU flash attention computes it several times faster than the kernel's
``vdpbf16ps`` tiles (docs/cpu-kernels.md, "CPU kernels"); on AVX512_BF16 CPUs without
AMX the prefix kernel's ``vdpbf16ps`` form is a little faster than them at batches the
one-call decode step does not take. Then the native kernel computes only each
member's own suffix, with the log-sum-exp of its scores, and ``attend`` merges
the two parts per row and head by their log-sum-exps (``cpu_kernels.merge_attention``,
one native call per group): the same attention over the concatenated keys.

Everything that depends only on the step's page tables is in ``SharedPrefixes``,
built once per step for every group of the step (``build``): per layer ``attend``
gathers every group's query vectors with one ``index_select``, then runs one
flash call and one merge per group.

Contract: ``attend`` reads the member rows of ``out`` and ``lse`` (the suffix
part, already written) and overwrites those rows of both with the merged
result. No sliding window and no soft-cap (the planner does not form cascade
groups with windows, and the backend does not use this path with a soft-cap).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.layers import cpu_kernels

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available() -> bool:
    """Whether this torch has the CPU flash attention that returns the log-sum-exp,
    and the native extension the merge."""
    return _FLASH is not None and cpu_kernels.merge_ok()


@dataclass
class Group:
    """One cascade group: the shared pages' K and V rows in the pool viewed as
    ``[num_pages * 2, page_size * kv_heads * head_dim]`` (V is the row after K), the
    number of shared keys, and where its query vectors are in the step's index
    (``begin:end``). ``run_start``: with one token per page and the shared pages
    consecutive (as the allocator usually hands out a prefill's pages), the first
    K row; attention then reads the pool in place, no gather."""

    k_rows: torch.Tensor
    v_rows: torch.Tensor  # k_rows + 1
    kv_len: int
    begin: int
    end: int
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V gather destinations, reused per layer
    run_start: int | None = None


@dataclass
class SharedPrefixes:
    """A step's cascade groups. ``index`` (int64): for every group, kv head, member
    and query head of that kv head's group, the row of that query vector in q
    viewed as ``[tokens * heads, head_dim]`` (the same row of ``out``, and of
    ``lse`` viewed flat)."""

    groups: list[Group]
    index: torch.Tensor

    @classmethod
    def build(
        cls,
        groups: list[tuple[np.ndarray, np.ndarray]],
        page_size: int,
        heads: int,
        kv_heads: int,
        make_buffers: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    ) -> SharedPrefixes:
        """From each group's members' q rows and shared page ids; ``make_buffers(n)``
        gives gather destinations for n pages (asked only when a group's pages are not
        a run)."""
        g = heads // kv_heads
        parts, plans, at = [], [], 0
        for rows, pages in groups:
            # [kv head][member][query head of the kv head's group]
            idx = (
                rows.astype(np.int64)[None, :, None] * heads
                + np.arange(kv_heads)[:, None, None] * g
                + np.arange(g)[None, None, :]
            )
            parts.append(idx.reshape(-1))
            k_rows = pages.astype(np.int64) * 2
            run = page_size == 1 and len(pages) > 0 and bool((np.diff(pages) == 1).all())
            buffers = (torch.empty(0), torch.empty(0)) if run else make_buffers(len(pages))
            plans.append(Group(torch.from_numpy(k_rows), torch.from_numpy(k_rows + 1),
                               len(pages) * page_size, at, at + idx.size, buffers,
                               int(k_rows[0]) if run else None))  # fmt: skip
            at += idx.size
        index = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return cls(plans, torch.from_numpy(index))


def attend(
    plan: SharedPrefixes,
    q: torch.Tensor,
    pages: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_heads: int,
    scale: float,
) -> None:
    """Every group's members: ``out`` and ``lse`` (float32, or float64 for float64
    values, [T, heads]) := attention over the shared keys merged with the suffix part
    already there. ``q`` and ``out`` contiguous [T, heads, head_dim]."""
    d = q.shape[2]
    qs = q.view(-1, d).index_select(0, plan.index)
    flat_out, flat_lse = out.view(-1, d), lse.view(-1)
    native = q.dtype == torch.bfloat16 and pages.dtype == torch.bfloat16 and d % 32 == 0
    native = native and cpu_kernels.prefix_attention_ok()
    page_size = pages.shape[1] // (kv_heads * d)
    for grp in plan.groups:
        n = (grp.end - grp.begin) // kv_heads
        index = plan.index[grp.begin : grp.end].view(kv_heads, n)
        if native:  # AMX tiles, reading the pool's pages in place
            done = cpu_kernels.prefix_attention(
                qs[grp.begin : grp.end].view(kv_heads, n, d), pages, grp.k_rows, grp.kv_len,
                page_size, scale,
            )  # fmt: skip
            if done is not None:
                cpu_kernels.merge_attention(flat_out, flat_lse, done[0], done[1], index)
                continue
        if grp.run_start is not None:  # every second row of the pool, from run_start
            end = grp.run_start + 2 * grp.kv_len
            kb, vb = pages[grp.run_start : end : 2], pages[grp.run_start + 1 : end : 2]
        else:
            kb, vb = grp.buffers
            torch.index_select(pages, 0, grp.k_rows, out=kb)
            torch.index_select(pages, 0, grp.v_rows, out=vb)
        keys = kb.view(-1, kv_heads, d)[: grp.kv_len].transpose(0, 1).unsqueeze(0)
        vals = vb.view(-1, kv_heads, d)[: grp.kv_len].transpose(0, 1).unsqueeze(0)
        # Every member's query heads of one KV head are queries of one attention call.
        part_q = qs[grp.begin : grp.end].view(1, kv_heads, n, d)
        part, part_lse = _FLASH(part_q, keys, vals, scale=scale)  # type: ignore[misc]
        cpu_kernels.merge_attention(flat_out, flat_lse, part[0], part_lse[0], index)

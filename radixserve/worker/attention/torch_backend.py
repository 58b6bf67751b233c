"""The ``torch`` attention backend: gather pages, then dense attention. Any device, any dtype.

``begin_batch`` turns the page tables into row indices once per step:
- write rows: where each new token's K (and V, ``page_size`` rows further) goes
  in the pool viewed as ``[num_pages * 2 * page_size, kv_heads * head_dim]``;
- gather rows: the pages a request reads, in the pool viewed as
  ``[num_pages * 2, page_size * kv_heads * head_dim]`` (row 2p is page p's K,
  2p + 1 its V). Whole pages are copied with one ``index_select`` each for K
  and V, giving contiguous ``[num_pages_read * page_size, kv_heads, head_dim]``
  keys that attention reads through strided views, without another copy.

Decode requests (one new token) run together as one padded batch through one
``scaled_dot_product_attention`` call per layer, no Python loop over requests.
Each prefill request (several new tokens, possibly after a cached prefix,
possibly a chunk) runs through its own call with an explicit bottom-right
aligned causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch


@dataclass
class _Prefill:
    rows: slice  # rows of q in the flat batch
    gather: torch.Tensor  # [pages read] page rows of K (V = + 1)
    kv_len: int
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V gather destinations, reused per layer
    masks: dict[int, torch.Tensor | None]  # window -> bool [qo_len, kv_len]; None = plain causal


@dataclass
class _Decode:
    rows: torch.Tensor  # [Bd] rows of q in the flat batch
    gather: torch.Tensor  # [Bd * pages read] page rows of K (V = + 1)
    max_len: int  # pages read per request * page_size (padding masked)
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V gather destinations, reused per layer
    bias: dict[int, torch.Tensor]  # window -> additive mask [Bd, 1, 1, L]


class TorchAttention(AttentionBackend):
    name = "torch"

    def begin_batch(self, batch: AttentionBatch) -> None:
        pool = self.pool
        s = pool.page_size
        device = pool.layers[0].device if pool.layers else "cpu"
        qo_lens, kv_lens = batch.qo_lens, batch.kv_lens.astype(np.int64)
        windows = sorted(set(self.sliding_windows))
        write_rows, self._prefills = [], []
        decode_ids = np.flatnonzero(qo_lens == 1)
        for i in range(batch.batch_size):
            pages = batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]
            qo, kv = int(qo_lens[i]), int(kv_lens[i])
            pos = np.arange(kv - qo, kv)
            write_rows.append(pages[pos // s].astype(np.int64) * 2 * s + pos % s)
            if qo == 1:
                continue
            q0 = int(batch.qo_indptr[i])
            gather = pages[: -(-kv // s)].astype(np.int64) * 2
            masks = {w: _prefill_mask(qo, kv, w, device) for w in windows}
            self._prefills.append(
                _Prefill(slice(q0, q0 + qo), torch.from_numpy(gather).to(device), kv,
                         self._buffers(len(gather)), masks)
            )  # fmt: skip
        rows = np.concatenate(write_rows) if write_rows else np.zeros(0, np.int64)
        self._write = torch.from_numpy(rows).to(device)
        self._decode = (
            self._plan_decode(batch, decode_ids, windows, device) if len(decode_ids) else None
        )

    def _plan_decode(
        self, batch: AttentionBatch, ids: np.ndarray, windows: list[int], device: torch.device
    ) -> _Decode:
        s = self.pool.page_size
        kv = batch.kv_lens[ids].astype(np.int64)
        npages = int(-(-kv.max() // s))
        L = npages * s
        table = np.zeros((len(ids), npages), dtype=np.int64)
        for r, i in enumerate(ids):
            pages = batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]
            table[r, : len(pages)] = pages[:npages]
        gather = table.reshape(-1) * 2  # K page rows, request-major
        pos = np.arange(L)
        valid = pos[None, :] < kv[:, None]
        bias = {}
        for w in windows:
            keep = valid if w <= 0 else valid & (pos[None, :] > kv[:, None] - 1 - w)
            b = np.where(keep, 0.0, -np.inf)[:, None, None, :]
            bias[w] = torch.from_numpy(b).to(device=device, dtype=self.pool.dtype)
        q_rows = torch.from_numpy(batch.qo_indptr[ids].astype(np.int64)).to(device)
        return _Decode(
            q_rows, torch.from_numpy(gather).to(device), L, self._buffers(len(gather)), bias
        )

    def _buffers(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Gathered pages land in buffers allocated once per step: a fresh multi-MB tensor per
        # layer would be mapped and page-faulted anew every time.
        ref = self.pool.layers[0]
        shape = (num_pages, ref[0, 0].numel())
        return (torch.empty(shape, dtype=ref.dtype, device=ref.device),
                torch.empty(shape, dtype=ref.dtype, device=ref.device))  # fmt: skip

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        pool = self.pool.layers[layer]
        s, h, d = self.pool.page_size, self.pool.num_kv_heads, self.pool.head_dim
        window = self.sliding_windows[layer]
        tokens = pool.view(-1, h * d)
        tokens.index_copy_(0, self._write, k.reshape(-1, h * d))
        tokens.index_copy_(0, self._write + s, v.reshape(-1, h * d))
        pages = pool.view(-1, s * h * d)
        out = torch.empty_like(q)
        dec = self._decode
        if dec is not None:
            bd = dec.rows.shape[0]
            qd = q.index_select(0, dec.rows).unsqueeze(2)  # [Bd, heads, 1, d]
            kb, vb = dec.buffers
            torch.index_select(pages, 0, dec.gather, out=kb)
            torch.index_select(pages, 0, dec.gather + 1, out=vb)
            keys = kb.view(bd, dec.max_len, h, d).transpose(1, 2)
            vals = vb.view(bd, dec.max_len, h, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qd, keys, vals, attn_mask=dec.bias[window], scale=self.scale, enable_gqa=True
            )
            out.index_copy_(0, dec.rows, o.squeeze(2))
        for p in self._prefills:
            qp = q[p.rows].transpose(0, 1).unsqueeze(0)  # [1, heads, qo, d]
            kb, vb = p.buffers
            torch.index_select(pages, 0, p.gather, out=kb)
            torch.index_select(pages, 0, p.gather + 1, out=vb)
            keys, vals = kb.view(-1, h, d)[: p.kv_len], vb.view(-1, h, d)[: p.kv_len]
            keys, vals = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
            mask = p.masks[window]
            o = F.scaled_dot_product_attention(
                qp, keys, vals, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=True,
            )  # fmt: skip
            out[p.rows] = o[0].transpose(0, 1)
        return out


def _prefill_mask(qo: int, kv: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Bool [qo, kv]: query t sees key j iff j <= t + kv - qo (and j > that - window)."""
    if qo == kv and window <= 0:
        return None  # plain causal: SDPA's own top-left mask is the same when qo == kv
    t = torch.arange(qo, device=device)[:, None] + (kv - qo)
    j = torch.arange(kv, device=device)[None, :]
    keep = j <= t
    if window > 0:
        keep &= j > t - window
    return keep

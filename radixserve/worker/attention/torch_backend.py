"""The ``torch`` attention backend: gather pages, then dense attention. Any device, any dtype.

Decode requests (and, with ``shared_prefix_flash``, short prefill chunks) that
share a cached prefix (the same first pages) read it once:
see ``_cascade_groups`` and ``_cascade_decode`` (docs/attention.md, "Cascade decode").

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

A pool that stores another dtype than the model's (``--kv-cache-dtype``: int8 or fp8
codes with a scale per token and head, or plain values of another float dtype) is
written through ``kv_quant.quantize`` (or a cast) and read back, after the gather,
through ``kv_quant.dequantize`` (or a cast): every path (decode, prefill, cascade)
attends in the model's dtype over the values the pool holds. The native kernel
dequantizes quantized pages itself, where it reads them. A quantized pool stores its
keys rotated (``rotation.py``): ``forward`` rotates q and k first, so every path reads
and writes the rotated basis alone; fp8 key rows take the searched scale, after the
layer's key shift (``key_shift.py``) is taken off them. In the fp8 ``row`` layout a
sequence's position 0 is written as sink rows (``kv_quant.quantize_sink``).

With a soft-cap (Gemma 2) SDPA cannot be used (it has no hook between the scores
and the softmax): the same calls go through ``capped_attention``, which
computes the scores, caps them, masks and takes the softmax itself (``capped.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from radixserve.layers import cpu_kernels
from radixserve.worker.attention import native_decode, shared_prefix
from radixserve.worker.attention.base import AttentionBatch, PoolBackend
from radixserve.worker.attention.capped import cap_, capped_attention
from radixserve.worker.attention.native_decode import Segments
from radixserve.worker.attention.shared_prefix import SharedPrefixes
from radixserve.worker.config import DECODE_KERNELS  # what decode_kernel takes
from radixserve.worker.kv_pool import KVPool
from radixserve.worker.kv_quant import dequantize, fp8_row_layout, quantize, quantize_sink


@dataclass
class _Prefill:
    rows: slice  # rows of q in the flat batch
    gather: torch.Tensor  # [pages read] page rows of K (V = + 1)
    kv_len: int
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V gather destinations, reused per layer
    masks: dict[int, torch.Tensor | None]  # window -> bool [qo_len, kv_len]; None = plain causal
    # Layers without a window: the keys each query vector sees, the chunk's rows folded
    # [token][query head of a kv head] (int32 [qo_len * group]), for the AMX kernel;
    # None where it does not run (``TorchAttention.prefill_amx``).
    limits: np.ndarray | None = None


@dataclass
class _Chunks:
    """A step's prefill chunks for the prefix kernel, one call per layer
    (``cpu_kernels.prefix_attention_chunks``): chunk c is q's rows ``[q_begin[c],
    q_begin[c] + q_len[c])`` over ``kv_len[c]`` keys in the pages whose K rows are
    ``k_rows[page_indptr[c]:page_indptr[c + 1]]``; ``limits`` (int32 [tokens *
    group]) at its rows folded [token][query head of a kv head]."""

    q_begin: np.ndarray
    q_len: np.ndarray
    k_rows: np.ndarray
    page_indptr: np.ndarray
    kv_len: np.ndarray
    limits: np.ndarray


@dataclass
class _Decode:
    rows: torch.Tensor  # [Bd] rows of q in the flat batch
    gather: torch.Tensor  # [Bd * pages read] page rows of K (V = + 1), after the shared pages
    max_len: int  # pages read per request * page_size (padding masked)
    buffers: tuple[torch.Tensor, torch.Tensor]  # K, V gather destinations, reused per layer
    bias: dict[int, torch.Tensor]  # window -> additive mask [Bd, 1, 1, L]
    # Cascade: the pages every request of this batch starts its table with (a shared
    # cached prefix), gathered once; None for a plain batch.
    shared: torch.Tensor | None = None  # [pages] page rows of K (V = + 1)
    shared_buffers: tuple[torch.Tensor, torch.Tensor] | None = None


# A shared prefix shorter than this is read per request: the cascade's extra work
# (a second softmax and the merge) costs more than gathering a few pages again.
CASCADE_MIN_TOKENS = 64

#: The longest prefill chunk that joins a cascade group (``shared_prefix_flash``): its
#: rows go through flash attention over the shared prefix with the group's decodes
#: and other chunks, and the native kernel computes the chunk's own keys causally (a
#: short segment); a longer chunk goes to SDPA over all of its keys.
CASCADE_PREFILL_MAX_TOKENS = 256


#: Where the AMX kernel takes prefill chunks (``TorchAttention.prefill_amx``), a short
#: chunk joins a cascade group only when its cached context is at least this many times
#: its length: 30-token questions over a 1000-token prompt ran 20% faster in the group,
#: 64-token questions over 640 tokens 4-10% faster alone (bench/results/unscripted.md).
CASCADE_PREFILL_CONTEXT_RATIO = 16


#: The longest prefill chunk the native kernel takes where it runs bfloat16 products
#: (AVX512_BF16 without AMX): there its vdpbf16ps tiles beat SDPA up to about this
#: length, a cached prefix or not (bench/results/unscripted.md); longer chunks, and
#: other dtypes, go to SDPA. Where oneDNN has AMX tiles, SDPA's products run on them and
#: every prefill chunk is faster there (the same record).
NATIVE_PREFILL_MAX_TOKENS = 1024

#: Where the prefix kernel's ``vdpbf16ps`` form takes prefill chunks
#: (``TorchAttention.prefill_amx`` without AMX), the native kernel keeps the chunks of up
#: to this many tokens: it reads their keys in place, where the prefix kernel packs K and
#: V per chunk and computes 32 query vectors per task; from 32 tokens on the prefix kernel
#: is faster, 2.2x on a fresh 768-token chunk, and with a step's chunks in one call it
#: does not lose at two threads either (bench/results/prefill_attention.md).
NATIVE_PREFILL_SHORT_TOKENS = 16


def native_prefill_tokens(dtype: torch.dtype, head_dim: int, plain: bool = True) -> int:
    """The longest prefill chunk the native kernel should take for this pool (0: none);
    ``plain``: the pool holds values of ``dtype`` (a quantized pool has no bfloat16
    product tiles to win with)."""
    if (
        plain
        and dtype == torch.bfloat16
        and cpu_kernels.ISA == "avx512bf16"
        and not cpu_kernels.AMX
        and head_dim % 16 == 0
    ):
        return NATIVE_PREFILL_MAX_TOKENS
    return 0


class TorchAttention(PoolBackend):
    name = "torch"
    plans_native_steps = True

    def __init__(
        self,
        pool: KVPool,
        scale: float,
        sliding_windows: tuple[int, ...],
        num_qo_heads: int,
        decode_kernel: str = "auto",
        softcap: float = 0.0,
        deterministic: bool = False,
    ) -> None:
        super().__init__(pool, scale, sliding_windows, num_qo_heads, softcap)
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(
                f"unknown decode kernel {decode_kernel!r}; known: {list(DECODE_KERNELS)}"
            )
        device = pool.layers[0].device if pool.layers else torch.device("cpu")
        reason = native_decode.unsupported_reason(device, pool.dtype, pool)
        #: The pool holds values of the model's dtype (not quantized, not another dtype).
        self.plain = pool.quant is None and pool.storage_dtype == pool.dtype
        #: The per-tensor fp8 layout: pages moved as their bytes (uint8 views).
        self._fp8_bytes = pool.quant is not None and pool.quant.per_tensor
        #: Batch-invariant mode (``--deterministic``): every row, decode or prefill,
        #: through the native kernel with its keys cut at multiples of
        #: ``native_decode.FIXED_CHUNK`` from the first; no cascade, no flash prefix,
        #: no SDPA. A row's output then depends only on its query and its keys.
        self.deterministic = deterministic
        if deterministic:
            if reason is not None:
                raise ValueError(
                    f"deterministic mode needs the native CPU attention kernel: {reason}"
                )
            if decode_kernel == "torch":
                raise ValueError("deterministic mode computes attention with the native kernel, "
                                 "not decode_kernel 'torch'")  # fmt: skip
            if any(w > 0 for w in sliding_windows):
                raise ValueError(
                    "deterministic mode does not support sliding-window attention yet "
                    "(a prefill chunk's rows cannot take a window in the native kernel)"
                )
        if decode_kernel == "native" and reason is not None:
            raise ValueError(f"the native decode kernel cannot run: {reason}")
        self.decode_kernel = "native" if decode_kernel != "torch" and reason is None else "torch"
        #: Prefill chunks of up to this many tokens go through the native kernel too,
        #: as causal segments (0: never; see ``native_prefill_tokens``).
        self.native_prefill_max_tokens = (
            native_prefill_tokens(pool.dtype, pool.head_dim, self.plain)
            if self.decode_kernel == "native"
            else 0
        )
        if deterministic:
            self.native_prefill_max_tokens = 1 << 62  # every chunk
        #: Whether a cascade group's shared prefix goes through our prefix kernel or
        #: torch's CPU flash attention (``shared_prefix.py``) while the native kernel
        #: computes the members' own suffixes: bfloat16 pools where oneDNN has AMX tiles,
        #: or where the prefix kernel runs in ``vdpbf16ps`` (head_dim a multiple of 32;
        #: without AMX torch's flash attention is no faster than the native kernel).
        #: Tests force it for other dtypes.
        self.shared_prefix_flash = (
            self.decode_kernel == "native"
            and not deterministic
            and pool.dtype == torch.bfloat16
            and self.plain
            and (cpu_kernels.AMX or (pool.head_dim % 32 == 0 and cpu_kernels.prefix_attention_ok()))
            and softcap == 0
            and shared_prefix.available()
        )
        #: Set by the runner: whether a decode step of this many rows runs every layer
        #: in one native call (``models/decode_step.py``). Such a step reads its shared
        #: prefixes through the native kernel, not flash attention: that call takes
        #: one attention plan for all rows (``native_step_plan``).
        self.native_layers: Callable[[int], bool] | None = None
        self._flash = self.shared_prefix_flash
        #: This step's token indices at a sequence's position 0, or None (``begin_batch``).
        self._sink: torch.Tensor | None = None
        #: Whether prefill chunks that go to SDPA take our prefix kernel instead
        #: (``cpu_kernels.prefix_attention``, with a causal limit per query vector; the
        #: pool's pages read in place): bfloat16 pools of head_dim a multiple of 32 where
        #: it runs (AMX tiles, or ``vdpbf16ps`` at avx512bf16), no soft-cap; layers with a
        #: sliding window keep SDPA. Where it runs in ``vdpbf16ps``, the native kernel
        #: keeps only chunks of up to ``NATIVE_PREFILL_SHORT_TOKENS`` tokens.
        self.prefill_amx = (
            not deterministic
            and pool.dtype == torch.bfloat16
            and self.plain
            and pool.head_dim % 32 == 0
            and softcap == 0
            and cpu_kernels.prefix_attention_ok()
        )
        if self.prefill_amx:  # (the native kernel takes no chunk where AMX runs)
            self.native_prefill_max_tokens = min(
                self.native_prefill_max_tokens, NATIVE_PREFILL_SHORT_TOKENS
            )

    def begin_batch(self, batch: AttentionBatch) -> None:
        pool = self.pool
        s = pool.page_size
        device = pool.layers[0].device if pool.layers else "cpu"
        qo_lens, kv_lens = batch.qo_lens, batch.kv_lens.astype(np.int64)
        windows = sorted(set(self.sliding_windows))
        write_rows, self._prefills = [], []
        members = qo_lens == 1
        # A step whose layers all run in one native call (decode_step.py, up to 32 rows:
        # decodes, and requests' drafts being verified as short causal chunks) gets one
        # native plan for every row: no flash attention, no SDPA.
        one_call = (
            self.decode_kernel == "native"
            and self.native_layers is not None
            and all(w <= 0 for w in windows)
            and self.native_layers(int(qo_lens.sum()))
        )
        self._flash = self.shared_prefix_flash and not one_call
        if (self._flash or one_call) and all(w <= 0 for w in windows):
            # Short prefill chunks over a cached prefix they share with others (the
            # questions after one system prompt) read it once, as decodes do. Where the
            # AMX kernel takes prefill chunks, only a chunk whose context is long against
            # it joins: the group packs the prefix once, a chunk alone packs it again
            # but needs no suffix pass and merge (docs/cpu-kernels.md, "Prefill chunks on
            # the same kernel").
            short = qo_lens <= CASCADE_PREFILL_MAX_TOKENS
            if self.prefill_amx and not one_call:
                short &= kv_lens - qo_lens >= CASCADE_PREFILL_CONTEXT_RATIO * qo_lens
            members |= short
        groups, plain = self._cascade_groups(batch, np.flatnonzero(members), windows)
        if self.deterministic:
            groups, plain = self._fixed_groups(groups, plain)
        grouped = {int(i) for ids, _ in groups for i in ids if qo_lens[i] > 1}
        plain = plain[qo_lens[plain] == 1]  # the chunks left alone are planned below
        native_prefills = []
        native_limit = self.native_prefill_max_tokens if all(w <= 0 for w in windows) else 0
        if one_call:
            native_limit = max(native_limit, int(qo_lens.max()))
        for i in range(batch.batch_size):
            pages = batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]
            qo, kv = int(qo_lens[i]), int(kv_lens[i])
            pos = np.arange(kv - qo, kv)
            write_rows.append(pages[pos // s].astype(np.int64) * 2 * s + pos % s)
            if qo == 1 or i in grouped:
                continue
            if qo <= native_limit:
                native_prefills.append(i)
                continue
            q0 = int(batch.qo_indptr[i])
            gather = pages[: -(-kv // s)].astype(np.int64) * 2
            masks = {w: _prefill_mask(qo, kv, w, device) for w in windows}
            limits = None
            if self.prefill_amx:  # token t of the chunk sees keys [0, kv - qo + t + 1)
                group = self.num_qo_heads // pool.num_kv_heads
                limits = np.repeat(np.arange(kv - qo + 1, kv + 1, dtype=np.int32), group)
            self._prefills.append(
                _Prefill(slice(q0, q0 + qo), torch.from_numpy(gather).to(device), kv,
                         self._buffers(len(gather)), masks, limits)
            )  # fmt: skip
        rows = np.concatenate(write_rows) if write_rows else np.zeros(0, np.int64)
        self._write = torch.from_numpy(rows).to(device)
        # The step's tokens at a sequence's position 0: sink rows in an fp8 row pool.
        self._sink = None
        if fp8_row_layout(pool.quant):
            first = np.flatnonzero(kv_lens == qo_lens)
            if len(first):
                self._sink = torch.from_numpy(batch.qo_indptr[first].astype(np.int64)).to(device)
        self._write_rows = rows
        self._chunks = self._plan_chunks(int(batch.qo_indptr[-1]))
        self._decodes, self._native, self._shared, self._lse = [], None, None, None
        if self.decode_kernel == "native":
            self._native = self._plan_native(batch, groups, plain, windows, native_prefills)
        else:
            self._decodes = [
                self._plan_decode(batch, ids, common, windows, device) for ids, common in groups
            ]
            if len(plain):
                self._decodes.append(self._plan_decode(batch, plain, 0, windows, device))

    def native_step_plan(self) -> tuple[np.ndarray, Segments] | None:
        """This step's K/V write rows (int64, in the pool viewed as ``[pages * 2 *
        page_size, kv_heads * head_dim]``) and its native attention plan, when that
        one plan computes every row of the batch with nothing else around it (no
        shared prefix through flash attention, no gather + SDPA, no sliding window or
        soft-cap; a pool of rotated keys is written and read rotated there too); else
        None. Short prefill chunks (drafts being verified) are causal
        segments of the plan. A caller that runs every layer in
        native code (``models/decode_step.py``) writes and attends with these."""
        seg = self._native
        cast = self.pool.quant is None and not self.plain  # another float dtype
        if (
            seg is None
            or cast
            or self._sink is not None  # the native writes have no sink rows
            or self._shared is not None
            or self._decodes
            or self._prefills
            or self.softcap > 0
            or any(w > 0 for w in self.sliding_windows)
        ):
            return None
        return self._write_rows, seg

    def _fixed_groups(
        self, groups: list[tuple[np.ndarray, int]], plain: np.ndarray
    ) -> tuple[list[tuple[np.ndarray, int]], np.ndarray]:
        """Batch-invariant mode: a group's shared prefix cut back to a multiple of
        ``FIXED_CHUNK`` keys (its members alone when nothing is left, or when pages do
        not tile that chunk). Its items are then exactly the fixed items each member
        would compute alone, and the kernel merges a row's items in key order (the
        shared segment comes first in the plan): the same bits with or without it."""
        fixed, s = native_decode.FIXED_CHUNK, self.pool.page_size
        kept, alone = [], [plain]
        for ids, common in groups:
            cut = (common * s) // fixed * fixed // s if fixed % s == 0 else 0
            if cut > 0:
                kept.append((ids, cut))
            else:
                alone.append(ids)
        return kept, np.sort(np.concatenate(alone)).astype(plain.dtype, copy=False)

    def _cascade_groups(
        self, batch: AttentionBatch, ids: np.ndarray, windows: list[int]
    ) -> tuple[list[tuple[np.ndarray, int]], np.ndarray]:
        """Split the decode requests (and prefill chunks) into groups whose page tables
        start with the same ``common`` pages (a shared cached prefix, read once by
        cascade attention) and the others: ``([(ids, common), ...], plain ids)``. A
        chunk's shared pages end before its first new token: every row of the group
        sees every shared key."""
        if not len(ids):
            return [], ids
        s = self.pool.page_size
        tables = [batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]] for i in ids]
        # Keys every row of a request sees: a decode all of its own (kv), a chunk those
        # before its first new token and that token (kv - qo + 1).
        seen = (batch.kv_lens[ids].astype(np.int64) - batch.qo_lens[ids] + 1).tolist()
        plain: list[int] = []
        groups: list[tuple[np.ndarray, int]] = []

        def common_pages(members: list[int]) -> int:
            # Pages that start every member's table hold the same tokens for all of
            # them (the radix cache shares whole pages only).
            full = int(min(seen[r] for r in members) // s)
            first = tables[members[0]][:full]
            for r in members[1:]:
                same = tables[r][:full] == first
                full = int(same.argmin()) if not same.all() else full
                first = first[:full]
            return full

        def place(members: list[int]) -> None:
            # Like a trie walk: read a long common prefix once, else split the group
            # where the tables part and look for one below.
            if len(members) < 2:
                plain.extend(members)
                return
            common = common_pages(members)
            if common * s >= CASCADE_MIN_TOKENS:
                groups.append((ids[members], common))
                return
            parts: dict[int, list[int]] = {}
            for r in members:
                parts.setdefault(int(tables[r][common]), []).append(r)
            if len(parts) == 1:
                plain.extend(members)
                return
            for part in parts.values():
                place(part)

        if all(w <= 0 for w in windows):
            roots: dict[int, list[int]] = {}
            for r, pages in enumerate(tables):
                roots.setdefault(int(pages[0]), []).append(r)
            for members in roots.values():
                place(members)
        else:
            plain = list(range(len(ids)))
        return groups, ids[sorted(plain)]

    def _plan_native(
        self,
        batch: AttentionBatch,
        groups: list[tuple[np.ndarray, int]],
        plain: np.ndarray,
        windows: list[int],
        prefills: list[int],
    ) -> Segments | None:
        """Segments for the native kernel: every decode request reads its own pages
        (after the shared ones for a cascade member); each cascade group's shared
        pages are one more segment holding all of the group's rows. A member's row is
        thus in two segments with disjoint keys, and the kernel merges the two. Each
        request of ``prefills`` is a causal segment of its new tokens' rows over all
        of its keys (cached prefix and chunk)."""
        if not len(plain) and not groups and not prefills:
            return None
        s, h = self.pool.page_size, self.pool.num_kv_heads
        qrow = batch.qo_indptr

        def table(i: int) -> np.ndarray:
            return batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]

        def q_rows(ids: np.ndarray) -> np.ndarray:
            """The query rows of requests ``ids`` (one each for decodes)."""
            if (batch.qo_lens[ids] == 1).all():
                return qrow[ids]
            return np.concatenate([np.arange(qrow[i], qrow[i + 1], dtype=np.int32) for i in ids])

        rows, tables, kv, causal = [], [], [], []
        flash = []
        # The shared segments first: the kernel merges a row's parts in plan order, so a
        # member's parts come in key order (shared prefix, then its own keys).
        for ids, common in groups:
            if self._flash:
                flash.append((q_rows(ids), table(int(ids[0]))[:common]))
                continue
            rows.append(q_rows(ids))
            tables.append(table(int(ids[0]))[:common])
            kv.append(common * s)
            causal.append(False)
        rows += [qrow[i : i + 1] for i in plain]
        tables += [table(i) for i in plain]
        kv += [int(batch.kv_lens[i]) for i in plain]
        causal += [False] * len(plain)
        for ids, common in groups:
            # Each member's own keys after the shared ones: causal for a chunk's rows.
            rows += [np.arange(qrow[i], qrow[i + 1], dtype=np.int32) for i in ids]
            tables += [table(i)[common:] for i in ids]
            kv += [int(batch.kv_lens[i]) - common * s for i in ids]
            causal += [bool(batch.qo_lens[i] > 1) for i in ids]
        if flash:
            self._shared = SharedPrefixes.build(flash, s, self.num_qo_heads, h, self._buffers)
            ct = torch.promote_types(self.pool.dtype, torch.float32)
            self._lse = torch.empty(int(qrow[-1]), self.num_qo_heads, dtype=ct)
        for i in prefills:
            rows.append(np.arange(qrow[i], qrow[i + 1], dtype=np.int32))
            tables.append(table(i)[: -(-int(batch.kv_lens[i]) // s)])
            kv.append(int(batch.kv_lens[i]))
            causal.append(True)
        seg = Segments.build(rows, tables, np.array(kv), windows, h, causal)
        if self.deterministic:
            seg.fixed = native_decode.FIXED_CHUNK
        return seg

    def _plan_decode(
        self,
        batch: AttentionBatch,
        ids: np.ndarray,
        common: int,
        windows: list[int],
        device: torch.device,
    ) -> _Decode:
        """One padded batch of decode requests; the first ``common`` pages of their
        tables are the same and are read once (cascade) when ``common`` > 0."""
        s = self.pool.page_size
        kv = batch.kv_lens[ids].astype(np.int64)
        npages = int(-(-kv.max() // s))
        table = np.zeros((len(ids), npages), dtype=np.int64)
        for r, i in enumerate(ids):
            pages = batch.page_indices[batch.page_indptr[i] : batch.page_indptr[i + 1]]
            table[r, : len(pages)] = pages[:npages]
        L = (npages - common) * s
        gather = table[:, common:].reshape(-1) * 2  # K page rows, request-major
        pos = common * s + np.arange(L)
        valid = pos[None, :] < kv[:, None]
        bias = {}
        for w in windows:
            keep = valid if w <= 0 else valid & (pos[None, :] > kv[:, None] - 1 - w)
            b = np.where(keep, 0.0, -np.inf)[:, None, None, :]
            bias[w] = torch.from_numpy(b).to(device=device, dtype=self.pool.dtype)
        q_rows = torch.from_numpy(batch.qo_indptr[ids].astype(np.int64)).to(device)
        dec = _Decode(
            q_rows, torch.from_numpy(gather).to(device), L, self._buffers(len(gather)), bias
        )
        if common:
            dec.shared = torch.from_numpy(table[0, :common] * 2).to(device)
            dec.shared_buffers = self._buffers(common)
        return dec

    def _buffers(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Gathered pages land in buffers allocated once per step: a fresh multi-MB tensor per
        # layer would be mapped and page-faulted anew every time.
        ref = self.pool.layers[0]  # in the storage dtype: codes and scales when quantized
        shape = (num_pages, ref[0, 0].numel())
        dt = torch.uint8 if self._fp8_bytes else ref.dtype
        return (torch.empty(shape, dtype=dt, device=ref.device),
                torch.empty(shape, dtype=dt, device=ref.device))  # fmt: skip

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.rotation is not None:  # a quantized pool: keys stored rotated, queries alike
            q, k = self.rotation.rotate(q, k, layer)
        pool = self.pool.layers[layer]
        if self._fp8_bytes:  # CPU index_copy_ / index_select take no fp8: move the bytes
            pool = pool.view(torch.uint8)
        s, h, e = self.pool.page_size, self.pool.num_kv_heads, self.pool.entry_dim
        window = self.sliding_windows[layer]
        tokens = pool.view(-1, h * e)
        gptq = None if self.pool.key_gptq is None else self.pool.key_gptq[layer]  # key_shift.py
        keys = self._encode(k, search_scale=self.rotation is not None, gptq=gptq)
        values = self._encode(v)
        if self._sink is not None:
            keys[self._sink] = quantize_sink(k[self._sink])
            values[self._sink] = quantize_sink(v[self._sink])
        tokens.index_copy_(0, self._write, keys.reshape(-1, h * e))
        tokens.index_copy_(0, self._write + s, values.reshape(-1, h * e))
        pages = pool.view(-1, s * h * e)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._native is not None:
            q = q.contiguous()
            self._native_decode(pool, q, out, window, self._lse)
            if self._shared is not None:
                shared_prefix.attend(self._shared, q, pages, out, self._lse, h, self.scale)  # type: ignore[arg-type]
        for dec in self._decodes:
            if dec.shared is not None:
                o = self._cascade_decode(pages, q, dec, dec.bias[window])
                out.index_copy_(0, dec.rows, o)
                continue
            bd = dec.rows.shape[0]
            qd = q.index_select(0, dec.rows).unsqueeze(2)  # [Bd, heads, 1, d]
            kb, vb = dec.buffers
            torch.index_select(pages, 0, dec.gather, out=kb)
            torch.index_select(pages, 0, dec.gather + 1, out=vb)
            keys = self._decode(kb.view(bd, dec.max_len, h, e)).transpose(1, 2)
            vals = self._decode(vb.view(bd, dec.max_len, h, e)).transpose(1, 2)
            o = self._attention(qd, keys, vals, dec.bias[window])
            out.index_copy_(0, dec.rows, o.squeeze(2))
        tiled = window <= 0 and self._chunks is not None and self._prefill_tiles(pages, q, out)
        for p in self._prefills:
            if tiled and p.limits is not None:
                continue
            qp = q[p.rows].transpose(0, 1).unsqueeze(0)  # [1, heads, qo, d]
            kb, vb = p.buffers
            torch.index_select(pages, 0, p.gather, out=kb)
            torch.index_select(pages, 0, p.gather + 1, out=vb)
            keys = self._decode(kb.view(-1, h, e)[: p.kv_len])
            vals = self._decode(vb.view(-1, h, e)[: p.kv_len])
            keys, vals = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
            o = self._attention(qp, keys, vals, p.masks[window])
            out[p.rows] = o[0].transpose(0, 1)
        return out

    def _plan_chunks(self, tokens: int) -> _Chunks | None:
        """The step's arrays for ``cpu_kernels.prefix_attention_chunks``: every prefill
        chunk the prefix kernel takes (those with limits), in one call per layer."""
        chunks = [p for p in self._prefills if p.limits is not None]
        if not chunks:
            return None
        group = self.num_qo_heads // self.pool.num_kv_heads
        limits = np.zeros(tokens * group, np.int32)
        for p in chunks:
            limits[p.rows.start * group : p.rows.stop * group] = p.limits
        gathers = [p.gather.numpy() for p in chunks]  # K rows (int64)
        return _Chunks(
            q_begin=np.array([p.rows.start for p in chunks], np.int64),
            q_len=np.array([p.rows.stop - p.rows.start for p in chunks], np.int64),
            k_rows=np.concatenate(gathers),
            page_indptr=np.cumsum([0] + [len(g) for g in gathers], dtype=np.int64),
            kv_len=np.array([p.kv_len for p in chunks], np.int64),
            limits=limits,
        )

    def _prefill_tiles(self, pages: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> bool:
        """Every prefill chunk of ``self._chunks`` by the prefix kernel in one call,
        reading its keys from the layer's ``pages`` (this step's rows already written)
        and writing the chunks' rows of ``out`` (contiguous); False where the kernel
        cannot run."""
        c, kvh = self._chunks, self.pool.num_kv_heads
        assert c is not None
        tokens, heads, d = q.shape
        # [tokens, heads, d] as [token][kv head][query head of the kv head][d]: the
        # kernel's folded rows, read and written in place.
        folded = (tokens, kvh, heads // kvh, d)
        res = cpu_kernels.prefix_attention_chunks(
            q.contiguous().view(folded), pages, c.q_begin, c.q_len, c.k_rows, c.page_indptr,
            c.kv_len, self.pool.page_size, self.scale, c.limits, out=out.view(folded),
        )  # fmt: skip
        return res is not None

    def _encode(
        self, x: torch.Tensor, search_scale: bool = False, gptq: torch.Tensor | None = None
    ) -> torch.Tensor:
        """New K or V rows [T, kv_heads, head_dim] as the pool stores them
        (``search_scale``: rotated keys, ``gptq``: their layer's GPTQ factors,
        ``kv_quant.quantize``)."""
        if self.pool.quant is not None:
            codes = quantize(x, self.pool.quant, search_scale=search_scale, gptq=gptq)
            return codes.view(torch.uint8) if self._fp8_bytes else codes
        return x.to(self.pool.storage_dtype)

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """Gathered pool rows [..., entry_dim] as values of the model's dtype (the rows
        themselves, not a copy, for a plain pool)."""
        if self.pool.quant is not None:
            return dequantize(x, self.pool.quant, self.pool.dtype)
        return x.to(self.pool.dtype)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [B, heads, Lq, d], k/v [B, kv_heads, Lk, d]; ``mask``: bool keep [Lq, Lk] or
        additive [B, 1, 1, Lk], None for plain causal (Lq == Lk)."""
        if self.softcap > 0:
            return capped_attention(q, k, v, mask, self.scale, self.softcap)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
        )

    def _native_decode(
        self,
        pool: torch.Tensor,
        q: torch.Tensor,
        out: torch.Tensor,
        window: int,
        lse: torch.Tensor | None = None,
    ) -> None:
        assert self._native is not None
        native_decode.paged_decode(
            q.contiguous(), pool, out, lse, self._native, window, self.scale, softcap=self.softcap,
            quant=self.pool.quant,
        )  # fmt: skip

    def _cascade_decode(
        self, pages: torch.Tensor, q: torch.Tensor, dec: _Decode, bias: torch.Tensor
    ) -> torch.Tensor:
        """Decode attention in two parts merged by their log-sum-exp: every query
        against the shared prefix (one batched GEMM per kv head, K/V read once), and
        each query against its own suffix. No sliding window (planning checks)."""
        h, d, e = self.pool.num_kv_heads, self.pool.head_dim, self.pool.entry_dim
        bd = dec.rows.shape[0]
        g = q.shape[1] // h
        ct = torch.promote_types(q.dtype, torch.float32)  # softmax sums in >= float32
        qd = q.index_select(0, dec.rows).to(ct).view(bd, h, g, d)
        kc, vc = dec.shared_buffers  # type: ignore[misc]
        torch.index_select(pages, 0, dec.shared, out=kc)
        torch.index_select(pages, 0, dec.shared + 1, out=vc)
        k1 = self._decode(kc.view(-1, h, e)).to(ct).permute(1, 2, 0)  # [h, d, Lc]
        v1 = self._decode(vc.view(-1, h, e)).to(ct).transpose(0, 1)  # [h, Lc, d]
        q1 = qd.permute(1, 0, 2, 3).reshape(h, bd * g, d)
        s1 = cap_(torch.bmm(q1, k1).mul_(self.scale), self.softcap)  # [h, Bd*g, Lc]
        m1 = s1.amax(-1, keepdim=True)
        p1 = s1.sub_(m1).exp_()
        l1 = p1.sum(-1, keepdim=True)
        o1 = torch.bmm(p1, v1)  # [h, Bd*g, d], unnormalised
        # Back to [Bd, h, g, .] to meet the suffix part.
        o1 = o1.view(h, bd, g, d).permute(1, 0, 2, 3)
        m1 = m1.view(h, bd, g, 1).permute(1, 0, 2, 3)
        l1 = l1.view(h, bd, g, 1).permute(1, 0, 2, 3)
        kb, vb = dec.buffers
        torch.index_select(pages, 0, dec.gather, out=kb)
        torch.index_select(pages, 0, dec.gather + 1, out=vb)
        k2 = self._decode(kb.view(bd, dec.max_len, h, e)).to(ct).permute(0, 2, 3, 1)
        v2 = self._decode(vb.view(bd, dec.max_len, h, e)).to(ct).transpose(1, 2)
        s2 = cap_(torch.matmul(qd, k2).mul_(self.scale), self.softcap)
        s2.add_(bias.to(ct))  # [Bd, h, g, Ls]
        m2 = s2.amax(-1, keepdim=True)  # finite: every request has its new token here
        p2 = s2.sub_(m2).exp_()
        l2 = p2.sum(-1, keepdim=True)
        o2 = torch.matmul(p2, v2)
        m = torch.maximum(m1, m2)
        a1, a2 = (m1 - m).exp_(), (m2 - m).exp_()
        o = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
        return o.reshape(bd, h * g, d).to(q.dtype)


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

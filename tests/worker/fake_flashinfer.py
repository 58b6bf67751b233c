"""A CPU test double of the few flashinfer APIs the flashinfer backend calls.

It mirrors flashinfer-python 0.7.4's signatures for
``BatchPrefillWithPagedKVCacheWrapper``, ``BatchDecodeWithPagedKVCacheWrapper``
and ``append_paged_kv_cache``, refuses what the real library refuses or gets
wrong silently (non-int32 or device-resident plan indices, float16 as an
unstated ``q_data_type`` default, non-half dtypes, head_dim not a multiple of
64, last_page_len outside [1, page_size], K/V with unequal strides, run before
plan, shapes that do not match the plan), and computes the reference math in
float32 with FlashInfer's bottom-right causal mask, ``window_left``, ``sm_scale`` and
``logits_soft_cap``.

Stricter than the real API on purpose: arguments after ``page_size`` in
``plan`` are keyword-only (positions have shifted between releases, e.g.
``head_dim_vo`` was inserted) and ``backend`` must be ``"fa2"`` (``auto``
picks fa3 on sm90, whose JIT build takes many minutes).

This proves the backend's wiring (what it plans, appends and runs, with which
indices, dtypes and layouts), not FlashInfer's kernels: those are checked by
``test_flashinfer_gpu.py`` on a CUDA machine.

``install(monkeypatch)`` puts the double in ``sys.modules["flashinfer"]`` and
lets the backend accept CPU pools; ``FakeFlashInfer.calls`` records every call.
"""

from __future__ import annotations

import sys
import types

import torch

HALF = (torch.float16, torch.bfloat16)
_UNSET = object()


class FakeFlashInfer(types.ModuleType):
    """The ``flashinfer`` module double: only the names the backend uses."""

    def __init__(self) -> None:
        super().__init__("flashinfer")
        self.__version__ = "0.7.4+cpu-test-double"
        self.calls: list[tuple[str, object]] = []
        self.workspaces: list[torch.Tensor] = []
        fake = self

        class _Prefill(_PrefillWrapper):
            module = fake

        class _Decode(_DecodeWrapper):
            module = fake

        self.BatchPrefillWithPagedKVCacheWrapper = _Prefill
        self.BatchDecodeWithPagedKVCacheWrapper = _Decode

    def append_paged_kv_cache(
        self,
        append_key: torch.Tensor,
        append_value: torch.Tensor,
        batch_indices: torch.Tensor,
        positions: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_indices: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        kv_layout: str = "NHD",
    ) -> None:
        self.calls.append(("append", positions.numel()))
        _check(kv_layout == "NHD", f"kv_layout {kv_layout!r}: the double knows NHD only")
        k_cache, v_cache = _unpack(paged_kv_cache)
        dev = append_key.device
        for name, t in [("batch_indices", batch_indices), ("positions", positions),
                        ("kv_indices", kv_indices), ("kv_indptr", kv_indptr),
                        ("kv_last_page_len", kv_last_page_len)]:  # fmt: skip
            # The kernel's CHECK_INPUT: on the key's device, contiguous; and int32.
            _check(t.device == dev, f"{name} must be on {dev}, got {t.device}")
            _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
            _check(t.dim() == 1 and t.is_contiguous(), f"{name} must be contiguous 1-D")
        nnz, kv_heads, head_dim = _shape3(append_key, "append_key")
        _check(append_value.shape == append_key.shape, "append_value shape != append_key shape")
        for t in (append_value, k_cache, v_cache):
            _check(t.device == dev, f"all tensors must be on {dev}")
        _check(append_key.stride(-1) == 1 and append_value.stride(-1) == 1,
               "append_key/append_value need a contiguous last dim")  # fmt: skip
        _check(append_key.dtype == append_value.dtype == k_cache.dtype,
               "append_key/append_value dtype must equal the cache dtype")  # fmt: skip
        _check(k_cache.shape[2:] == (kv_heads, head_dim), "cache heads/head_dim != append_key's")
        _check(batch_indices.numel() == nnz and positions.numel() == nnz,
               "batch_indices/positions need one entry per appended token")  # fmt: skip
        page_size = k_cache.shape[1]
        seq_lens = _seq_lens(kv_indptr, kv_indices, kv_last_page_len, page_size, k_cache.shape[0])
        b, pos = batch_indices.long(), positions.long()
        _check(bool((b >= 0).all() and (b < len(seq_lens)).all()), "batch index out of range")
        _check(bool((pos >= 0).all() and (pos < seq_lens[b]).all()),
               "position beyond its request's pages (kv_last_page_len must include the append)")  # fmt: skip
        page = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
        k_cache[page, pos % page_size] = append_key
        v_cache[page, pos % page_size] = append_value


class _Wrapper:
    module: FakeFlashInfer
    kind = ""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        _check(kv_layout == "NHD", f"kv_layout {kv_layout!r}: the double knows NHD only")
        _check(not use_cuda_graph, "the double has no CUDA-graph mode")
        _check(backend == "fa2", f"backend={backend!r}: force 'fa2' (auto picks fa3 on sm90)")
        ws = float_workspace_buffer
        _check(ws.dtype == torch.uint8 and ws.numel() >= 128 << 20,
               "float workspace: a uint8 buffer of at least 128 MB")  # fmt: skip
        self.module.workspaces.append(ws)
        self.workspace = ws
        self.plan_args: dict | None = None

    def _plan(
        self,
        qo_indptr: torch.Tensor | None,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        causal: bool,
        sm_scale: float | None,
        window_left: int,
        logits_soft_cap: float | None,
        q_data_type: object,
        kv_data_type: object,
    ) -> None:
        named = [("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)]
        if qo_indptr is not None:
            named.append(("qo_indptr", qo_indptr))
        for name, t in named:
            # Real plan() wants host int32 indices (device ones cost a sync and a copy back).
            _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
            _check(t.device.type == "cpu", f"{name} must be a CPU tensor for plan()")
            _check(t.dim() == 1, f"{name} must be 1-D")
        _check(q_data_type is not _UNSET, "pass q_data_type: it defaults to float16")
        _check(q_data_type in HALF, f"q_data_type {q_data_type}: half precision only")
        _check(kv_data_type == q_data_type, "kv_data_type must be given and equal q_data_type")
        _check(num_qo_heads % num_kv_heads == 0, "num_qo_heads must be a multiple of num_kv_heads")
        _check(head_dim % 64 == 0, f"head_dim {head_dim}: fa2 needs a multiple of 64")
        _check(window_left >= -1, "window_left must be >= -1")
        cap = 0.0 if logits_soft_cap is None else logits_soft_cap
        _check(cap >= 0, "logits_soft_cap must be >= 0 (0 or None: none)")
        batch = len(last_page_len)
        _check(len(indptr) == batch + 1 and int(indptr[0]) == 0, "indptr must be [batch + 1]")
        _check(bool((indptr.diff() >= 1).all()), "every request needs at least one page")
        _check(int(indptr[-1]) == len(indices), "len(indices) must be indptr[-1]")
        _check(bool(((last_page_len >= 1) & (last_page_len <= page_size)).all()),
               "last_page_len must be in [1, page_size]")  # fmt: skip
        kv_lens = (indptr.diff().long() - 1) * page_size + last_page_len.long()
        if qo_indptr is None:
            qo_indptr = torch.arange(batch + 1, dtype=torch.int32)  # decode: one row each
        _check(len(qo_indptr) == batch + 1 and int(qo_indptr[0]) == 0, "qo_indptr: [batch + 1]")
        qo_lens = qo_indptr.diff().long()
        _check(bool((qo_lens >= 1).all() and (qo_lens <= kv_lens).all()),
               "each request needs 1 <= qo_len <= kv_len")  # fmt: skip
        self.module.calls.append((f"plan_{self.kind}", batch))
        # The real plan copies the indices to the device: later host edits do not leak in.
        self.plan_args = dict(
            qo_indptr=qo_indptr.clone(), indptr=indptr.clone(), indices=indices.clone(),
            kv_lens=kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, causal=causal, window_left=window_left,
            sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale, dtype=q_data_type,
            logits_soft_cap=cap,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *,
        out: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor:
        p = self.plan_args
        _check(p is not None, "run() before plan()")
        _check(not return_lse and out is None, "the double returns a fresh output only")
        k_cache, v_cache = _unpack(paged_kv_cache)
        nnz = int(p["qo_indptr"][-1])
        _check(q.shape == (nnz, p["num_qo_heads"], p["head_dim"]),
               f"q shape {tuple(q.shape)} != planned {(nnz, p['num_qo_heads'], p['head_dim'])}")  # fmt: skip
        _check(q.stride(-1) == 1, "q needs a contiguous last dim")
        _check(q.dtype == p["dtype"], f"q dtype {q.dtype} != planned q_data_type {p['dtype']}")
        _check(k_cache.dtype == p["dtype"], "cache dtype != planned kv_data_type")
        _check(k_cache.shape[1:] == (p["page_size"], p["num_kv_heads"], p["head_dim"]),
               "cache shape does not match the planned page_size/num_kv_heads/head_dim")  # fmt: skip
        _check(q.device == k_cache.device == self.workspace.device,
               "q, cache and workspace must share a device")  # fmt: skip
        _check(bool((p["indices"] < k_cache.shape[0]).all()), "page index beyond the cache")
        self.module.calls.append((f"run_{self.kind}", nnz))
        return _reference(q, k_cache, v_cache, p)


class _PrefillWrapper(_Wrapper):
    kind = "prefill"

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        *,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: object = _UNSET,
        kv_data_type: object = None,
    ) -> None:
        _check(pos_encoding_mode == "NONE", "rotary is applied outside attention")
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                   window_left, logits_soft_cap, q_data_type, kv_data_type)  # fmt: skip


class _DecodeWrapper(_Wrapper):
    kind = "decode"
    # Group sizes the CUDA-core decode kernel is instantiated for (DISPATCH_GQA_GROUP_SIZE).
    CUDA_CORE_GROUPS = (1, 2, 3, 4, 6, 8, 16)

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend=backend)
        self.use_tensor_cores = use_tensor_cores

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        q_data_type: object = _UNSET,
        kv_data_type: object = None,
    ) -> None:
        _check(pos_encoding_mode == "NONE", "rotary is applied outside attention")
        group = num_qo_heads // max(num_kv_heads, 1)
        _check(self.use_tensor_cores or group in self.CUDA_CORE_GROUPS,
               f"Unsupported group_size: {group} (CUDA-core decode; use tensor cores)")  # fmt: skip
        self._plan(None, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, sm_scale, window_left, logits_soft_cap, q_data_type,
                   kv_data_type)  # fmt: skip


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: dict):
    """Paged attention in float32: bottom-right causal mask, window_left, GQA."""
    out = torch.empty_like(q)
    group = p["num_qo_heads"] // p["num_kv_heads"]
    for i in range(len(p["kv_lens"])):
        q0, q1 = int(p["qo_indptr"][i]), int(p["qo_indptr"][i + 1])
        kv = int(p["kv_lens"][i])
        pages = p["indices"][int(p["indptr"][i]) : int(p["indptr"][i + 1])].long()
        keys = k_cache[pages].flatten(0, 1)[:kv].float().repeat_interleave(group, dim=1)
        vals = v_cache[pages].flatten(0, 1)[:kv].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,jhd->htj", q[q0:q1].float(), keys) * p["sm_scale"]
        if p["logits_soft_cap"] > 0:  # FlashInfer's LogitsSoftCap: cap * tanh(score / cap)
            scores = torch.tanh(scores / p["logits_soft_cap"]) * p["logits_soft_cap"]
        t = torch.arange(q1 - q0)[:, None] + (kv - (q1 - q0))  # query's absolute position
        j = torch.arange(kv)[None, :]
        keep = j <= t if p["causal"] else torch.ones_like(j <= t)
        if p["window_left"] >= 0:
            keep &= j >= t - p["window_left"]
        scores = scores.masked_fill(~keep.to(scores.device), float("-inf"))
        out[q0:q1] = torch.einsum("htj,jhd->thd", scores.softmax(-1), vals).to(q.dtype)
    return out


def _unpack(cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor]):
    if isinstance(cache, tuple):
        k, v = cache
    else:
        _check(cache.dim() == 5 and cache.shape[1] == 2,
               "a single-tensor NHD cache is [num_pages, 2, page_size, kv_heads, head_dim]")  # fmt: skip
        k, v = cache.unbind(1)
    _check(k.dim() == 4 and k.shape == v.shape, "K and V caches: equal 4-D shapes")
    _check(k.stride() == v.stride(), "K and V caches must have equal strides (fa2)")
    _check(k.stride(-1) == 1, "cache needs a contiguous last dim")
    _check(k.dtype in HALF, f"cache dtype {k.dtype}: half precision only")
    return k, v


def _seq_lens(indptr, indices, last, page_size, num_pages) -> torch.Tensor:
    _check(len(indptr) == len(last) + 1 and int(indptr[-1]) <= len(indices), "bad kv_indptr")
    _check(bool(((last >= 1) & (last <= page_size)).all()), "last_page_len not in [1, page_size]")
    _check(bool((indices >= 0).all() and (indices < num_pages).all()), "page index out of range")
    return (indptr.diff().long() - 1) * page_size + last.long()


def _shape3(t: torch.Tensor, name: str) -> tuple[int, int, int]:
    _check(t.dim() == 3, f"{name} must be [nnz, kv_heads, head_dim]")
    return tuple(t.shape)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise FakeFlashInferError(message)


class FakeFlashInferError(RuntimeError):
    """What the double raises where the real library would refuse (or silently misbehave)."""


def install(monkeypatch) -> FakeFlashInfer:
    """Make ``import flashinfer`` return a fresh double and let the backend run on CPU."""
    from radixserve.worker.attention import flashinfer_backend

    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_backend, "DEVICE_TYPES", ("cuda", "cpu"))
    return fake

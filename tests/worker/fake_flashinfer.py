"""A CPU test double of the few flashinfer APIs the flashinfer backend calls.

It mirrors flashinfer-python 0.7.4's signatures for
``BatchPrefillWithPagedKVCacheWrapper``, ``BatchDecodeWithPagedKVCacheWrapper``
and ``append_paged_kv_cache``, refuses what the real library refuses or gets
wrong silently (non-int32 or device-resident plan indices, float16 as an
unstated ``q_data_type`` default, non-half dtypes, last_page_len outside
[1, page_size], K/V with unequal strides, run before plan, shapes that do not
match the plan), and computes the reference math in float32 with FlashInfer's
bottom-right causal mask, ``window_left``, ``sm_scale`` and ``logits_soft_cap``.

It enforces the kernels' limits as the real library meets them, at first use:
head_dims with kernels (append: 64/128/256/512, "Unsupported head_dim";
fa2/fa3 prefill and decode: 64/128/256), the append kernel's block of
``head_dim / max(8, head_dim / 32) * kv_heads`` threads within 1024, the compute
capability (``capability``: bf16 needs sm80, fa3 sm90) and, with
``jit_available = False``, a machine that cannot build a kernel variant it has
not built yet (``built`` lists those built, as FlashInfer's JIT cache would).

CUDA-graph mode (``use_cuda_graph=True``) behaves as FlashInfer's: the wrapper
needs its static buffers, its batch size is fixed by them, ``plan`` writes the
page table into them and ``run`` reads it back from them, so a stale or
mis-sized buffer gives wrong results here too.

Stricter than the real API on purpose: arguments after ``page_size`` in
``plan`` are keyword-only (positions have shifted between releases, e.g.
``head_dim_vo`` was inserted).

FP8 with per-(token, head) scales (``use_token_head_sf=True`` at plan time, 0.7.4):
the plan needs an fp8 ``kv_data_type``, a half ``q_data_type``, head_dim a multiple of
16 and the fa2 kernels (prefill backend ``auto`` or ``fa2``; decode goes to the
tensor-core path); ``run`` needs ``kv_cache_sf`` = ``(k_sf, v_sf)``, float32
``[num_pages, page_size, kv_heads]`` each (strided views allowed), and an fp8 cache of
last dim head_dim, and attends over code * scale.

FP8 with per-tensor scales (0.7.4): ``kv_data_type`` an fp8 dtype with a half
``q_data_type`` on the fa2 kernels (fa3 reads fp8 KV only with fp8 q: refused), the
cache of that fp8 dtype, and ``run(..., k_scale=, v_scale=)`` (floats; None is 1.0):
``sm_scale * k_scale`` on the scores and the output times ``v_scale``, as FlashInfer
folds them. ``append_paged_kv_cache`` refuses K/V whose dtype is not the cache's (the
real kernel reinterprets their bytes silently).

The prefill backend ``auto`` is decided at every ``plan`` as 0.7.4 does: fa3 on sm90
when the longest query row is over ``FA3_MIN_QO_LEN`` (64) tokens and the KV is not
fp8, else fa2; ``_backend`` holds the last plan's choice (what ran), and each choice is
a kernel variant of its own (built at first use).

This proves the backend's wiring (what it plans, appends and runs, with which
indices, dtypes and layouts), not FlashInfer's kernels: those are checked by
``test_flashinfer_gpu.py`` on a CUDA machine.

``install(monkeypatch)`` puts the double in ``sys.modules["flashinfer"]`` and
lets the backend accept CPU pools, with the double's ``capability`` standing in for
the GPU's and kernels buildable; ``FakeFlashInfer.calls`` records every call.
"""

from __future__ import annotations

import sys
import types

import torch

HALF = (torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_UNSET = object()
#: head_dims each kernel family is dispatched for (DISPATCH_HEAD_DIM; the AOT fa2/fa3 set).
APPEND_HEAD_DIMS = (64, 128, 256, 512)
ATTENTION_HEAD_DIMS = (64, 128, 256)
MAX_THREADS = 1024
#: The prefill backend ``auto`` keeps fa2 while the longest query row is at most this.
FA3_MIN_QO_LEN = 64


class FakeFlashInfer(types.ModuleType):
    """The ``flashinfer`` module double: only the names the backend uses."""

    def __init__(self) -> None:
        super().__init__("flashinfer")
        self.__version__ = "0.7.4+cpu-test-double"
        self.calls: list[tuple[str, object]] = []
        self.workspaces: list[torch.Tensor] = []
        self.capability = (9, 0)  # what torch.cuda.get_device_capability would say
        self.jit_available = True  # False: no nvcc and no prebuilt kernels
        self.built: list[tuple] = []  # kernel variants built (or loaded) so far
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
        k_cache, v_cache = _unpack(paged_kv_cache, fp8=paged_kv_cache_dtype(paged_kv_cache) in FP8)
        dev = append_key.device
        for name, t in [("batch_indices", batch_indices), ("positions", positions),
                        ("kv_indices", kv_indices), ("kv_indptr", kv_indptr),
                        ("kv_last_page_len", kv_last_page_len)]:  # fmt: skip
            # The kernel's CHECK_INPUT: on the key's device, contiguous; and int32.
            _check(t.device == dev, f"{name} must be on {dev}, got {t.device}")
            _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
            _check(t.dim() == 1 and t.is_contiguous(), f"{name} must be contiguous 1-D")
        nnz, kv_heads, head_dim = _shape3(append_key, "append_key")
        _check(head_dim in APPEND_HEAD_DIMS, f"Unsupported head_dim: {head_dim}")
        vec = max(16 // append_key.element_size(), head_dim // 32)
        threads = head_dim // vec * kv_heads
        _check(threads <= MAX_THREADS,
               f"CUDA error: invalid configuration argument ({threads} threads per block)")  # fmt: skip
        self.build(("page", append_key.dtype, head_dim))
        _check(append_value.shape == append_key.shape, "append_value shape != append_key shape")
        for t in (append_value, k_cache, v_cache):
            _check(t.device == dev, f"all tensors must be on {dev}")
        _check(append_key.stride(-1) == 1 and append_value.stride(-1) == 1,
               "append_key/append_value need a contiguous last dim")  # fmt: skip
        # The real kernel copies the rows' bytes as the cache's dtype: another dtype is
        # reinterpreted silently (bf16 K into an fp8 cache writes garbage), so refuse it.
        _check(append_key.dtype == append_value.dtype == k_cache.dtype,
               f"append_key/append_value dtype {append_key.dtype} must equal the cache "
               f"dtype {k_cache.dtype}")  # fmt: skip
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

    def build(self, variant: tuple) -> None:
        """A kernel variant's first use: JIT-built (or loaded) once, as FlashInfer does."""
        dtype = next((x for x in variant if isinstance(x, torch.dtype)), None)
        if dtype == torch.bfloat16:
            _check(self.capability >= (8, 0),
                   f"bfloat16 kernels need sm80+, this GPU is sm{self.capability[0]}{self.capability[1]}")  # fmt: skip
        if variant in self.built:
            return
        if not self.jit_available:
            raise RuntimeError(f"Ninja build failed for {variant}: nvcc: command not found")
        self.built.append(variant)


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
        buffers: dict[str, torch.Tensor | None] | None = None,
    ) -> None:
        _check(kv_layout == "NHD", f"kv_layout {kv_layout!r}: the double knows NHD only")
        _check(backend in ("auto", "fa2", "fa3"), f"backend={backend!r}: auto, fa2 or fa3")
        major = self.module.capability[0]
        self.requested_backend = backend
        if backend == "auto" and self.kind == "decode":
            backend = "fa2"
        _check(backend != "fa3" or major == 9, "fa3 needs sm90 (Hopper)")
        #: The backend of the last plan ("auto" before a prefill wrapper's first plan).
        self._backend = backend
        self.graph: dict[str, torch.Tensor] | None = None
        if use_cuda_graph:
            _check(buffers is not None, "the double has a CUDA-graph mode for decode only")
            for name, t in (buffers or {}).items():
                if not torch.is_tensor(t):
                    raise ValueError(f"{name} should be a torch.Tensor in cudagraph mode")
            self.graph = dict(buffers)  # type: ignore[arg-type]
            self.fixed_batch_size = len(self.graph["last"])
            if len(self.graph["indptr"]) != self.fixed_batch_size + 1:
                raise ValueError("The size of paged_kv_indptr_buffer should be batch_size + 1")
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
        use_token_head_sf: bool = False,
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
        fp8 = kv_data_type in FP8
        if use_token_head_sf:
            _check(fp8, f"use_token_head_sf requires fp8 KV dtype, got {kv_data_type}")
            _check(head_dim % 16 == 0, "use_token_head_sf requires head_dim a multiple of 16")
            # As FlashInfer: "auto" becomes fa2 for this plan; another choice is refused.
            _check(self.requested_backend in ("auto", "fa2"),
                   "use_token_head_sf requires backend='fa2'")  # fmt: skip
        elif not fp8:
            _check(kv_data_type == q_data_type, "kv_data_type must be given and equal q_data_type")
        _check(not fp8 or self.requested_backend != "fa3",
               "fa3 reads fp8 KV only with fp8 q (q_data_type is half here)")  # fmt: skip
        _check(num_qo_heads % num_kv_heads == 0, "num_qo_heads must be a multiple of num_kv_heads")
        _check(head_dim in ATTENTION_HEAD_DIMS, f"Unsupported head_dim: {head_dim}")
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
        if self.requested_backend == "auto" and self.kind == "prefill":
            # 0.7.4's choice, made per plan: fa3 on sm90 for long queries over half KV.
            long = int(qo_lens.max()) > FA3_MIN_QO_LEN
            hopper = self.module.capability[0] == 9
            self._backend = "fa3" if hopper and long and not fp8 else "fa2"
        tc = getattr(self, "use_tensor_cores", True)
        self.module.build((self.kind, self._backend, q_data_type, head_dim, window_left >= 0,
                           cap > 0, tc, kv_data_type))  # fmt: skip
        self.module.calls.append((f"plan_{self.kind}", batch))
        if self.graph is not None:
            if batch != self.fixed_batch_size:
                raise ValueError(
                    f"The batch size should be fixed in cudagraph mode, the runtime batch size "
                    f"{batch} mismatches the batch size set during initialization "
                    f"{self.fixed_batch_size}"
                )
            if len(indices) > len(self.graph["indices"]):
                raise ValueError(
                    "The size of indices should be less than or equal to the allocated buffer"
                )
            # As FlashInfer: the page table goes into the static buffers, which run reads.
            self.graph["indptr"].copy_(indptr)
            self.graph["last"].copy_(last_page_len)
            self.graph["indices"][: len(indices)].copy_(indices)
        # The real plan copies the indices to the device: later host edits do not leak in.
        self.plan_args = dict(
            qo_indptr=qo_indptr.clone(), indptr=indptr.clone(), indices=indices.clone(),
            kv_lens=kv_lens, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, causal=causal, window_left=window_left,
            sm_scale=head_dim**-0.5 if sm_scale is None else sm_scale, dtype=q_data_type,
            logits_soft_cap=cap, kv_dtype=kv_data_type, token_head=use_token_head_sf,
        )  # fmt: skip

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        return_lse: bool = False,
        kv_cache_sf: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        p = self.plan_args
        _check(p is not None, "run() before plan()")
        _check(not return_lse, "the double does not return the lse")
        fp8 = p["kv_dtype"] in FP8
        k_cache, v_cache = _unpack(paged_kv_cache, fp8=fp8)
        _check(k_cache.dtype == p["kv_dtype"],
               f"cache dtype {k_cache.dtype} != planned kv_data_type {p['kv_dtype']}")  # fmt: skip
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check(
                x is None or isinstance(x, float),
                f"{name}: a float (the double's tensor scales: none)",
            )
        _check(not (p["token_head"] and (k_scale or v_scale)),
               "the double does not combine k_scale/v_scale with token-head scale factors")  # fmt: skip
        if p["token_head"]:
            _check(isinstance(kv_cache_sf, (tuple, list)) and len(kv_cache_sf) == 2,
                   "use_token_head_sf requires kv_cache_sf = (k_sf, v_sf)")  # fmt: skip
            want = (k_cache.shape[0], p["page_size"], p["num_kv_heads"])
            for name, sf in zip(("k_sf", "v_sf"), kv_cache_sf):
                _check(sf.dtype == torch.float32, f"{name} must be float32, got {sf.dtype}")
                _check(tuple(sf.shape) == want, f"{name} must have shape {want}")
            # What the kernel reads: code * the row's scale.
            k_cache = k_cache.float() * kv_cache_sf[0].unsqueeze(-1)
            v_cache = v_cache.float() * kv_cache_sf[1].unsqueeze(-1)
        else:
            _check(kv_cache_sf is None, "kv_cache_sf without use_token_head_sf (NVFP4 only)")
        if self.graph is not None:  # what a captured kernel sees: the buffers' contents now
            g = self.graph
            p = {**p, "indptr": g["indptr"].clone(), "indices": g["indices"].clone(),
                 "kv_lens": (g["indptr"].diff().long() - 1) * p["page_size"] + g["last"].long()}  # fmt: skip
        nnz = int(p["qo_indptr"][-1])
        _check(q.shape == (nnz, p["num_qo_heads"], p["head_dim"]),
               f"q shape {tuple(q.shape)} != planned {(nnz, p['num_qo_heads'], p['head_dim'])}")  # fmt: skip
        _check(q.stride(-1) == 1, "q needs a contiguous last dim")
        _check(q.dtype == p["dtype"], f"q dtype {q.dtype} != planned q_data_type {p['dtype']}")
        _check(k_cache.shape[1:] == (p["page_size"], p["num_kv_heads"], p["head_dim"]),
               "cache shape does not match the planned page_size/num_kv_heads/head_dim")  # fmt: skip
        _check(q.device == k_cache.device == self.workspace.device,
               "q, cache and workspace must share a device")  # fmt: skip
        _check(bool((p["indices"] < k_cache.shape[0]).all()), "page index beyond the cache")
        if out is not None:
            _check(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
                   "out must match q's shape, dtype and device")  # fmt: skip
            _check(out.is_contiguous(), "out must be contiguous")
        self.module.calls.append((f"run_{self.kind}", nnz))
        if k_scale is not None:  # as FlashInfer: folded into sm_scale
            p = {**p, "sm_scale": p["sm_scale"] * k_scale}
        result = _reference(q, k_cache, v_cache, p)
        if v_scale is not None and v_scale != 1.0:  # as FlashInfer: the output times v_scale
            result = (result.float() * v_scale).to(q.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out


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
        non_blocking: bool = True,
        use_token_head_sf: bool = False,
    ) -> None:
        _check(pos_encoding_mode == "NONE", "rotary is applied outside attention")
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
                   num_qo_heads, num_kv_heads, head_dim_qk, page_size, causal, sm_scale,
                   window_left, logits_soft_cap, q_data_type, kv_data_type,
                   use_token_head_sf)  # fmt: skip


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
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        *,
        backend: str = "auto",
    ) -> None:
        buffers = {"indptr": paged_kv_indptr_buffer, "indices": paged_kv_indices_buffer,
                   "last": paged_kv_last_page_len_buffer}  # fmt: skip
        for key, t in buffers.items():
            if use_cuda_graph and not torch.is_tensor(t):
                name = {"indptr": "indptr", "indices": "indices", "last": "last_page_len"}[key]
                raise ValueError(
                    f"paged_kv_{name}_buffer should be a torch.Tensor in cudagraph mode"
                )
        self.use_tensor_cores = use_tensor_cores
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend=backend,
                         buffers=buffers)  # fmt: skip

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
        non_blocking: bool = True,
        use_token_head_sf: bool = False,
    ) -> None:
        _check(pos_encoding_mode == "NONE", "rotary is applied outside attention")
        group = num_qo_heads // max(num_kv_heads, 1)
        if use_token_head_sf:  # as FlashInfer: the tensor-core (fa2 prefill) path
            self.use_tensor_cores = True
        _check(self.use_tensor_cores or group in self.CUDA_CORE_GROUPS,
               f"Unsupported group_size: {group} (CUDA-core decode; use tensor cores)")  # fmt: skip
        self._plan(None, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, False, sm_scale, window_left, logits_soft_cap, q_data_type,
                   kv_data_type, use_token_head_sf)  # fmt: skip


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


def _unpack(cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], fp8: bool = False):
    if isinstance(cache, tuple):
        k, v = cache
    else:
        _check(cache.dim() == 5 and cache.shape[1] == 2,
               "a single-tensor NHD cache is [num_pages, 2, page_size, kv_heads, head_dim]")  # fmt: skip
        k, v = cache.unbind(1)
    _check(k.dim() == 4 and k.shape == v.shape, "K and V caches: equal 4-D shapes")
    _check(k.stride() == v.stride(), "K and V caches must have equal strides (fa2)")
    _check(k.stride(-1) == 1, "cache needs a contiguous last dim")
    if fp8:
        _check(k.dtype in FP8, f"cache dtype {k.dtype}: fp8 with use_token_head_sf")
    else:
        _check(k.dtype in HALF, f"cache dtype {k.dtype}: half precision only")
    return k, v


def paged_kv_cache_dtype(cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.dtype:
    return (cache[0] if isinstance(cache, tuple) else cache).dtype


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
    from radixserve.worker.attention import flashinfer_support

    fake = FakeFlashInfer()
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_support, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(flashinfer_support, "device_capability", lambda device: fake.capability)
    monkeypatch.setattr(flashinfer_support, "has_jit_cache", lambda: fake.jit_available)
    return fake

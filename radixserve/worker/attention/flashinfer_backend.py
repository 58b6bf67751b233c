"""The ``flashinfer`` attention backend: FlashInfer's paged kernels on CUDA.

Written against flashinfer-python 0.7.4 (``BatchPrefillWithPagedKVCacheWrapper``,
``BatchDecodeWithPagedKVCacheWrapper``, ``append_paged_kv_cache``). FlashInfer is
imported only when this backend is built, so nothing on the CPU path needs it.
Whether it can run a model at all is decided in ``flashinfer_support.py`` (static
rules) and ``flashinfer_probe.py`` (one run of every mode); this module only runs.

Per step (``begin_batch``) the wrappers are planned once from int32 host index
tensors; per layer (``forward``) the new K/V are appended into the pool with
``append_paged_kv_cache`` and the planned wrapper runs over that layer's pages.

- A step where every request has one new token runs the decode wrapper (its
  CUDA-core kernel for GQA groups of 1-3, else its tensor-core path). Any
  other step (fresh prefill, prefill after a cached prefix, a chunk, or a mix
  with decode rows) runs the prefill wrapper over all rows: its causal mask is
  aligned bottom-right, so a one-token row is a correct decode row, and one
  kernel over the whole batch beats splitting rows into two launches plus a
  gather and a scatter of q and the output in every layer.
- No host sync per step: plan inputs are packed into pinned host buffers that each
  wrapper owns and reuses (plan() copies them to the device without blocking), and
  the append inputs go to the device in one non-blocking copy; an event per buffer
  keeps a buffer from being rewritten before its last copy ran (``staging.py``).
- Outputs are written into a buffer the backend keeps (``run(out=...)``), grown when
  a step needs more rows: the tensor ``forward`` returns is valid until the next
  ``forward`` (the model's output projection reads it right away).
- An fp8 pool (``--kv-cache-dtype fp8_e4m3|fp8_e5m2``) is the per-tensor layout
  (``kv_quant.TENSOR_QUANTS``: plain fp8 pages, scale 1.0): the plans name the fp8
  dtype as ``kv_data_type`` (q stays the model's dtype), K/V are clamped and cast to
  fp8 before ``append_paged_kv_cache`` (which copies rows of the cache's own dtype),
  and every ``run`` (CUDA-graph wrappers too) gets ``k_scale`` / ``v_scale``.
- An fp8 pool of the ``token_head`` layout (``kv_quant.TOKEN_HEAD_QUANTS``: 16-byte
  rows of fp8 codes and a float32 scale per token and kv head) is read with
  FlashInfer's per-(token, head) scale factors: the plans pass
  ``use_token_head_sf=True`` (FlashInfer then runs its fa2 kernels, decode on the
  tensor-core path), every ``run`` gets the codes and the K / V scales as strided
  views of the pool layer (``kv_quant.token_head_views``: ``paged_kv_cache`` fp8
  ``[pages, 2, page_size, kv_heads, head_dim]``, ``kv_cache_sf`` float32
  ``[pages, page_size, kv_heads]`` each). New rows are quantized here
  (``kv_quant.quantize``: codes, scale and padding) and written into their slots with
  ``index_copy_``, not ``append_paged_kv_cache`` (which copies no scales); the slots
  are computed on the device from the append inputs, so a CUDA graph recomputes them.
- A quantized pool stores its keys rotated (``rotation.py``): ``forward`` rotates q
  and k before the writes and the kernels, which read the pool as they would any;
  ``token_head`` key rows take the searched scale (``kv_quant.quantize``), still one
  scale per row; an fp8 pool's keys lose the layer's key shift first (``key_shift.py``,
  in ``rotate``), which the kernels need not know of.
- int8 and the per-row layout are refused (``flashinfer_support.kv_pool_reason``).
- The prefill wrapper's backend is FlashInfer's ``auto`` by default, which 0.7.4
  decides at every ``plan``: fa2 while the longest query row is at most 64 tokens, fa3
  on Hopper (sm90) above that. The start-up probe runs a prefill longer than that, so
  both are built and checked before serving, never JIT-built inside a step. An fp8 pool
  is read by the fa2 kernels only (fa3 reads fp8 KV only with fp8 queries): ``auto`` is
  pinned to fa2 for it and ``fa3`` refused. ``wrapper_backends()`` says what each
  wrapper's plans resolved to. Decode kernels are fa2.
- One event per wrapper: FlashInfer keeps a wrapper's plan in buffers its next
  ``plan()`` rewrites (a pinned host copy sent to its int workspace without blocking),
  so each wrapper records an event once the step that ran its plan is queued and the
  next ``plan()`` of that wrapper waits on it (in steady state it has long fired).
- CUDA graphs (``setup_graphs``): one decode wrapper per capture size and window in
  FlashInfer's CUDA-graph mode, over static device buffers (page table, last page
  lengths, positions, output) sliced from shared ones. ``begin_graph_batch`` plans
  a decode batch padded to a capture size: each pad row reads and writes one page
  no request owns (``pad_page``), at position 0, so the captured kernels see the
  shape they were captured with.
- The pool layer ``[num_pages, 2, page_size, kv_heads, head_dim]`` is FlashInfer's
  single-tensor ``NHD`` paged layout; its K and V halves have equal strides, which
  fa2 requires.
- Sliding windows: one planned wrapper per distinct window among the layers
  (``window_left`` is fixed at plan time). Our window w (keys in (p - w, p])
  is FlashInfer's ``window_left = w - 1`` (keys in [p - window_left, p]).
- Scale and soft-cap: ``sm_scale`` and ``logits_soft_cap`` (0 = none) are plan-time
  arguments of both wrappers, the same for every layer.
- All wrappers share one float workspace, allocated once: runs are sequential
  on one stream, and each wrapper keeps its plan in its own int workspace.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixserve.worker.attention import flashinfer_support as support
from radixserve.worker.attention.base import AttentionBatch, PoolBackend
from radixserve.worker.kv_pool import KVPool
from radixserve.worker.kv_quant import quantize, token_head_views, top_codes
from radixserve.worker.staging import Staging, default_event_factory

#: Bytes of the float workspace shared by all wrappers (FlashInfer recommends 128 MB).
WORKSPACE_BYTES = 128 << 20
#: GQA group sizes (query heads per KV head) FlashInfer's CUDA-core decode kernel is built
#: for. Larger groups also run faster on the tensor-core path (the fa2 prefill kernel, one
#: query row per request), so only these few small groups use the CUDA-core kernel.
CUDA_CORE_GROUPS = (1, 2, 3)
KV_LAYOUT = "NHD"
#: The per-tensor fp8 pool's scales (kv_quant.TENSOR_QUANTS: codes are the values, 1.0):
#: run() folds k_scale into sm_scale and multiplies the output by v_scale.
K_SCALE = V_SCALE = 1.0
#: FlashInfer's choice for prefill, per plan: fa3 on sm90 for queries over 64 tokens, else fa2.
PREFILL_BACKEND = "auto"
DECODE_BACKEND = "fa2"
#: The prefill backends FlashInfer's fp8 KV reads with half queries (fa3 wants fp8 q).
FP8_PREFILL_BACKENDS = ("auto", "fa2")


def prefill_backend_for(requested: str, fp8_pool: bool) -> tuple[str, str]:
    """The prefill backend to give FlashInfer and why: ``requested``, except that an fp8
    pool pins ``auto`` to fa2 and refuses fa3 (ValueError)."""
    if not fp8_pool:
        return requested, f"{requested} (as configured)"
    if requested not in FP8_PREFILL_BACKENDS:
        raise ValueError(
            f"attention backend 'flashinfer' cannot run: its fp8 KV cache is read by the fa2 "
            f"kernels only (fa3 reads fp8 KV only with fp8 queries), not prefill backend "
            f"{requested!r}; use --flashinfer-prefill-backend fa2 (or auto)"
        )
    return "fa2", f"fa2 ({requested}: an fp8 KV cache is read by the fa2 kernels only)"


class _PlanEvent:
    """When a wrapper's plan may be overwritten: an event recorded once the step that ran
    it is queued (``used``), waited on before the wrapper's next ``plan()`` (``wait``).
    A no-op without events (CPU); ``waits`` counts the waits, for tests."""

    def __init__(self, make_event: Any) -> None:
        self._make_event = make_event
        self._event: Any = None
        self.waits = 0

    def used(self) -> None:
        if self._make_event is not None:
            self._event = self._make_event()
            self._event.record()

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self.waits += 1
            self._event = None


class _HostPlan:
    """The int32 host tensors one wrapper is planned from, in a pinned buffer it owns."""

    def __init__(self, device: torch.device, event_factory: Any = None) -> None:
        self.staging = Staging(device, torch.int32, event_factory=event_factory)

    def tensors(self, *parts: np.ndarray) -> list[torch.Tensor]:
        return self.staging.host(parts)


class FlashInferAttention(PoolBackend):
    name = "flashinfer"
    captures_graphs = True

    def __init__(
        self,
        pool: KVPool,
        scale: float,
        sliding_windows: tuple[int, ...],
        num_qo_heads: int,
        softcap: float = 0.0,
        *,
        prefill_backend: str = PREFILL_BACKEND,
        event_factory: Any = None,
    ) -> None:
        super().__init__(pool, scale, sliding_windows, num_qo_heads, softcap)
        device = pool.layers[0].device if pool.layers else torch.device("cpu")
        reason = support.unsupported_reason(device, pool.dtype, pool.head_dim, pool.num_kv_heads)
        if reason is not None:
            raise ValueError(
                f"attention backend 'flashinfer' cannot run: {reason}; "
                "use attention_backend 'torch' (--attention-backend torch)"
            )
        reason = support.kv_pool_reason(pool)  # int8 / per-row fp8 / another float dtype
        if reason is not None:
            raise ValueError(
                f"attention backend 'flashinfer' cannot run: {reason}; "
                "use attention_backend 'torch' (--attention-backend torch)"
            )
        #: The per-tensor fp8 pool: K/V cast (clamped) to fp8 before the append, the
        #: plans' kv_data_type the fp8 dtype, every run() given the tensor scales.
        self._fp8 = pool.quant if pool.quant is not None and pool.quant.per_tensor else None
        self._run_scales: dict[str, float] = (
            {"k_scale": K_SCALE, "v_scale": V_SCALE} if self._fp8 is not None else {}
        )
        #: The token_head fp8 pool: per layer the codes and the (K, V) scale views
        #: FlashInfer reads, and this step's slot rows (computed once per step).
        self._th = pool.quant if pool.kv_layout == "token_head" else None
        self._th_views = (
            [token_head_views(layer, self._th, pool.head_dim) for layer in pool.layers]
            if self._th is not None
            else []
        )
        self._th_rows: torch.Tensor | None = None
        prefill_backend, self.prefill_backend_reason = prefill_backend_for(
            prefill_backend, pool.quant is not None
        )
        if self._th is not None and pool.layers:
            # The searched key scale's codes, on the device before any graph is captured.
            top_codes(self._th, pool.layers[0].device)
        fi = support.import_flashinfer()
        self._fi = fi
        self._device = device
        self._events = event_factory
        self._make_event = event_factory or default_event_factory(device)
        #: Per wrapper (by key): its plan's event, and the backends its plans resolved to.
        self._plan_events: dict[tuple, _PlanEvent] = {}
        self._resolved: dict[tuple, set[str]] = {}
        self._used: list[tuple] = []  # the keys of the wrappers the current step runs
        # FlashInfer asks for a zeroed workspace on first use (its split-KV merge state).
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._windows = sorted(set(sliding_windows))
        self.prefill_backend = prefill_backend
        self._prefill = {
            w: fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, kv_layout=KV_LAYOUT, backend=prefill_backend
            )
            for w in self._windows
        }
        self._tensor_cores = num_qo_heads // pool.num_kv_heads not in CUDA_CORE_GROUPS
        self._decode = {w: self._decode_wrapper() for w in self._windows}
        self._host_plans = {
            (kind, w): _HostPlan(device, event_factory)
            for kind in ("prefill", "decode")
            for w in self._windows
        }
        self._append_staging = Staging(device, torch.int32, event_factory=event_factory)
        self._out = torch.empty(0, num_qo_heads, pool.head_dim, dtype=pool.dtype, device=device)
        self._active: dict[int, Any] | None = None  # window -> planned wrapper
        self._append_args: tuple[torch.Tensor, ...] = ()
        self._out_rows: torch.Tensor | None = None  # where this step's outputs go
        self.graph_sizes: tuple[int, ...] = ()

    def _decode_wrapper(self, graph_buffers: dict[str, torch.Tensor] | None = None) -> Any:
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            kv_layout=KV_LAYOUT,
            use_cuda_graph=graph_buffers is not None,
            use_tensor_cores=self._tensor_cores,
            **(graph_buffers or {}),
            backend=DECODE_BACKEND,
        )

    # ------------------------------------------------------------------ eager steps

    def begin_batch(self, batch: AttentionBatch) -> None:
        qo_lens, kv_lens, last = _check_batch(batch, self.pool.page_size)
        decode = bool(np.all(qo_lens == 1))
        kind = "decode" if decode else "prefill"
        self._step_queued()
        for w in self._windows:
            host = self._host_plans[(kind, w)]
            qo, indptr, indices, lastt = host.tensors(
                batch.qo_indptr, batch.page_indptr, batch.page_indices, last
            )
            wrapper = (self._decode if decode else self._prefill)[w]
            self._before_plan((kind, w))
            if decode:
                self._plan_decode(wrapper, w, indptr, indices, lastt)
            else:
                self._plan_prefill(wrapper, w, qo, indptr, indices, lastt)
            self._after_plan((kind, w), wrapper)
            host.staging.record()  # plan() has queued its copies from these buffers
        self._active = dict(self._decode if decode else self._prefill)
        self._append_args = self._plan_append(batch, qo_lens, kv_lens, last)
        self._th_rows = None
        self._out_rows = self._output(batch.num_tokens)

    def _step_queued(self) -> None:
        """The last step's kernels are queued: each wrapper it ran records its event."""
        for key in self._used:
            self._plan_events[key].used()
        self._used = []

    def _before_plan(self, key: tuple) -> None:
        """Wait until the last step that ran this wrapper's plan is done with it."""
        self._plan_events.setdefault(key, _PlanEvent(self._make_event)).wait()

    def _after_plan(self, key: tuple, wrapper: Any) -> None:
        self._used.append(key)
        # FlashInfer keeps the backend it resolved ("auto": per plan) in ``_backend``.
        resolved = getattr(wrapper, "_backend", None) or "?"
        self._resolved.setdefault(key, set()).add(resolved)

    def plan_waits(self) -> int:
        """Waits on wrappers' plan events so far (0 on CPU without an event factory)."""
        return sum(e.waits for e in self._plan_events.values())

    def wrapper_backends(self) -> str:
        """What each wrapper's plans ran on so far, for the start-up log, e.g.
        ``prefill (window -1): auto -> fa2, fa3; decode (window -1): fa2``."""
        parts = []
        for key, backends in sorted(self._resolved.items(), key=str):
            kind, w = key[0], key[-1]
            size = f", graph batch {key[1]}" if kind == "graph" else ""
            asked = self.prefill_backend if kind == "prefill" else DECODE_BACKEND
            got = ", ".join(sorted(backends))
            parts.append(
                f"{kind} (window {w}{size}): " + (f"{asked} -> {got}" if asked != got else got)
            )
        return "; ".join(parts)

    def _common(self, w: int) -> dict[str, Any]:
        common = {
            "sm_scale": self.scale,
            "logits_soft_cap": self.softcap,
            "window_left": w - 1 if w > 0 else -1,
            "q_data_type": self.pool.dtype,
            "kv_data_type": self.pool.storage_dtype,  # the fp8 dtype for an fp8 pool
        }
        if self._th is not None:  # uint8 rows: the codes are the fp8 dtype
            common["kv_data_type"] = self._th.code_dtype
            common["use_token_head_sf"] = True
        return common

    def _plan_decode(self, wrapper, w, indptr, indices, last) -> None:
        heads = (self.num_qo_heads, self.pool.num_kv_heads)
        wrapper.plan(
            indptr, indices, last, *heads, self.pool.head_dim, self.pool.page_size,
            pos_encoding_mode="NONE", non_blocking=True, **self._common(w),
        )  # fmt: skip

    def _plan_prefill(self, wrapper, w, qo, indptr, indices, last) -> None:
        heads = (self.num_qo_heads, self.pool.num_kv_heads)
        wrapper.plan(
            qo, indptr, indices, last, *heads, self.pool.head_dim, self.pool.page_size,
            causal=True, non_blocking=True, **self._common(w),
        )  # fmt: skip

    def _plan_append(
        self, batch: AttentionBatch, qo_lens: np.ndarray, kv_lens: np.ndarray, last: np.ndarray
    ) -> tuple[torch.Tensor, ...]:
        """Device int32 inputs of append_paged_kv_cache, sent in one non-blocking copy."""
        n, b = batch.num_tokens, batch.batch_size
        starts = np.repeat(batch.qo_indptr[:-1].astype(np.int64), qo_lens)
        batch_indices = np.repeat(np.arange(b), qo_lens)
        # Position of each new token in its request: kv_len - qo_len, ..., kv_len - 1.
        positions = np.arange(n) - starts + np.repeat(kv_lens - qo_lens, qo_lens)
        parts = [batch_indices, positions, batch.page_indices, batch.page_indptr, last]
        return tuple(self._append_staging.to_device(parts))

    def _output(self, rows: int) -> torch.Tensor:
        if self._out.shape[0] < rows:
            self._out = torch.empty(
                max(rows, 2 * self._out.shape[0]), *self._out.shape[1:],
                dtype=self._out.dtype, device=self._out.device,
            )  # fmt: skip
        return self._out[:rows]

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self._active is None or self._out_rows is None:
            raise RuntimeError("begin_batch must be called before forward")
        if self.rotation is not None:  # rotated keys (rotation.py): outside the kernels
            q, k = self.rotation.rotate(q, k, layer)
        cache = self.pool.layers[layer]
        batch_indices, positions, kv_indices, kv_indptr, last = self._append_args
        if self._th is not None:
            return self._forward_token_head(layer, q, k, v)
        if self._fp8 is not None:
            # append_paged_kv_cache copies rows of the cache's dtype: cast (clamped) first.
            k, v = quantize(k, self._fp8), quantize(v, self._fp8)
        # The kernel reinterprets K/V of another dtype as the cache's, silently.
        assert k.dtype == v.dtype == cache.dtype, (k.dtype, v.dtype, cache.dtype)
        self._fi.append_paged_kv_cache(
            k, v, batch_indices, positions, cache, kv_indices, kv_indptr, last,
            kv_layout=KV_LAYOUT,
        )  # fmt: skip
        out = self._out_rows[: q.shape[0]]
        return self._active[self.sliding_windows[layer]].run(q, cache, out=out, **self._run_scales)

    def _slot_rows(self) -> torch.Tensor:
        """This step's new tokens' K rows in a pool layer viewed as ``[pages * 2 *
        page_size, kv_heads * entry_dim]`` (V rows are page_size further), from the
        append inputs on the device: page ``kv_indices[kv_indptr[b] + pos // page_size]``,
        slot ``pos % page_size``. Device ops only, so a captured graph recomputes them."""
        if self._th_rows is None:
            batch_indices, positions, kv_indices, kv_indptr, _ = self._append_args
            s = self.pool.page_size
            pos = positions.long()
            pages = kv_indices.long()[kv_indptr.long()[batch_indices.long()] + pos // s]
            self._th_rows = pages * (2 * s) + pos % s
        return self._th_rows

    def _forward_token_head(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        assert self._th is not None
        s, h, e = self.pool.page_size, self.pool.num_kv_heads, self.pool.entry_dim
        tokens = self.pool.layers[layer].view(-1, h * e)
        rows = self._slot_rows()
        keys = quantize(k, self._th, search_scale=self.rotation is not None)
        tokens.index_copy_(0, rows, keys.reshape(-1, h * e))
        tokens.index_copy_(0, rows + s, quantize(v, self._th).reshape(-1, h * e))
        codes, scales = self._th_views[layer]
        out = self._out_rows[: q.shape[0]]  # type: ignore[index]
        return self._active[self.sliding_windows[layer]].run(  # type: ignore[index]
            q, codes, out=out, kv_cache_sf=scales
        )

    # ------------------------------------------------------------------ CUDA graphs

    def setup_graphs(self, sizes: tuple[int, ...], max_pages_per_slot: int, pad_page: int) -> None:
        """Build the CUDA-graph decode wrappers for batch sizes ``sizes``.

        A request reads at most ``max_pages_per_slot`` pages; ``pad_page`` is a pool
        page no request is ever given (the runner keeps one back), read and written by
        the rows that pad a batch up to a capture size.
        """
        if not sizes or max(sizes) < 1 or max_pages_per_slot < 1:
            raise ValueError("graph sizes and max_pages_per_slot must be positive")
        if not 0 <= pad_page < self.pool.num_pages:
            raise ValueError(f"pad page {pad_page} outside the pool")
        self.graph_sizes = tuple(sorted(set(sizes)))
        self.pad_page = pad_page
        n, dev = max(self.graph_sizes), self._device
        i32 = {"dtype": torch.int32, "device": dev}
        # Static device buffers shared by every size (one size runs at a time); FlashInfer's
        # graph-mode plan() writes the page table into them, append and run read them.
        self._g_indptr = torch.zeros(n + 1, **i32)
        self._g_indices = torch.zeros(n * max_pages_per_slot, **i32)
        self._g_last = torch.ones(n, **i32)
        self._g_batch = torch.arange(n, **i32)  # decode: request i's token is row i
        self._g_positions = torch.zeros(n, **i32)
        self._g_out = torch.empty(n, self.num_qo_heads, self.pool.head_dim,
                                  dtype=self.pool.dtype, device=dev)  # fmt: skip
        self._g_wrappers = {
            bs: {
                w: self._decode_wrapper(
                    {
                        "paged_kv_indptr_buffer": self._g_indptr[: bs + 1],
                        "paged_kv_indices_buffer": self._g_indices,
                        "paged_kv_last_page_len_buffer": self._g_last[:bs],
                    }
                )  # fmt: skip
                for w in self._windows
            }
            for bs in self.graph_sizes
        }
        self._g_host = {(bs, w): _HostPlan(dev, self._events) for bs in self.graph_sizes
                        for w in self._windows}  # fmt: skip
        self._g_pos_staging = Staging(dev, torch.int32, event_factory=self._events)
        self._g_indices_staging = Staging(dev, torch.int32, event_factory=self._events)

    def graph_size_for(self, batch_size: int) -> int | None:
        """The capture size a decode batch of ``batch_size`` pads to (None: too big)."""
        for size in self.graph_sizes:
            if size >= batch_size:
                return size
        return None

    def begin_graph_batch(self, batch: AttentionBatch, size: int) -> None:
        """Plan a decode-only ``batch`` on the size-``size`` graph wrappers, padded."""
        if size not in self.graph_sizes:
            raise ValueError(f"no CUDA-graph wrappers for batch size {size}")
        qo_lens, kv_lens, last = _check_batch(batch, self.pool.page_size)
        pad = size - batch.batch_size
        if pad < 0 or np.any(qo_lens != 1):
            raise ValueError(f"a graph batch is {size} or fewer decode rows, got {qo_lens}")
        indptr = np.concatenate([batch.page_indptr, batch.page_indptr[-1] + np.arange(1, pad + 1)])
        indices = np.concatenate([batch.page_indices, np.full(pad, self.pad_page)])
        if len(indices) > self._g_indices.numel():
            raise ValueError("the batch reads more pages than the graph buffers hold")
        last = np.concatenate([last, np.ones(pad, dtype=last.dtype)])
        # Graph-mode plan() copies a host page table into its static buffer with a blocking
        # copy (it copies without blocking only from the device): send it there first.
        (indices_dev,) = self._g_indices_staging.to_device([indices])
        self._step_queued()
        for w in self._windows:
            host = self._g_host[(size, w)]
            indptr_t, last_t = host.tensors(indptr, last)
            self._before_plan(("graph", size, w))
            self._plan_decode(self._g_wrappers[size][w], w, indptr_t, indices_dev, last_t)
            self._after_plan(("graph", size, w), self._g_wrappers[size][w])
            host.staging.record()
        # The append kernel reads positions from a static buffer: kv_len - 1 per row, pad rows 0.
        positions = np.concatenate([kv_lens - 1, np.zeros(pad, dtype=kv_lens.dtype)])
        (host_pos,) = self._g_pos_staging.host([positions])
        self._g_positions[:size].copy_(host_pos, non_blocking=True)
        self._g_pos_staging.record()
        self._active = self._g_wrappers[size]
        self._th_rows = None  # recomputed from the static buffers in the captured forward
        self._append_args = (
            self._g_batch[:size], self._g_positions[:size], self._g_indices,
            self._g_indptr[: size + 1], self._g_last[:size],
        )  # fmt: skip
        self._out_rows = self._g_out[:size]


def _check_batch(batch: AttentionBatch, page_size: int) -> tuple[np.ndarray, ...]:
    """qo_lens, kv_lens and last page lengths of a valid batch (ValueError otherwise)."""
    qo_lens = batch.qo_lens.astype(np.int64)
    kv_lens = batch.kv_lens.astype(np.int64)
    page_counts = np.diff(batch.page_indptr).astype(np.int64)
    if np.any(page_counts != -(-kv_lens // page_size)):
        raise ValueError("each request needs exactly ceil(kv_len / page_size) pages")
    if np.any(qo_lens < 1) or np.any(qo_lens > kv_lens):
        raise ValueError("each request needs 1 <= qo_len <= kv_len")
    last_page_len = kv_lens - (page_counts - 1) * page_size  # in [1, page_size]
    return qo_lens, kv_lens, last_page_len

"""The sliding layers' window pool: whether a model gets one, its size, its backend.

A model whose layers mix full and sliding attention keeps the sliding layers' K/V
in a pool of window pages of its own (docs/models.md, "Sliding windows and the
cache"): the main pool (``ModelRunner.pool``) holds the full layers', the window
pool (``ModelRunner.window_pool``, one more page: the dummy page) the sliding ones',
and each slot has a window page table (``page_table.WindowTable``). This module
decides and sizes it for the worker's builder (``build.build_kv_space``);
``attention/split.py`` runs attention over both pools.
"""

from __future__ import annotations

import math

import torch

from radixserve.layers.parallel import Comm
from radixserve.models.config import ModelConfig
from radixserve.worker.attention import create_backend
from radixserve.worker.attention.split import SplitAttention
from radixserve.worker.config import WorkerConfig
from radixserve.worker.kv_pool import SLIDING_POOL_RATIO, KVPool, min_window_pages, split_pages


def unsupported_reason(config: WorkerConfig, cfg: ModelConfig, comm: Comm) -> str | None:
    """Why the sliding layers share the one pool (None: they get a window pool)."""
    windows = cfg.kv_sliding_windows
    if not any(w > 0 for w in windows):
        return "no sliding layer"
    if config.sliding_pool_pages == 0:
        return "sliding_pool_pages 0"
    if torch.device(config.device).type != "cpu":
        return (
            "the window pool runs on the CPU (torch backend) for now: FlashInfer's plans "
            "and the decode graphs take one page table"
        )
    if config.attention_backend == "flashinfer":
        return "the flashinfer backend takes one page table"
    if comm.size > 1:
        return "not with tensor parallelism yet"
    if config.host_cache_gb:
        return "cache tiers copy pages of one pool"
    if cfg.hybrid:
        return "hybrid models keep recurrent states, not sliding windows"
    return None


def pool_sizes(
    config: WorkerConfig, dims: tuple, window_dims: tuple, span: int, budget: int
) -> tuple[int, int]:
    """``(main pool pages, window pool pages)``: ``KVPool.bytes_per_page`` arguments
    ``dims`` (the full layers) and ``window_dims`` (the sliding ones), W = ``span``.
    ValueError for a window pool below its floor (``min_window_pages``)."""
    floor = min_window_pages(
        span, config.page_size, config.max_running_requests, config.chunked_prefill_size
    )
    given = config.sliding_pool_pages
    if given is not None and given < floor:
        raise ValueError(
            f"sliding_pool_pages {given} is below the {floor} window pages "
            f"{config.max_running_requests} running requests' windows of {span} tokens and "
            "a prefill chunk need (or 0: one pool)"
        )
    if config.num_pages is not None:
        return config.num_pages, given or max(
            math.ceil(config.num_pages * SLIDING_POOL_RATIO), floor
        )
    full, window = KVPool.bytes_per_page(*dims), KVPool.bytes_per_page(*window_dims)
    return split_pages(budget, full, window, floor, given)


def page_bytes(pool: KVPool) -> int:
    """One page of ``pool``, every layer of it."""
    return KVPool.bytes_per_page(
        pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, pool.dtype,
        pool.kv_dtype, pool.kv_layout,
    )  # fmt: skip


def split_backend(
    config: WorkerConfig,
    cfg: ModelConfig,
    q_heads: int,
    pool: KVPool,
    window_pool: KVPool,
    window_layers: tuple[int, ...],
) -> SplitAttention:
    """One attention backend per pool (none for a main pool without layers), each
    told its layers' windows, behind a ``SplitAttention``."""
    options = {"prefill_backend": config.flashinfer_prefill_backend}
    windows = cfg.kv_sliding_windows

    def make(p: KVPool, ws: tuple[int, ...]):
        return create_backend(
            config.attention_backend, p, cfg.attention_scale, ws, q_heads,
            config.decode_kernel, cfg.attn_softcap, options, config.deterministic,
        )  # fmt: skip

    full = None
    if pool.num_layers:
        full = make(pool, tuple(w for i, w in enumerate(windows) if i not in window_layers))
    window = make(window_pool, tuple(windows[i] for i in window_layers))
    return SplitAttention(full, window, window_layers, len(windows))

"""The worker built by composition: its parts from a ``WorkerConfig``, then the runner.

``build_runner(config, tokenizer, comm)`` (``compose.build_worker`` and
``tp.WorkerGroup`` call it) builds, in this order:

1. the process's settings: glibc's malloc policy (``malloc.py``), bounds on oneDNN's
   caches of compiled products (``primitive_cache.py``), the torch threads;
2. the model (``LoadedModel``), in the dtype ``dtype.py`` resolves;
3. the decode graphs' plan (``cuda_graph.GraphPlan``: when graphs may be captured,
   the pool keeps a pad page);
4. the KV space (``KVSpace``): the pool, the sliding layers' window pool where the
   model gets one (``window_pool.py``), the slots' page tables; an fp8 pool's key
   shift, calibrated on the model (``attention/key_shift.py``);
5. a hybrid model's recurrent state pool (``state_pool.py``);
6. the attention backend (``attention/__init__.py``; with a window pool one per pool
   behind a ``SplitAttention``), which settles the graphs' plan;
7. the cache tiers (``host_cache.py``: the host cache, its copy thread, the step's
   threads while it copies);
8. the LoRA slots and the adapters named at start (``lora.py``);
9. the grammar cache and slots (``grammar.py``);

then the ``ModelRunner`` over these parts (``parts.RunnerParts``), its warm-up
(unless ``config.warmup`` is off) and, when graphs are on, its decode graphs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixserve.layers.parallel import SINGLE, Comm
from radixserve.models.config import ModelConfig
from radixserve.models.loader import load_hf_config, load_model, load_vision, parse_dtype
from radixserve.models.sharding import Shard, head_shard
from radixserve.models.source import resolve_model
from radixserve.utils.kv_store import StoreConfig, StoreIO
from radixserve.utils.mooncake import open_store
from radixserve.worker import cuda_graph, window_pool
from radixserve.worker.attention import AttentionBackend, create_backend, key_shift, kv_layout_for
from radixserve.worker.config import WorkerConfig, parse_lora_modules
from radixserve.worker.dtype import choose_dtype
from radixserve.worker.grammar import GrammarCache, GrammarSlots
from radixserve.worker.host_cache import HostCache, kv_identity, weights_fingerprint
from radixserve.worker.kv_pool import DEFAULT_KV_MEMORY, KVPool
from radixserve.worker.lora import LoraSlots
from radixserve.worker.malloc import tune_malloc
from radixserve.worker.model_runner import ModelRunner
from radixserve.worker.page_table import PageTable, WindowTable
from radixserve.worker.parts import CacheTiers, KVSpace, LoadedModel, RunnerParts
from radixserve.worker.primitive_cache import bound_primitive_caches
from radixserve.worker.state_pool import StatePool

log = logging.getLogger("radixserve.worker")


def build_runner(config: WorkerConfig, tokenizer: Any = None, comm: Comm = SINGLE) -> ModelRunner:
    """The ``ModelRunner`` for ``config``, warmed up, its decode graphs captured.

    ``tokenizer``: the model's, when the caller has loaded it already (else it is
    loaded on the first structured-output request). ``comm``: this rank's
    tensor-parallel group (``worker/tp.py``), with ``config.tp`` ranks."""
    if comm.size != config.tp:
        raise ValueError(
            f"tp={config.tp} needs a group of {config.tp} ranks, got {comm.size} (build the "
            "worker with compose.build_worker, which starts the ranks: docs/parallel.md)"
        )
    set_up_process(config, comm)
    loaded = load(config, comm)
    cfg = loaded.config
    heads = head_shard(cfg, Shard(comm.rank, comm.size))  # this rank's share of the heads
    graph_plan = cuda_graph.GraphPlan(
        loaded.device, config.disable_cuda_graph, comm.size, cfg.hybrid
    )
    kv = build_kv_space(config, loaded, heads.kv_heads, comm, graph_plan.pad_pages)
    load_tokenizer = TokenizerLoader(config, tokenizer)
    # fp8 pools: the keys' constant per layer and head, before any backend reads it.
    key_shift.calibrate(loaded.model, load_tokenizer, pool_layers(kv, cfg))
    # A hybrid model's recurrent states: one working entry per slot, then the
    # snapshots the scheduler's tree keeps (state_pool.py).
    states = None
    if cfg.hybrid:
        snapshots = config.state_snapshots or config.max_running_requests
        states = StatePool(cfg, config.max_running_requests, snapshots, loaded.dtype, loaded.device)
    backend = build_backend(config, cfg, kv, heads.q_heads)
    log.info("attention backend %s (%s)", backend.name, backend.choice_reason)
    capturer = graph_plan.settle(backend)
    tiers = None
    if config.host_cache_gb or config.kv_store is not None:
        tiers = build_cache_tiers(config, loaded, kv, comm)
    loras, start_loras = build_loras(config, loaded)
    grammar_cache = GrammarCache(
        load_tokenizer, cfg.vocab_size, cfg.eos_token_ids, config.grammar_cache_size
    )
    grammars = GrammarSlots(grammar_cache, load_tokenizer, config.jump_forward)
    parts = RunnerParts(
        config, comm, loaded, kv, backend, states, tiers, loras, start_loras,
        grammar_cache, grammars,
    )  # fmt: skip
    runner = ModelRunner(parts)
    if config.warmup:
        runner.warmup(config.chunked_prefill_size, config.max_running_requests)
    if capturer is not None:
        graphs = cuda_graph.capture(
            loaded.model, backend, capturer, config.max_running_requests,
            kv.page_table.max_pages_per_slot, cfg.max_context_len - 1, kv.num_pages,
            loaded.device,
        )  # fmt: skip
        runner.use_graphs(graphs)
    return runner


def set_up_process(config: WorkerConfig, comm: Comm) -> None:
    """The allocator policy, oneDNN's cache bounds and the torch threads, before the
    model loads."""
    if config.malloc_tuning:
        tune_malloc()
    bound_primitive_caches()  # before this process compiles its first oneDNN product
    if config.threads and comm.size == 1:  # a rank of a group got its threads on joining
        torch.set_num_threads(config.threads)


def load(config: WorkerConfig, comm: Comm) -> LoadedModel:
    """This rank's shard of the model on its device (one device per rank on CUDA), in
    the dtype ``dtype.py`` resolves (``auto`` follows the checkpoint's on CUDA)."""
    device = torch.device(config.device)
    if comm.size > 1 and device.type == "cuda":
        device = torch.device("cuda", comm.local_rank)
    source = resolve_model(config.model, config.cache_dir)
    hf_config = None
    if config.dtype == "auto" and device.type == "cuda":
        hf_config = load_hf_config(source)
    dtype_name, dtype_reason = choose_dtype(config.dtype, device, hf_config)
    dtype = parse_dtype(dtype_name)
    model, hf_config = load_model(source, dtype, device, hf_config, comm)
    vision = load_vision(source, model.cfg, hf_config, dtype, device)
    return LoadedModel(
        model, hf_config, source.name, dtype_name, dtype_reason, dtype, device, vision
    )


def build_kv_space(
    config: WorkerConfig, loaded: LoadedModel, kv_heads: int, comm: Comm, pad_pages: int
) -> KVSpace:
    """The KV pools sized from ``config`` (a page count, else a byte budget), with
    ``pad_pages`` pages beyond those the scheduler hands out, and the page tables.

    Sliding layers with a window pool of their own (docs/models.md): their K/V lives
    in window pages, the full layers' in the main pool. A hybrid model's recurrent
    layers have no K/V: the pool holds the others only."""
    cfg, dtype, device = loaded.config, loaded.dtype, loaded.device
    windows = cfg.kv_sliding_windows
    window_layers: tuple[int, ...] = ()
    span = 0
    window_reason = window_pool.unsupported_reason(config, cfg, comm)
    if window_reason is None:
        window_layers = tuple(i for i, w in enumerate(windows) if w > 0)
        span = max(windows)
    full_layers = len(cfg.kv_layers) - len(window_layers)
    # fp8 for FlashInfer: the token_head layout (attention/__init__.py kv_layout_for).
    kv_layout = kv_layout_for(
        config.attention_backend, config.kv_cache_dtype, device, dtype, cfg.head_dim, kv_heads
    )
    dims = (
        full_layers, config.page_size, kv_heads, cfg.head_dim, dtype, config.kv_cache_dtype,
        kv_layout,
    )  # fmt: skip
    budget = config.kv_memory if config.kv_memory is not None else DEFAULT_KV_MEMORY
    window_pages = 0
    if window_layers:
        wdims = (len(window_layers), *dims[1:])
        num_pages, window_pages = window_pool.pool_sizes(config, dims, wdims, span, budget)
    elif config.num_pages is not None:
        num_pages = config.num_pages
    else:
        num_pages = KVPool.pages_for_budget(budget, *dims)

    def pool(layers: int, pages: int) -> KVPool:
        return KVPool(
            layers, pages, config.page_size, kv_heads, cfg.head_dim, dtype, device,
            config.kv_cache_dtype, kv_layout,
        )  # fmt: skip

    max_slots = config.max_running_requests
    max_pages_per_slot = min(num_pages, -(-cfg.max_context_len // config.page_size))
    main = pool(full_layers, num_pages + pad_pages)
    window, window_table = None, None
    if window_layers:
        # The window pool's last page is the dummy page (page_table.WindowTable).
        window = pool(len(window_layers), window_pages + 1)
        window_table = WindowTable(max_slots, max_pages_per_slot, window_pages, span)
    kv = KVSpace(
        main, num_pages, PageTable(max_slots, max_pages_per_slot, num_pages), window,
        window_table, window_pages, span, window_layers, window_reason,
    )  # fmt: skip
    if window_layers:
        log.info(
            "KV pools: %d pages (%d full layers) and a window pool of %d pages (%d "
            "sliding layers, window %d) of %s; %d tokens per GiB; %d bytes per cached "
            "token past the window (one pool: %d)",
            num_pages, full_layers, window_pages, len(window_layers), span,
            kv.pool.kv_dtype_name, kv.tokens_per_gib, kv.bytes_per_cached_token,
            kv.bytes_per_token_one_pool,
        )  # fmt: skip
    else:
        if any(w > 0 for w in windows):
            log.info("one KV pool for every layer: %s", window_reason)
        log.info(
            "KV pool: %d pages of %s, %d tokens per GiB",
            num_pages, kv.pool.kv_dtype_name, kv.tokens_per_gib,
        )  # fmt: skip
    return kv


def pool_layers(kv: KVSpace, cfg: ModelConfig) -> list[tuple[KVPool, tuple[int, ...]]]:
    """Each pool of ``kv`` with the attention layers it holds (their index among the
    pool's layers: ``cfg.kv_layers``' order), in its order."""
    window = set(kv.window_layers)
    full = tuple(i for i in range(len(cfg.kv_layers)) if i not in window)
    pools = [(kv.pool, full)]
    if kv.window_pool is not None:
        pools.append((kv.window_pool, kv.window_layers))
    return pools


def build_backend(
    config: WorkerConfig, cfg: ModelConfig, kv: KVSpace, q_heads: int
) -> AttentionBackend:
    """The attention backend: over the one pool, or (window pool) one per pool behind
    a ``SplitAttention``."""
    if kv.window_pool is not None:
        return window_pool.split_backend(
            config, cfg, q_heads, kv.pool, kv.window_pool, kv.window_layers
        )
    return create_backend(
        config.attention_backend, kv.pool, cfg.attention_scale, cfg.kv_sliding_windows,
        q_heads, config.decode_kernel, cfg.attn_softcap,
        {"prefill_backend": config.flashinfer_prefill_backend}, config.deterministic,
    )  # fmt: skip


def build_cache_tiers(
    config: WorkerConfig, loaded: LoadedModel, kv: KVSpace, comm: Comm
) -> CacheTiers:
    """The host cache of ``config.host_cache_gb`` GiB (and the disk tier behind it,
    and the shared KV store's client) over the main pool, its copy thread, and the
    step's threads while it copies."""
    fingerprint = weights_fingerprint(loaded.model)
    identity = kv_identity(loaded.name, fingerprint, loaded.dtype_name, kv.pool)
    slots = HostCache.slots_for(config.host_cache_gb, kv.page_bytes) if config.host_cache_gb else 0
    store = None
    if config.kv_store is not None:
        settings = StoreConfig.parse(config.kv_store_config)
        client = open_store(config.kv_store, config.kv_store_config)
        store = StoreIO(client, settings.timeout_s)
        log.info("KV store %s connected", config.kv_store)
    # With several ranks each does its copies in step (HostCache's docstring).
    host_cache = HostCache(
        kv.pool, slots, config.disk_cache_dir, identity, comm.size == 1, store=store
    )
    # On the CPU the copy thread takes a core from the step while it has work: an
    # OpenMP team that loses a core to it waits at every barrier (docs/cache-tiers.md).
    # Steps run on one thread fewer while the thread has work, on all of them
    # otherwise (unless --threads says); a small ticket is done in the step
    # (HostCache.inline_pages). Deterministic mode keeps one thread count: products'
    # blocking may follow it.
    n = torch.get_num_threads()
    threads = None
    if (
        host_cache.asynchronous
        and loaded.device.type == "cpu"
        and not config.threads
        and n > 1
        and not config.deterministic
    ):
        threads = (n, n - 1)
    return CacheTiers(host_cache, identity, threads)


def build_loras(config: WorkerConfig, loaded: LoadedModel) -> tuple[LoraSlots, tuple[dict, ...]]:
    """The LoRA slots, with the adapters ``config.lora_modules`` names loaded as ids 1,
    2, ...; and what the worker reports of those (a LoraError here fails the start)."""
    loras = LoraSlots(
        loaded.model, loaded.dtype, loaded.device, config.max_lora_rank,
        config.max_running_requests,
    )  # fmt: skip
    start = []
    for i, (name, path) in enumerate(parse_lora_modules(config.lora_modules), start=1):
        adapter = loras.load(i, name, path)
        start.append(
            {"id": i, "name": name, "path": path, "digest": adapter.digest, "rank": adapter.rank}
        )
    return loras, tuple(start)


class TokenizerLoader:
    """The model's tokenizer for the grammars: the one given, else loaded on first use."""

    def __init__(self, config: WorkerConfig, tokenizer: Any = None) -> None:
        self._config = config
        self._tokenizer = tokenizer

    def __call__(self) -> Any:
        if self._tokenizer is None:
            from radixserve.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self._config.model, self._config.cache_dir)
        return self._tokenizer

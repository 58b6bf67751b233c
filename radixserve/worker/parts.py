"""What a ``ModelRunner`` is made of: the parts ``build.py`` builds from a ``WorkerConfig``.

The runner receives them (``RunnerParts``) and builds nothing itself but its step
machinery (input staging, sampler, logits processor). Each part is built once at
start and lives as long as the runner:

- ``LoadedModel``: the model with its config, dtype and device;
- ``KVSpace``: the KV pool, the sliding layers' window pool when the model gets one
  (``window_pool.py``), the slots' page tables, and the sizes the scheduler is told;
- the attention backend (``attention/``: one backend, or a ``SplitAttention`` over
  the two pools);
- the recurrent state pool of a hybrid model (``state_pool.py``);
- ``CacheTiers``: the host cache and its copy thread (``host_cache.py``), the KV
  identity of the page files, and the step's torch threads while the thread copies;
- the LoRA slots, with the adapters loaded at start (``lora.py``);
- the grammar cache and the slots' grammars (``grammar.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixserve.layers.parallel import Comm
from radixserve.models.config import ModelConfig
from radixserve.worker.attention.base import AttentionBackend
from radixserve.worker.config import WorkerConfig
from radixserve.worker.grammar import GrammarCache, GrammarSlots
from radixserve.worker.host_cache import HostCache
from radixserve.worker.kv_pool import KVPool
from radixserve.worker.lora import LoraSlots
from radixserve.worker.page_table import PageTable, WindowTable
from radixserve.worker.state_pool import StatePool
from radixserve.worker.window_pool import page_bytes as pool_page_bytes


@dataclass(frozen=True)
class LoadedModel:
    """The model's weights on their device, with what loading resolved."""

    model: Any  # a models/ decoder (torch.nn.Module)
    hf_config: Any
    name: str
    dtype_name: str
    dtype_reason: str
    dtype: torch.dtype
    device: torch.device
    vision: Any = None  # a vision-language model's vision tower (models/qwen2_5_vision.py)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


@dataclass(frozen=True)
class KVSpace:
    """The KV pools and the slots' page tables.

    ``pool`` holds the full layers' K/V (every layer's without a window pool), and one
    page more than ``num_pages`` when decode graphs may be captured (the pad page,
    ``cuda_graph.GraphPlan``). ``window_pool`` holds the sliding layers' (its last page
    is the dummy page, ``page_table.WindowTable``); ``window_reason`` says why a model
    with sliding layers has none.
    """

    pool: KVPool
    num_pages: int
    page_table: PageTable
    window_pool: KVPool | None = None
    window_table: WindowTable | None = None
    window_pages: int = 0
    window_span: int = 0
    window_layers: tuple[int, ...] = ()
    window_reason: str | None = None

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def page_bytes(self) -> int:
        """One page of the main pool (the unit the cache tiers copy)."""
        return pool_page_bytes(self.pool)

    @property
    def window_page_bytes(self) -> int:
        return 0 if self.window_pool is None else pool_page_bytes(self.window_pool)

    @property
    def bytes_per_cached_token(self) -> int:
        """KV bytes a cached token holds once it is past every window: the full
        layers' (every layer's with one pool)."""
        return self.page_bytes // self.page_size

    @property
    def bytes_per_token_one_pool(self) -> int:
        """KV bytes of a token with one pool for every layer (what a cached token
        holds without a window pool)."""
        return self.bytes_per_cached_token + self.window_page_bytes // self.page_size

    @property
    def tokens_per_gib(self) -> int:
        """Tokens of KV (every layer, this rank's heads) one GiB of the pool holds
        (with a window pool: the full pool's tokens per GiB of both pools)."""
        if self.window_pool is not None:
            full = self.page_bytes * self.num_pages
            window = self.window_page_bytes * self.window_pages
            return (1 << 30) * self.num_pages * self.page_size // (full + window)
        return (1 << 30) * self.page_size // self.page_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes the pools take, the pad and dummy pages included."""
        pools = [self.pool] if self.window_pool is None else [self.pool, self.window_pool]
        return sum(t.numel() * t.element_size() for p in pools for t in p.layers)


@dataclass(frozen=True)
class CacheTiers:
    """The host tier (and the disk tier behind it) of the KV cache.

    ``kv_identity`` names what a page's KV depends on besides its tokens
    (``host_cache.kv_identity``). ``copy_threads``: on the CPU, the step's torch
    threads while the copy thread is idle and while it has work (it takes a core
    then: docs/cache-tiers.md); None: the step keeps the process's count.
    """

    host_cache: HostCache
    kv_identity: str
    copy_threads: tuple[int, int] | None = None


@dataclass(frozen=True)
class RunnerParts:
    """Everything a ``ModelRunner`` runs steps with (module docstring)."""

    config: WorkerConfig
    comm: Comm
    model: LoadedModel
    kv: KVSpace
    backend: AttentionBackend
    states: StatePool | None
    tiers: CacheTiers | None
    loras: LoraSlots
    start_loras: tuple[dict, ...]
    grammar_cache: GrammarCache
    grammars: GrammarSlots

"""The attention backend interface.

A backend owns no weights. It is told once per step what the batch looks like
(``begin_batch``: per request its query length, its KV length and its page
table, all host-side int32 arrays) and is then called once per layer
(``forward``) with that layer's new q, k, v. Planning once and running per
layer is the shape FlashInfer's wrappers want (``plan`` / ``run``); the torch
backend uses ``begin_batch`` to build its gather indices and masks.

``AttentionBackend`` is the interface the runner and the model see; ``PoolBackend``
is a backend over one ``KVPool`` (torch, flashinfer), ``split.SplitAttention`` one
over two (the full layers' pool and the window pool). What a backend can do beyond
the contract is declared, never probed for: ``plans_native_steps`` (it plans a
step whose layers all run in one native call when ``native_layers`` says so) and
``captures_graphs`` (``setup_graphs`` / ``begin_graph_batch``: decode batches on
static buffers, for CUDA graphs; a backend without it refuses them).

Contract of ``forward(layer, q, k, v)``:
- q is [T, num_heads, head_dim], k and v are [T, num_kv_heads, head_dim], rows
  in batch order (request 0's new tokens, then request 1's, ...), rotary
  already applied.
- The backend writes k/v into the KV pool: the token at absolute position p of
  a request lives in page ``page_table[p // page_size]`` at offset
  ``p % page_size``. The new tokens of a request occupy positions
  [kv_len - qo_len, kv_len).
- It returns attention output [T, num_heads, head_dim], which may live in a
  buffer the backend reuses: it is valid until the next ``forward`` or
  ``begin_batch`` (the model's output projection reads it at once). Query t (0-based
  within its request) sees key j iff j <= t + kv_len - qo_len (causal mask
  aligned bottom-right), and, for a layer with sliding window w > 0, also
  j > t + kv_len - qo_len - w.
- Scores are ``scale * q.k``, then, with ``softcap`` > 0 (Gemma 2),
  ``softcap * tanh(score / softcap)``, before the mask and the softmax.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.worker.attention.rotation import KeyRotation
from radixserve.worker.kv_pool import KVPool


@dataclass(frozen=True)
class AttentionBatch:
    """Host-side layout of one step, in FlashInfer's CSR form.

    ``qo_indptr`` [B+1]: request i's new tokens are rows qo_indptr[i]:qo_indptr[i+1].
    ``kv_lens`` [B]: keys request i attends to after this step's writes (start_pos + qo_len).
    ``page_indptr`` [B+1] / ``page_indices``: request i's page table is
    page_indices[page_indptr[i]:page_indptr[i+1]], exactly ceil(kv_len / page_size) pages.
    ``window_page_indices``: with a window pool (``split.py``), request i's window page
    table, at the same offsets (None without one).
    """

    qo_indptr: np.ndarray
    kv_lens: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    window_page_indices: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)

    @property
    def qo_lens(self) -> np.ndarray:
        return np.diff(self.qo_indptr)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])


class AttentionBackend(ABC):
    """Paged attention for every layer of the model; see the module docstring for the
    contract."""

    name: str = ""
    #: Why ``create_backend`` chose this backend (logged at start).
    choice_reason: str = ""
    #: Capability: it plans a decode step whose layers all run in one native call
    #: (``models/decode_step.py``) when ``native_layers`` (set by the runner) says the
    #: step's rows go there.
    plans_native_steps: bool = False
    #: Capability: it plans decode batches padded to a capture size on static buffers
    #: (``setup_graphs``, ``begin_graph_batch``), so CUDA graphs can replay its steps.
    captures_graphs: bool = False
    #: Where ``plans_native_steps``: whether a step of this many rows runs every layer
    #: in one native call (None: never).
    native_layers: Callable[[int], bool] | None = None

    @abstractmethod
    def begin_batch(self, batch: AttentionBatch) -> None:
        """Plan the step: called once before the layers run."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k/v of this step into the pool and return attention output like q."""

    def native_step_plan(self) -> tuple[np.ndarray, object] | None:
        """Where ``plans_native_steps``: this step's K/V write rows and its native
        attention plan when one native call computes every layer of it
        (``models/decode_step.py``); None otherwise, and always for a backend without
        the capability."""
        return None

    def setup_graphs(self, sizes: tuple[int, ...], max_pages_per_slot: int, pad_page: int) -> None:
        """Where ``captures_graphs``: build what decode batches of ``sizes`` rows are
        planned on; a request reads at most ``max_pages_per_slot`` pages, pad rows read
        and write ``pad_page``. ValueError for a backend that cannot."""
        raise ValueError(self._no_graphs())

    def begin_graph_batch(self, batch: AttentionBatch, size: int) -> None:
        """Where ``captures_graphs``: plan a decode-only ``batch`` padded to ``size``
        rows on the static buffers. ValueError for a backend that cannot."""
        raise ValueError(self._no_graphs())

    def _no_graphs(self) -> str:
        return (
            f"the {self.name} attention backend cannot capture CUDA graphs "
            "(the flashinfer backend can; or disable_cuda_graph)"
        )


class PoolBackend(AttentionBackend):
    """A backend over one ``KVPool``: its layers are the pool's."""

    def __init__(
        self,
        pool: KVPool,
        scale: float,
        sliding_windows: tuple[int, ...],
        num_qo_heads: int,
        softcap: float = 0.0,
    ) -> None:
        if softcap < 0:
            raise ValueError(f"softcap must be >= 0 (0: none), got {softcap}")
        if len(sliding_windows) != pool.num_layers:
            raise ValueError("one sliding window entry per layer is required")
        # Planning needs the query head count before any q exists (FlashInfer's plan()).
        if num_qo_heads < 1 or num_qo_heads % pool.num_kv_heads:
            raise ValueError(
                f"num_qo_heads {num_qo_heads} must be a positive multiple of "
                f"num_kv_heads {pool.num_kv_heads}"
            )
        self.num_qo_heads = num_qo_heads
        self.pool = pool
        self.scale = scale
        self.softcap = softcap
        self.sliding_windows = sliding_windows
        #: Where the pool stores rotated keys (``rotation.py``): every ``forward``
        #: rotates q and k with it before anything else, so the pool is written and
        #: read in the rotated basis alone. None for a pool of plain values.
        self.rotation = KeyRotation.for_pool(pool)

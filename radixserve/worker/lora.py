"""The worker's LoRA adapters: loaded by id, assigned to slots, batched per step.

The scheduler numbers adapters (ids from 1; 0 is the base model, and an id is never
reused, so a name loaded again gets a new one) and says, in the step that adds a
slot (``StepReq.lora``), which adapter the slot's rows use; the slot keeps it until
it is released. ``Step.load_loras`` / ``drop_loras`` load and drop adapters before
the step's requests run (``ModelRunner.step``). Per step, ``batch`` groups the rows
of the step by adapter into a ``LoraBatch`` (``layers/lora.py``); a step with no
adapter rows gets None and runs exactly as before.

Every adapter stays in memory while loaded (its weights are small: ``2 r (in + out)``
values per adapted module); ``max_loras`` bounds the adapters of one batch, which
the scheduler keeps (docs/lora.md).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.layers.lora import LoraBatch
from radixserve.models.lora import LoraAdapter, LoraError, load_adapter
from radixserve.models.sharding import Shard


class LoraSlots:
    """Loaded adapters by id and each slot's adapter (0: the base model)."""

    def __init__(
        self, model, dtype: torch.dtype, device: torch.device, max_rank: int, max_slots: int
    ) -> None:
        self.model = model
        self.dtype, self.device, self.max_rank = dtype, device, max_rank
        self.adapters: dict[int, LoraAdapter] = {}
        self.slot_lora = np.zeros(max_slots, dtype=np.int64)

    def load(self, lora_id: int, name: str, path: str) -> LoraAdapter:
        """Load (and keep) an adapter under ``lora_id``; LoraError saying why not."""
        if lora_id < 1:
            raise LoraError(f"LoRA id must be >= 1, got {lora_id}")
        if lora_id in self.adapters:
            raise LoraError(f"LoRA id {lora_id} is already loaded")
        shard = getattr(self.model, "shard", Shard())
        adapter = load_adapter(
            name, path, self.model.cfg, self.dtype, self.device, self.max_rank, shard
        )
        self.adapters[lora_id] = adapter
        return adapter

    def drop(self, lora_id: int) -> None:
        """Forget an adapter (no slot may still use it)."""
        if np.any(self.slot_lora == lora_id):
            raise ValueError(f"LoRA {lora_id} is dropped while a slot still uses it")
        self.adapters.pop(lora_id, None)

    def assign(self, slot: int, lora_id: int) -> None:
        if lora_id and lora_id not in self.adapters:
            raise ValueError(f"slot {slot}: LoRA {lora_id} is not loaded")
        self.slot_lora[slot] = lora_id

    def clear(self, slot: int) -> None:
        self.slot_lora[slot] = 0

    def batch(self, slots: list[int], qo_indptr: np.ndarray) -> LoraBatch | None:
        """The step's ``LoraBatch`` for requests in ``slots`` whose rows are
        ``qo_indptr[i] .. qo_indptr[i + 1]``; None when no row has an adapter."""
        ids = self.slot_lora[slots]
        if not ids.any():
            return None
        lens = np.diff(qo_indptr)
        row_ids = np.repeat(ids, lens)
        groups = []
        for lora_id in np.unique(ids[ids > 0]).tolist():
            if len(ids) and (ids == lora_id).all():
                rows = None  # every row: no gather, no scatter
            else:
                rows = torch.from_numpy(np.flatnonzero(row_ids == lora_id)).to(self.device)
            groups.append((rows, self.adapters[lora_id].layers))
        return LoraBatch(groups)

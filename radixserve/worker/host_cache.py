"""The worker's side of the cache tiers: the host buffer (L2) and the page files (L3).

``HostCache`` holds ``num_slots`` pages of KV in host memory, one tensor
``[slots, layers, 2, page_size, kv_heads, head_dim]`` in the pool's dtype (pinned
when the pool is on CUDA, so copies to and from the device can be asynchronous;
plain memory on CPU: the same code). ``apply(copies)`` performs a step's
``protocol.PageCopies`` in their order, before the step computes anything:

0. pool pages written to the disk tier (write-through of computed pages);
1. host slots written to the disk tier as page files (``utils/kv_file.py``; atomic,
   checksummed; a failed write is logged and becomes a miss: the scheduler
   verifies a file before it is loaded);
2. pool pages copied to host slots (demotion);
3. host slots copied to pool pages (promotion);
4. page files read into pool pages (the scheduler verified them when it matched;
   a file broken since then fails the step with a clear error, never loads wrong KV).

The copies are synchronous at the start of the step (the scheduler plans them so
that this order is always safe); overlapping them with the step's compute (a copy
stream on CUDA, a copy thread on CPU) is not done yet (docs/cache-tiers.md).

``kv_identity`` names what a page's KV depends on besides its tokens: the model
(name, a fingerprint of its weights), the dtype and the pool layout. It goes into
every page key and file header, so files of another model are never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os

import numpy as np
import torch

from radixserve.protocol import KEY_BYTES, PageCopies
from radixserve.utils import kv_file
from radixserve.worker.kv_pool import KVPool

log = logging.getLogger("radixserve.worker")

GIB = 1 << 30


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A cheap fingerprint of the weights: every parameter's name, shape and first
    values (enough to tell checkpoints apart without hashing gigabytes)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        head = p.detach().reshape(-1)[:256].to("cpu", torch.float64)
        h.update(head.numpy().tobytes())
    return h.hexdigest()[:32]


def kv_identity(model_name: str, fingerprint: str, dtype: str, pool: KVPool) -> str:
    return (
        f"model={model_name};weights={fingerprint};dtype={dtype};layers={pool.num_layers};"
        f"page_size={pool.page_size};kv_heads={pool.num_kv_heads};head_dim={pool.head_dim}"
    )


class HostCache:
    def __init__(self, pool: KVPool, num_slots: int, disk_dir: str | None, identity: str) -> None:
        if num_slots < 1:
            raise ValueError("the host cache needs room for at least one page")
        self.pool = pool
        self.num_slots = num_slots
        self.disk_dir = disk_dir
        self.identity = kv_file.identity_digest(identity)
        self.device = pool.layers[0].device
        shape = (num_slots, pool.num_layers, 2, pool.page_size, pool.num_kv_heads, pool.head_dim)
        pin = self.device.type == "cuda"
        self.buf = torch.zeros(shape, dtype=pool.dtype, pin_memory=pin)
        self.page_shape = shape[1:]
        self.page_bytes = self.buf[0].numel() * self.buf.element_size()
        if disk_dir is not None:
            os.makedirs(disk_dir, mode=0o700, exist_ok=True)

    @staticmethod
    def slots_for(gib: float, page_bytes: int) -> int:
        n = int(gib * GIB) // page_bytes
        if n < 1:
            raise ValueError(
                f"--host-cache-gb {gib} holds no page (one page is {page_bytes} bytes)"
            )
        return n

    def _index(self, ids: np.ndarray, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(ids.astype(np.int64)).to(device)

    def _write(self, key: bytes, payload: bytes) -> None:
        try:
            kv_file.write_page_file(self.disk_dir, key, self.identity, payload)  # type: ignore[arg-type]
        except OSError as e:
            log.warning("disk tier: could not write page %s: %s", key.hex()[:16], e)

    def apply(self, c: PageCopies) -> None:
        layers = self.pool.layers
        if len(c.save_pages):
            pages = self._index(c.save_pages, self.device)
            kv = torch.stack([layer[pages] for layer in layers], dim=1).to("cpu")
            for i in range(len(c.save_pages)):
                key = c.save_keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
                self._write(key, kv[i].contiguous().view(torch.uint8).numpy().tobytes())
        for i, slot in enumerate(c.to_disk_slots.tolist()):
            key = c.to_disk_keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
            self._write(key, self.buf[slot].view(torch.uint8).numpy().tobytes())
        if len(c.demote_pages):
            pages = self._index(c.demote_pages, self.device)
            slots = self._index(c.demote_slots, torch.device("cpu"))
            for i, layer in enumerate(layers):
                self.buf[slots, i] = layer[pages].to("cpu")
        if len(c.promote_pages):
            pages = self._index(c.promote_pages, self.device)
            slots = self._index(c.promote_slots, torch.device("cpu"))
            for i, layer in enumerate(layers):
                layer[pages] = self.buf[slots, i].to(self.device, non_blocking=True)
        for i, page in enumerate(c.load_pages.tolist()):
            key = c.load_keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
            path = os.path.join(self.disk_dir, kv_file.file_name(key))  # type: ignore[arg-type]
            payload = kv_file.read_payload(path, key, self.identity, self.page_bytes)
            if payload is None:
                raise RuntimeError(
                    f"the disk tier's page file {path} was damaged after it was verified; "
                    "the directory must be written by this server only"
                )
            kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            kv = kv.view(self.pool.dtype).reshape(self.page_shape)
            for j, layer in enumerate(layers):
                layer[page] = kv[j].to(self.device)

"""The worker's side of the cache tiers: the host buffer (L2), the page files (L3)
and the shared KV store.

``HostCache`` holds ``num_slots`` pages of KV in host memory, one tensor
``[slots, layers, 2, page_size, kv_heads, entry_dim]`` in the pool's storage dtype:
a quantized pool's bytes, codes and scales, as they are (pinned
when the pool is on CUDA; plain memory on CPU: the same code). ``apply(copies)``
performs a step's ``protocol.PageCopies`` in their order. What the step needs in
place before it computes is done at once, in ``apply``:

0. the pool pages to be written to the disk tier are read (a snapshot: the step
   may overwrite them once they are freed);
1. the host slots to be written to the disk tier are read (a demotion below may
   reuse them);
2. pool pages are copied to host slots (demotion: the pool page may be handed out
   in this very step).

The rest runs in the background, in a **copy thread** (on CUDA its copies go on a
copy stream of their own, after an event recorded on the compute stream when the
step began, and the thread waits for them), ticket after ticket:

0./1. the snapshots are written as page files (``utils/kv_file.py``; atomic,
   checksummed; a failed write is logged and becomes a miss: the scheduler
   verifies a file before it is loaded);
3. host slots are copied to pool pages (promotion);
4. page files are read, checked and copied into pool pages (the scheduler
   verified them when it matched; a file broken since then fails the next step
   with a clear error, never loads wrong KV);
5. the pool pages read in step for the shared store (``store``, a
   ``utils.kv_store.StoreIO``) are queued for writing (the ticket does not wait
   for the store);
6. pages are read from the store, checked (a page file's header and checksum: this
   key, this model) and copied into pool pages, up to the first the store does not
   give; those pages and the rest of their read are reported missed
   (``last_missed``, with the tickets ``finished`` returns). A store read never
   runs in the step, whatever its size: a slow store delays the requests waiting
   for it, not the batch.

``finished()`` returns the tickets done since the last call (the worker reports
them in ``StepResult.copies_done``); the scheduler neither computes on a page nor
reuses a slot or file a ticket still fills or reads until it is reported.
``wait(timeout)`` waits for the next ticket (a step with nothing to compute);
``close()`` finishes every ticket queued and joins the thread, so a clean stop
loses no write-through file. With ``asynchronous=False`` (tensor parallelism:
every rank must have done a ticket before it is reported, and each rank does its
own copies in step, so rank 0's report covers them all) ``apply`` does
everything at once and the ticket is finished when it returns; so does a small
ticket on the CPU (fewer than ``inline_pages`` pages, nothing queued before it:
a thread of its own would cost the step's threads more than the copies).
``before_copies`` is a hook for tests: called in the copy thread with each
ticket before its copies.

``kv_identity`` names what a page's KV depends on besides its tokens: the model
(name, a fingerprint of its weights), the dtype, what the pool stores (its KV dtype:
a restart with another ``--kv-cache-dtype`` loads none of the files), the pool layout and
what the key rows are of the keys (``KVPool.key_tag``: rotated, and an fp8 pool's
key shift by a digest of its values). It goes into
every page key and file header, so files of another model are never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.protocol import KEY_BYTES, PageCopies
from radixserve.utils import kv_file
from radixserve.utils.kv_store import StoreIO
from radixserve.worker.kv_pool import KVPool

log = logging.getLogger("radixserve.worker")

GIB = 1 << 30
INLINE_PAGES = 16  # HostCache.inline_pages on the CPU


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
    # The per-tensor fp8 layout's pages hold other bytes than the per-row layout's of the
    # same kv_dtype; the default layout adds nothing, so existing page files still match.
    layout = "" if pool.kv_layout == "row" else f"kv_layout={pool.kv_layout};"
    # Rotated keys (quantized pools) are other bytes than the same format's unrotated
    # ones, and shifted keys (fp8) other bytes again for every other shift.
    return (
        f"model={model_name};weights={fingerprint};dtype={dtype};kv_dtype={pool.kv_dtype_name};"
        f"{layout}{pool.key_tag}layers={pool.num_layers};"
        f"page_size={pool.page_size};kv_heads={pool.num_kv_heads};head_dim={pool.head_dim}"
    )


@dataclass
class _Job:
    """A ticket's copies left for the copy thread."""

    ticket: int
    writes: list[tuple[bytes, torch.Tensor]]  # (key, a page's KV on the CPU)
    promote_slots: np.ndarray
    promote_pages: np.ndarray
    load_keys: list[bytes]
    load_pages: np.ndarray
    store_writes: list[tuple[bytes, torch.Tensor]]
    store_keys: list[bytes]
    store_pages: np.ndarray
    after: Any = None  # CUDA: an event of the compute stream to wait for


class HostCache:
    def __init__(
        self,
        pool: KVPool,
        num_slots: int,
        disk_dir: str | None,
        identity: str,
        asynchronous: bool = True,
        store: StoreIO | None = None,
    ) -> None:
        if num_slots < 1 and store is None:
            raise ValueError("the host cache needs room for at least one page")
        self.pool = pool
        self.num_slots = num_slots
        self.disk_dir = disk_dir
        self.identity = kv_file.identity_digest(identity)
        self.device = pool.layers[0].device
        shape = (num_slots, pool.num_layers, 2, pool.page_size, pool.num_kv_heads, pool.entry_dim)
        cuda = self.device.type == "cuda"
        self.buf = torch.zeros(shape, dtype=pool.storage_dtype, pin_memory=cuda)
        self.page_shape = shape[1:]
        self.page_bytes = int(np.prod(self.page_shape)) * self.buf.element_size()
        if disk_dir is not None:
            os.makedirs(disk_dir, mode=0o700, exist_ok=True)
        self.asynchronous = asynchronous
        self.store = store
        self.last_missed = np.zeros(0, dtype=np.int32)  # of the tickets finished() returned
        self._missed: list[int] = []  # store pages missed by tickets done, not reported yet
        # On the CPU a ticket of fewer pages than this, with the thread idle, is
        # done at once in the step (a decode's few pages written through): on
        # cores the step's threads all use, a thread of its own would cost the
        # step more than the copies. 0: everything goes to the thread.
        self.inline_pages = 0 if cuda else INLINE_PAGES
        self.before_copies: Callable[[int], None] | None = None
        self._cond = threading.Condition()
        self._done: list[int] = []  # tickets finished, not reported yet
        self._queued = 0  # tickets given to the thread, not finished yet
        self._error: BaseException | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stream = torch.cuda.Stream(self.device) if cuda and asynchronous else None
        self._thread: threading.Thread | None = None
        if asynchronous:
            # The thread holds a weak reference: a cache dropped without close()
            # is collected, and its finalizer stops the thread.
            args = (weakref.ref(self), self._jobs)
            self._thread = threading.Thread(target=_serve, args=args, name="kv-copies", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._jobs.put, None)

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

    # ------------------------------------------------------------- the step
    def apply(self, c: PageCopies) -> None:
        """The in-step part of ``c`` now; the rest queued (or done now when not
        asynchronous)."""
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("the cache tiers' copy thread is gone")
        layers = self.pool.layers
        writes: list[tuple[bytes, torch.Tensor]] = []
        if len(c.save_pages):
            writes += self._snapshot(c.save_pages, c.save_keys)
        store_writes = []
        if len(c.store_save_pages):
            store_writes = self._snapshot(c.store_save_pages, c.store_save_keys)
        if len(c.to_disk_slots):
            kv = self.buf[self._index(c.to_disk_slots, torch.device("cpu"))]  # a copy
            writes += [(_key(c.to_disk_keys, i), kv[i]) for i in range(len(c.to_disk_slots))]
        if len(c.demote_pages):
            pages = self._index(c.demote_pages, self.device)
            slots = self._index(c.demote_slots, torch.device("cpu"))
            for i, layer in enumerate(layers):
                self.buf[slots, i] = layer[pages].to("cpu")
        job = _Job(
            c.ticket,
            writes,
            c.promote_slots,
            c.promote_pages,
            [_key(c.load_keys, i) for i in range(len(c.load_pages))],
            c.load_pages,
            store_writes,
            [_key(c.store_load_keys, i) for i in range(len(c.store_load_pages))],
            c.store_load_pages,
        )
        if not self.goes_to_thread(c):
            self._run(job)
            with self._cond:
                self._done.append(job.ticket)
            return
        if self._stream is not None:
            job.after = torch.cuda.Event()
            job.after.record()  # the compute stream, as the step began
        with self._cond:
            self._queued += 1
        self._jobs.put(job)

    def _snapshot(self, ids: np.ndarray, keys: bytes) -> list[tuple[bytes, torch.Tensor]]:
        """Pool pages ``ids`` read now (on the CPU), with their keys."""
        pages = self._index(ids, self.device)
        kv = torch.stack([layer[pages] for layer in self.pool.layers], dim=1).to("cpu")
        return [(_key(keys, i), kv[i]) for i in range(len(ids))]

    def goes_to_thread(self, c: PageCopies) -> bool:
        """Whether ``apply(c)`` will leave work to the copy thread: with one, any
        ticket while it is busy (tickets run in order) or that reads the store, else
        one of at least ``inline_pages`` pages to write, promote or load. A ticket
        that reads or writes the store never runs in the step: a slow store must
        delay the requests that wait for it, not the batch."""
        if not self.asynchronous:
            return False
        if self._queued or len(c.store_load_pages) or len(c.store_save_pages):
            return True
        pages = len(c.save_pages) + len(c.to_disk_slots) + len(c.promote_pages) + len(c.load_pages)
        return pages > 0 and pages >= self.inline_pages

    def finished(self) -> list[int]:
        """The tickets finished since the last call (``last_missed``: the store pages
        they did not get); raises what failed in the thread."""
        with self._cond:
            if self._error is not None:
                raise RuntimeError(f"cache tier copies failed: {self._error}") from self._error
            done, self._done = self._done, []
            missed, self._missed = self._missed, []
        self.last_missed = np.asarray(missed, dtype=np.int32)
        return done

    @property
    def busy(self) -> bool:
        """Whether tickets are queued or being copied."""
        return self._queued > 0

    def wait(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until a ticket is finished or none is queued."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or not self._queued, timeout)

    def close(self) -> None:
        """Finish every ticket queued and stop the thread (files and the store's
        pages are all written)."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._thread = None
        if self.store is not None:
            self.store.close()
            self.store = None

    # ----------------------------------------------------- the copy thread
    def _serve_one(self, job: _Job) -> None:
        try:
            if self.before_copies is not None:
                self.before_copies(job.ticket)
            if self._error is None:
                self._run(job)
        except BaseException as e:  # reported to the step loop by finished()
            log.exception("cache tier copies of ticket %d failed", job.ticket)
            with self._cond:
                self._error = e
        with self._cond:
            self._queued -= 1
            self._done.append(job.ticket)
            self._cond.notify_all()

    @torch.inference_mode()
    def _run(self, job: _Job) -> None:
        """A ticket's background part: file and store writes, promotions, loads."""
        for key, kv in job.writes:
            self._write(key, _bytes(kv))
        if job.store_writes:
            assert self.store is not None
            self.store.put(
                [
                    (k, kv_file.encode_page(self.identity, k, _bytes(kv)))
                    for k, kv in job.store_writes
                ]
            )
        arrived = self._read_store(job)
        stream = self._stream
        if stream is not None and job.after is not None:
            stream.wait_event(job.after)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._to_pool(job)
            if arrived is not None:
                pages = self._index(job.store_pages[: len(arrived)], self.device)
                for j, layer in enumerate(self.pool.layers):
                    layer[pages] = arrived[:, j].to(self.device, non_blocking=True)
        if stream is not None:
            stream.synchronize()

    def _read_store(self, job: _Job) -> torch.Tensor | None:
        """The store's pages of ``job`` up to the first it does not give (whole and
        of this key and model), as ``[n, *page_shape]``; the pages missed are
        recorded for ``finished``. None: nothing arrived."""
        n = len(job.store_keys)
        if n == 0:
            return None
        assert self.store is not None
        blobs = self.store.get(job.store_keys)
        payloads = []
        for key, blob in zip(job.store_keys, blobs):
            payload = (
                None
                if blob is None
                else kv_file.decode_page(blob, key, self.identity, self.page_bytes)
            )
            if payload is None:
                break
            payloads.append(payload)
        if len(payloads) < n:
            with self._cond:
                self._missed += job.store_pages[len(payloads) :].tolist()
        if not payloads:
            return None
        raw = b"".join(payloads)
        kv = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.pool.storage_dtype)
        return kv.reshape(len(payloads), *self.page_shape)

    def _to_pool(self, job: _Job) -> None:
        layers = self.pool.layers
        if len(job.promote_pages):
            pages = self._index(job.promote_pages, self.device)
            slots = self._index(job.promote_slots, torch.device("cpu"))
            for i, layer in enumerate(layers):
                layer[pages] = self.buf[slots, i].to(self.device, non_blocking=True)
        n = len(job.load_pages)
        if n == 0:
            return
        # Every file into one buffer first (reads and checksums release the GIL),
        # then one copy per layer: few Python steps beside the step loop's.
        raw = bytearray(n * self.page_bytes)
        for i, key in enumerate(job.load_keys):
            path = os.path.join(self.disk_dir, kv_file.file_name(key))  # type: ignore[arg-type]
            payload = kv_file.read_payload(path, key, self.identity, self.page_bytes)
            if payload is None:
                raise RuntimeError(
                    f"the disk tier's page file {path} was damaged after it was verified; "
                    "the directory must be written by this server only"
                )
            raw[i * self.page_bytes : (i + 1) * self.page_bytes] = payload
        kv = torch.frombuffer(raw, dtype=torch.uint8).view(self.pool.storage_dtype)
        kv = kv.reshape(n, *self.page_shape)
        pages = self._index(job.load_pages, self.device)
        for j, layer in enumerate(layers):
            layer[pages] = kv[:, j].to(self.device, non_blocking=True)


def _serve(ref: weakref.ref[HostCache], jobs: queue.SimpleQueue[_Job | None]) -> None:
    """The copy thread: one ticket after the other, until told to stop."""
    while (job := jobs.get()) is not None:
        cache = ref()
        if cache is None:
            return
        cache._serve_one(job)
        del cache


def _bytes(kv: torch.Tensor) -> bytes:
    return kv.contiguous().view(torch.uint8).numpy().tobytes()


def _key(keys: bytes, i: int) -> bytes:
    return keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]

"""Pages written worker to worker with Mooncake's transfer engine (prefill/decode
disaggregation, docs/scale-out.md#prefilldecode-disaggregation).

``KVTransferAgent`` registers every layer of the worker's KV pool with a transfer
engine (TCP here; RDMA where the machine has it) started with peer-to-peer
handshakes, so no metadata server is needed. A decode worker only exposes its pool:
its ``descriptor()`` (the engine's session name, each layer's base address, the
bytes of one page) goes to its scheduler in ``ModelInfo.kv_transfer``, and from
there with each pull to the prefill side. A prefill worker executes the
``KVSend``s its scheduler puts in a step: for every layer, the runs of consecutive
pages are written into the remote pool with one batched write, in a thread of its
own, so steps go on while pages travel; each send is reported once, ``KVSent``,
with the next step's result.

Contract: the scheduler keeps a send's source pages locked until it is reported,
and the decode side keeps the destination pages out of its tree and out of every
other request until the pull is answered (``scheduler/disagg.py``), so no page is
read while it is rewritten nor written after it changed hands.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from radixserve.model_info import ModelInfo
from radixserve.protocol import KVSend, KVSent, Step, StepResult

log = logging.getLogger("radixserve.worker")

#: How the engines find each other: handshakes between the peers, no metadata server.
METADATA = "P2PHANDSHAKE"
PROTOCOLS = ("tcp", "rdma")


def _transfer_engine() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the optional extra
        raise RuntimeError(
            "--kv-transfer mooncake needs Mooncake's transfer engine: "
            "pip install 'radixserve[mooncake]' (and Debian's libibverbs1)"
        ) from e
    return TransferEngine()


def page_runs(src: Any, dst: Any) -> list[tuple[int, int, int]]:
    """``(first source page, first destination page, pages)`` runs where both sides
    are consecutive, in order: one write each instead of one per page."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(map(int, src), map(int, dst)):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            first_s, first_d, n = runs[-1]
            runs[-1] = (first_s, first_d, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


#: How long a step with nothing to compute waits for a send in flight (s), so a
#: scheduler waiting only on sends does not spin.
IDLE_WAIT = 0.05


def transfer_identity(info: ModelInfo, num_layers: int, page_bytes: int, key_tag: str = "") -> str:
    """What two pools must share for one's pages to be another's: the model, its
    dtype and KV dtype, the page layout, and (``key_tag``, ``KVPool.key_tag``) what
    the stored key rows are of the keys where it names a shift (fp8 pools,
    ``attention/key_shift.py``: pages written with one shift are wrong under another)."""
    kv = info.kv_dtype or info.dtype
    shift = key_tag if "key_shift=" in key_tag else ""
    return (
        f"{info.model_name};{info.dtype};{kv};page_size={info.page_size};{num_layers}x{page_bytes}"
        f"{';' + shift.rstrip(';') if shift else ''}"
    )


class KVTransferAgent:
    """The worker's pool, registered with a transfer engine; sends run in a thread."""

    def __init__(
        self,
        layers: list[torch.Tensor],
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        key_tag: str = "",
    ) -> None:
        """``key_tag``: the pool's ``KVPool.key_tag`` (part of ``transfer_identity``)."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"kv transfer protocol must be one of {PROTOCOLS}, got {protocol!r}")
        if not layers or any(not t.is_contiguous() for t in layers):
            raise ValueError("the KV pool's layers must be contiguous tensors")
        self.layers = layers
        self.key_tag = key_tag
        self.page_bytes = layers[0][0].nbytes  # one page of one layer: [2, page_size, heads, dim]
        self.engine = _transfer_engine()
        if self.engine.initialize(host, METADATA, protocol, device) != 0:
            raise RuntimeError(f"the transfer engine did not start on {host} ({protocol})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        for t in layers:
            if self.engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError("the transfer engine refused to register the KV pool")
        self._todo: queue.Queue[KVSend | None] = queue.Queue()
        self._done: list[KVSent] = []
        self._lock = threading.Condition()
        self._in_flight = 0
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()
        log.info("kv transfer: session %s, %d layers registered", self.session, len(layers))

    def descriptor(self, info: ModelInfo) -> dict[str, Any]:
        """What a peer needs to write into this pool (``ModelInfo.kv_transfer``)."""
        return {
            "session": self.session,
            "layers": [t.data_ptr() for t in self.layers],
            "page_bytes": self.page_bytes,
            "identity": transfer_identity(info, len(self.layers), self.page_bytes, self.key_tag),
        }

    def step(self, run: Any, step: Step) -> StepResult:
        """Run ``step`` with ``run`` (the runner's step), then queue its sends; the
        result reports the sends over (a step with nothing to compute waits a little
        for one in flight)."""
        result = run(step)
        self.submit(step.kv_sends)
        idle = not step.reqs and self.in_flight
        result.kv_sent = self.take_done(IDLE_WAIT if idle else 0.0)
        return result

    # ------------------------------------------------------------ sends
    def submit(self, sends: list[KVSend]) -> None:
        """Queue ``sends``; each is reported by ``take_done`` once over."""
        with self._lock:
            self._in_flight += len(sends)
        for send in sends:
            self._todo.put(send)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def take_done(self, wait: float = 0.0) -> list[KVSent]:
        """The sends over since the last call; with ``wait`` > 0 and sends in flight
        but none over, waits up to that many seconds for one."""
        with self._lock:
            if wait > 0 and not self._done and self._in_flight:
                self._lock.wait(wait)
            done, self._done = self._done, []
            return done

    def _run(self) -> None:
        while (send := self._todo.get()) is not None:
            try:
                self.write(send)
                sent = KVSent(send.ticket, True)
            except Exception as e:  # a peer gone, refused, timed out: the send failed
                log.warning("kv send %d to %s failed: %s", send.ticket, send.session, e)
                sent = KVSent(send.ticket, False, str(e))
            with self._lock:
                self._in_flight -= 1
                self._done.append(sent)
                self._lock.notify_all()

    def write(self, send: KVSend) -> None:
        """Write ``send``'s pages now (every layer, runs batched); raises on failure."""
        if send.page_bytes != self.page_bytes or len(send.dst_layers) != len(self.layers):
            raise RuntimeError(
                f"the remote pool's layout differs: {len(send.dst_layers)} layers of "
                f"{send.page_bytes}-byte pages, here {len(self.layers)} of {self.page_bytes}"
            )
        if time.monotonic() > send.deadline:  # the decode side gave up on these pages
            raise RuntimeError("the pull expired before its pages could be sent")
        pb = self.page_bytes
        runs = page_runs(send.src_pages, send.dst_pages)
        src, dst, lengths = [], [], []
        for local, remote in zip(self.layers, send.dst_layers):
            base = local.data_ptr()
            for s, d, n in runs:
                src.append(base + s * pb)
                dst.append(remote + d * pb)
                lengths.append(n * pb)
        if not lengths:
            return
        rc = self.engine.batch_transfer_sync_write(send.session, src, dst, lengths)
        if rc != 0:
            raise RuntimeError(f"the transfer engine's write to {send.session} failed ({rc})")

    def close(self) -> None:
        """Let the queued sends finish, then stop the thread."""
        self._todo.put(None)
        self._thread.join(timeout=30)

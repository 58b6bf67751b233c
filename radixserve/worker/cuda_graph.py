"""CUDA graphs for decode steps: one captured model forward per batch size.

A decode step launches a few hundred small kernels; at small batch sizes the
launches, not the math, set the step time. With graphs on the worker captures, at
start (after the warm-up), one graph of the whole model forward per capture size
(``capture_sizes``: 1, 2, 4, 8, then every 8 up to 256, capped at
``max_running_requests``, which is always one of them), largest first so the
smaller ones reuse its memory pool. A decode step
(every request one new token, every request sampling, nothing to score) pads its
batch to the smallest capture size that holds it and replays that graph; any other
step runs eagerly.

What a graph reads lives in static buffers, written before each replay without a
host sync: token ids, positions and the logits rows here, the attention page table
and positions in the backend (``FlashInferAttention.begin_graph_batch``, which
re-plans that size's CUDA-graph wrappers). Pad rows have token 0 at position 0
and attend to the pool page kept back for them; their logits are dropped.

The rotary tables are grown to the model's whole context before capture (an eager
forward at ``max_position``), so no replay can need a table the graph does not see.

``capturer_for(device)`` gives the capture function: ``torch.cuda.graph`` on CUDA,
None elsewhere (no graphs). Tests put an eager stand-in there (it returns the
function itself), which runs the same bookkeeping on CPU.

Whether graphs are on is decided in one place, ``GraphPlan``: on by default
(``WorkerConfig.disable_cuda_graph`` off), off with tensor parallelism (a captured
step would hold the ranks' collectives, and followers return no logits), for hybrid
models (their recurrent states are not among the captured inputs), on a device
without graphs, and with an attention backend that does not declare the
``captures_graphs`` capability (only flashinfer does; attention over a window pool,
``SplitAttention``, does not: its two page tables per request are not among the
captured inputs, and it says so); a device that has graphs but gets none logs why at
info. A backend asked for graphs it cannot capture refuses with a ValueError
(``AttentionBackend.setup_graphs``). A capture that fails (a model op that syncs the
host, say) is an error at start (``GraphCaptureError``): graphs were on, so serving
without them would be a silent change of the step times; ``disable_cuda_graph``
(``--disable-cuda-graph``) is the way to serve eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from radixserve.worker.attention.base import AttentionBackend, AttentionBatch
from radixserve.worker.attention.split import SplitAttention
from radixserve.worker.staging import Staging

log = logging.getLogger("radixserve.worker")

#: Largest batch size captured (beyond it decode runs eagerly; launches matter less there).
MAX_CAPTURE_SIZE = 256

Forward = Callable[[], torch.Tensor]
Capturer = Callable[[Forward], Forward]


class GraphCaptureError(RuntimeError):
    """Capturing the decode graphs failed while graphs were on."""


def no_graphs_reason(backend: AttentionBackend) -> str:
    """Why ``backend`` (which does not declare ``captures_graphs``) gets no graphs."""
    if isinstance(backend, SplitAttention):
        return SplitAttention.NO_GRAPHS
    return f"the {backend.name} attention backend cannot capture them"


def capture_sizes(max_running: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ... below ``min(max_running, limit)``, and that bound itself."""
    top = max(1, min(max_running, limit))
    ladder = [1, 2, 4, 8, *range(16, limit + 1, 8)]
    return tuple(sorted({s for s in ladder if s < top} | {top}))


def cuda_capturer(device: torch.device) -> Capturer:
    """Capture ``fn`` into a CUDA graph (after two eager runs on a side stream, which
    set up cuBLAS handles and workspaces); every graph shares one memory pool."""
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Forward) -> Forward:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


def capturer_for(device: torch.device) -> Capturer | None:
    """How to capture on ``device``: CUDA graphs on CUDA, none elsewhere."""
    return cuda_capturer(device) if device.type == "cuda" else None


class GraphPlan:
    """Whether this worker captures decode graphs, and why not (module docstring).

    Settled in two steps as the worker's parts are built: ``GraphPlan(...)`` before
    the attention backend exists (when graphs may be captured, the pool keeps
    ``pad_pages`` page back for the rows that pad a batch), ``settle(backend)`` once
    it does.
    """

    def __init__(self, device: torch.device, disabled: bool, tp: int, hybrid: bool) -> None:
        self.reason: str | None = None
        if disabled:
            self.reason = "disable_cuda_graph"
        elif tp > 1:
            self.reason = "not with tensor parallelism yet (a captured step would hold the "
            self.reason += "ranks' collectives, and followers return no logits)"
        elif hybrid:
            self.reason = "a hybrid model's recurrent states are not among the captured inputs"
        device_capturer = capturer_for(device)
        if device_capturer is None:
            self.reason = f"no CUDA graphs on {device.type}"
        #: How to capture (None: graphs off).
        self.capturer = device_capturer if self.reason is None else None
        self._has_graphs = device_capturer is not None
        self._asked_off = disabled

    @property
    def pad_pages(self) -> int:
        """Pages the pool holds beyond those the scheduler hands out (the pad page)."""
        return int(self.capturer is not None)

    def settle(self, backend: AttentionBackend) -> Capturer | None:
        """The capturer (graphs on) or None, now that ``backend`` is known; graphs off
        on a device that has them, other than by ``disable_cuda_graph``, are logged at
        info with the reason."""
        if self.capturer is not None and not backend.captures_graphs:
            self.capturer = None
            self.reason = no_graphs_reason(backend)
        if self.capturer is None and self._has_graphs and not self._asked_off:
            log.info("CUDA graphs off: %s", self.reason)
        return self.capturer


def capture(
    model: Callable[..., torch.Tensor],
    backend: AttentionBackend,
    capturer: Capturer,
    max_running: int,
    max_pages_per_slot: int,
    max_position: int,
    pad_page: int,
    device: torch.device,
) -> DecodeGraphs:
    """The decode graphs of ``model`` over ``backend``, one per capture size of
    ``max_running`` requests. ``GraphCaptureError`` when capture fails (graphs are on
    unless disabled, so the worker does not start without them); ValueError from a
    backend that cannot capture."""
    if not backend.captures_graphs:
        if isinstance(backend, SplitAttention):
            raise ValueError(f"no CUDA graphs: {SplitAttention.NO_GRAPHS}")
        raise ValueError(f"the {backend.name} attention backend cannot capture CUDA graphs")
    sizes = capture_sizes(max_running)
    try:
        backend.setup_graphs(sizes, max_pages_per_slot, pad_page=pad_page)
        graphs = DecodeGraphs(model, backend, sizes, max_position, device, capturer)
        with torch.inference_mode():
            graphs.capture()
    except Exception as e:
        raise GraphCaptureError(
            f"CUDA graph capture failed ({type(e).__name__}: {e}); run with "
            "--disable-cuda-graph (disable_cuda_graph) to serve every step eagerly"
        ) from e
    log.info("CUDA graphs captured for decode batch sizes %s", list(sizes))
    return graphs


class DecodeGraphs:
    """The captured decode forwards of one model and one backend that declares
    ``captures_graphs``."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        backend: AttentionBackend,
        sizes: tuple[int, ...],
        max_position: int,
        device: torch.device,
        capturer: Capturer,
    ) -> None:
        self.sizes = tuple(sorted(sizes))
        self._model, self._backend, self._max_position = model, backend, max_position
        n = max(self.sizes)
        i64 = {"dtype": torch.int64, "device": device}
        self._ids = torch.zeros(n, **i64)
        self._positions = torch.zeros(n, **i64)
        self._rows = torch.arange(n, **i64)  # every row's logits (pad rows' are dropped)
        self._staging = Staging(device, torch.int64)
        self._capturer = capturer
        self._graphs: dict[int, Forward] = {}
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # for tests and stats

    def capture(self) -> None:
        """Capture every size, largest first (an all-padding batch plans each one)."""
        empty = AttentionBatch(
            qo_indptr=np.zeros(1, np.int32), kv_lens=np.zeros(0, np.int32),
            page_indptr=np.zeros(1, np.int32), page_indices=np.zeros(0, np.int32),
        )  # fmt: skip
        for size in sorted(self.sizes, reverse=True):
            self._backend.begin_graph_batch(empty, size)
            self._fill(np.zeros(0, np.int64), np.zeros(0, np.int64), size)
            self._graphs[size] = self._capturer(self._forward(size))

    def _forward(self, size: int) -> Forward:
        def forward() -> torch.Tensor:
            return self._model(
                self._ids[:size], self._positions[:size], self._max_position,
                self._backend, self._rows[:size],
            )  # fmt: skip

        return forward

    def size_for(self, batch_size: int) -> int | None:
        """The capture size a decode batch of ``batch_size`` pads to (None: runs eagerly)."""
        return next((s for s in self.sizes if s >= batch_size), None)

    def _fill(self, ids: np.ndarray, positions: np.ndarray, size: int) -> None:
        pad = np.zeros(size - len(ids), np.int64)
        host_ids, host_pos = self._staging.host([np.concatenate([ids, pad]),
                                                 np.concatenate([positions, pad])])  # fmt: skip
        self._ids[:size].copy_(host_ids, non_blocking=True)
        self._positions[:size].copy_(host_pos, non_blocking=True)
        self._staging.record()

    def run(self, batch: AttentionBatch, ids: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Logits [batch_size, vocab] of a decode batch, by replaying its size's graph.
        The tensor is the graph's own output: valid until the next replay."""
        size = self.size_for(batch.batch_size)
        if size is None:
            raise ValueError(f"no captured size holds a batch of {batch.batch_size}")
        self._backend.begin_graph_batch(batch, size)
        self._fill(ids.astype(np.int64), positions.astype(np.int64), size)
        self.replays[size] += 1
        return self._graphs[size]()[: batch.batch_size]

"""The worker's configuration: one frozen dataclass, built once and passed down."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    """How to build a ``ModelRunner``.

    model: ``"smollm2"`` / None (the embedded model), an HF folder, or a .gguf file.
    dtype: ``float32``, ``bfloat16`` or ``float64`` (float64: torch backend only, for tests).
    attention_backend: ``auto`` (flashinfer where it can run the model, else torch),
    ``torch`` or ``flashinfer`` (ValueError saying why when it cannot run).
    decode_kernel: the torch backend's decode attention: ``native`` (csrc/, reads
    pages in place; CPU, float32/float64/bfloat16), ``torch`` (gather + SDPA), or
    ``auto`` (native where it runs).
    num_pages / kv_memory: the KV pool size as a page count, else as a byte budget,
    else ``kv_pool.DEFAULT_KV_MEMORY`` bytes.
    max_running_requests: number of request slots (0 .. max_running_requests - 1).
    cache_dir: where converted models are cached (default: $RADIXSERVE_CACHE_DIR,
    else ~/.cache/radixserve).
    seed: seeds requests that bring no seed of their own.
    """

    model: str | None = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 1
    num_pages: int | None = None
    kv_memory: int | None = None
    max_running_requests: int = 64
    attention_backend: str = "auto"
    decode_kernel: str = "auto"
    cache_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_memory is not None and self.kv_memory < 1:
            raise ValueError(f"kv_memory must be a positive byte count, got {self.kv_memory}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")

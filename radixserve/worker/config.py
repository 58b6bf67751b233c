"""The worker's configuration: one frozen dataclass, built once and passed down."""

from __future__ import annotations

from dataclasses import dataclass

#: ``auto`` resolves when the model loads (``worker/dtype.py``).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")
#: FlashInfer's prefill implementations: ``auto`` is fa3 on Hopper where it applies, else fa2.
PREFILL_BACKENDS = ("auto", "fa2", "fa3")


#: What ``--kv-cache-dtype`` takes (``kv_quant.py``); here, where no torch is imported.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(frozen=True)
class WorkerConfig:
    """How to build a ``ModelRunner``.

    model: ``"smollm2"`` / None (the embedded model), an HF folder, or a .gguf file.
    dtype: ``auto`` (bfloat16 on CPUs with AVX512_BF16 or AMX, else float32; on CUDA the
    checkpoint's half dtype: ``dtype.py``), ``float32``, ``bfloat16``, ``float16`` or
    ``float64`` (float64: torch backend only, for tests).
    attention_backend: ``auto`` (flashinfer where it can run the model, else torch),
    ``torch`` or ``flashinfer`` (ValueError saying why when it cannot run).
    decode_kernel: the torch backend's decode attention: ``native`` (csrc/, reads
    pages in place; CPU, float32/float64/bfloat16), ``torch`` (gather + SDPA), or
    ``auto`` (native where it runs).
    num_pages / kv_memory: the KV pool size as a page count, else as a byte budget,
    else ``kv_pool.DEFAULT_KV_MEMORY`` bytes.
    kv_cache_dtype: what the KV pool stores (``kv_quant.py``): ``auto`` (the model's
    dtype), ``bfloat16``, ``float32``, or ``int8`` / ``fp8_e4m3`` / ``fp8_e5m2`` codes
    with a float16 scale per token and kv head (about half of bfloat16's bytes: a byte
    budget then holds about twice the pages).
    max_running_requests: number of request slots (0 .. max_running_requests - 1).
    cache_dir: where converted models are cached (default: $RADIXSERVE_CACHE_DIR,
    else ~/.cache/radixserve).
    seed: seeds requests that bring no seed of their own.
    malloc_tuning: fix glibc's malloc policy at start so step buffers stay mapped
    (``malloc.py``).
    warmup: before serving, run a prefill of ``chunked_prefill_size`` tokens (the
    largest the scheduler sends) and a decode step of every slot
    (``ModelRunner.warmup``).
    grammar_cache_size: compiled grammars kept for reuse once no request uses
    them (an LRU; docs/structured.md).
    jump_forward: append the tokens a grammar forces without sampling them one
    by one (docs/structured.md).
    tp: tensor-parallel ranks, one process each (docs/parallel.md); the KV budget
    (``kv_memory``) is then per rank.
    dist_timeout: seconds a tensor-parallel collective (or the group's start) may
    take before the rank fails.
    threads: torch CPU threads of each worker rank (the native kernels' OpenMP
    regions use as many); 0: torch's default with one rank (one fewer on the CPU
    during steps while the cache tiers' copy thread has work), ``cores // tp`` with
    several.
    disable_cuda_graph: run decode steps eagerly instead of replaying CUDA graphs
    (graphs are used on CUDA with the flashinfer backend only; ``cuda_graph.py``).
    host_cache_gb: the host tier of the KV cache (docs/cache-tiers.md), GiB of host
    memory (pinned on CUDA; per rank with ``tp`` > 1) holding pages evicted from the
    pool; 0: no tiers.
    disk_cache_dir: the disk tier's directory (page files that survive restarts);
    needs a host tier; not with ``tp`` > 1 yet.
    deterministic: batch-invariant steps (``layers/invariant.py``, docs/deterministic.md,
    "Deterministic mode"): a row's logits depend only on its own tokens, not on its
    batch, its chunking or the cache; CPU only, the native kernels required.
    lora_modules: LoRA adapters (PEFT folders) loaded at start, ``name=path`` each, as
    adapter ids 1, 2, ... in that order (docs/lora.md).
    max_lora_rank: the highest adapter rank accepted (a higher one is refused).
    state_snapshots: a hybrid model's recurrent-state snapshots the prefix cache may
    keep (each one request's state, ``ModelInfo.state_bytes``); None:
    ``max_running_requests``. Ignored for other models.
    sliding_pool_pages: models with sliding-window layers: the pages of the window
    pool that holds those layers' K/V (docs/models.md, "Sliding windows and the
    cache"); None: sized from the budget (``kv_pool.SLIDING_POOL_RATIO`` of the full pool's
    tokens, at least what the running requests' windows need); 0: one pool for
    every layer (as models without sliding layers). CPU only for now.
    flashinfer_prefill_backend: the flashinfer backend's prefill kernels, ``auto``
    (FlashInfer's choice: fa3 on Hopper), ``fa2`` or ``fa3``. Without prebuilt kernels
    (flashinfer-jit-cache) fa3 takes far longer to JIT-build at start than fa2.
    """

    model: str | None = "smollm2"
    dtype: str = "auto"
    device: str = "cpu"
    page_size: int = 1
    num_pages: int | None = None
    kv_memory: int | None = None
    kv_cache_dtype: str = "auto"
    max_running_requests: int = 64
    attention_backend: str = "auto"
    decode_kernel: str = "auto"
    cache_dir: str | None = None
    seed: int = 0
    malloc_tuning: bool = True
    warmup: bool = True
    chunked_prefill_size: int = 2048  # the scheduler's (SchedulerConfig), read for the warm-up
    grammar_cache_size: int = 64
    jump_forward: bool = True
    tp: int = 1
    dist_timeout: float = 120.0
    threads: int = 0
    disable_cuda_graph: bool = False
    flashinfer_prefill_backend: str = "auto"
    host_cache_gb: float = 0.0
    disk_cache_dir: str | None = None
    deterministic: bool = False
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 64
    state_snapshots: int | None = None
    sliding_pool_pages: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_pool_pages is not None and self.sliding_pool_pages < 0:
            raise ValueError(f"sliding_pool_pages must be >= 0, got {self.sliding_pool_pages}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        parse_lora_modules(self.lora_modules)
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_memory is not None and self.kv_memory < 1:
            raise ValueError(f"kv_memory must be a positive byte count, got {self.kv_memory}")
        if self.flashinfer_prefill_backend not in PREFILL_BACKENDS:
            raise ValueError(
                f"unknown flashinfer prefill backend {self.flashinfer_prefill_backend!r}; "
                f"choose from {PREFILL_BACKENDS}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; choose from {KV_CACHE_DTYPES}"
            )
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose from {DTYPE_CHOICES}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.grammar_cache_size < 0:
            raise ValueError(f"grammar_cache_size must be >= 0, got {self.grammar_cache_size}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.host_cache_gb < 0:
            raise ValueError(f"host_cache_gb must be >= 0, got {self.host_cache_gb}")
        if self.disk_cache_dir is not None and not self.host_cache_gb:
            raise ValueError(
                "--disk-cache-dir needs a host tier (--host-cache-gb > 0): pages reach "
                "the disk through host memory"
            )
        if self.tp > 1 and self.disk_cache_dir is not None:
            raise ValueError(
                "the disk tier (--disk-cache-dir) does not support tensor parallelism yet "
                "(--tp > 1); the host tier does"
            )
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.dist_timeout <= 0:
            raise ValueError(f"dist_timeout must be > 0 seconds, got {self.dist_timeout}")
        if self.state_snapshots is not None and self.state_snapshots < 1:
            raise ValueError(f"state_snapshots must be >= 1, got {self.state_snapshots}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")


def parse_lora_modules(specs: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """``name=path`` entries as (name, path) pairs; ValueError on a malformed entry or a
    name given twice."""
    out: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = str(spec).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"a LoRA module is given as name=path, got {spec!r}")
        if name in (n for n, _ in out):
            raise ValueError(f"LoRA module name {name!r} is given twice")
        out.append((name.strip(), path.strip()))
    return out

"""The worker's configuration: one frozen dataclass, built once and passed down."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.combinations import check_features, features_on
from radixserve.options import (
    PARALLEL,
    STRUCTURED,
    SharedOptions,
    check_options,
    option,
    parse_size,
)

#: ``auto`` resolves when the model loads (``worker/dtype.py``).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "float64")
#: FlashInfer's prefill implementations: ``auto`` is fa3 on Hopper where it applies, else fa2.
PREFILL_BACKENDS = ("auto", "fa2", "fa3")


#: What ``--kv-cache-dtype`` takes (``kv_quant.py``); here, where no torch is imported.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "int8")
#: How the torch backend computes decode attention (``attention/torch_backend.py``):
#: ``native`` reads pages in place (csrc/, float32/float64/bfloat16 on the CPU),
#: ``torch`` gathers them and runs SDPA; ``auto`` is native where it can run.
DECODE_KERNELS = ("auto", "native", "torch")


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


@dataclass(frozen=True, kw_only=True)
class WorkerOptions(SharedOptions):
    """The worker's options (each one's help says what it does; docs/worker.md).

    Beyond the flags' help, for the library: ``model`` None is the embedded model too.
    ``num_pages`` / ``kv_memory``: the KV pool as a page count, else as a byte budget,
    else ``kv_pool.DEFAULT_KV_MEMORY`` bytes. ``dtype`` float64 runs on the torch
    backend only (tests). ``max_running_requests`` is the slots 0 .. N - 1.
    ``warmup`` runs a prefill of ``chunked_prefill_size`` tokens (the largest the
    scheduler sends) and a decode step of every slot (``ModelRunner.warmup``).
    ``host_cache_gb`` is per rank with ``tp`` > 1. ``deterministic``: a row's logits
    depend only on its own tokens (``layers/invariant.py``), the native kernels
    required. ``lora_modules`` become adapter ids 1, 2, ... in their order.
    ``state_snapshots``: each one request's state (``ModelInfo.state_bytes``); ignored
    for models that are not hybrid. ``sliding_pool_pages`` None: sized from the budget
    (``kv_pool.SLIDING_POOL_RATIO`` of the full pool's tokens, at least what the
    running requests' windows need); CPU only for now.
    """

    model: str | None = option(
        "smollm2",
        "'smollm2' (the embedded SmolLM2-135M-Instruct), an HF folder, or a .gguf file",
    )
    dtype: str = option(
        "auto",
        "auto: bfloat16 on CPUs with AVX512_BF16/AMX, else float32; on CUDA the model's",
        choices=DTYPE_CHOICES,
    )
    device: str = option("cpu", "torch device of the worker")
    page_size: int = option(1, "tokens per KV page", at_least=1)
    num_pages: int | None = option(None, "KV pool size in pages", at_least=1)
    kv_memory: int | None = option(
        None,
        "KV pool size in bytes (e.g. 2GiB); without this or --num-pages: 1 GiB",
        at_least=1,
        parse=parse_size,
    )
    kv_cache_dtype: str = option(
        "auto",
        "what the KV pool stores: auto (the model's dtype), bfloat16, float32, or "
        "int8/fp8_e4m3/fp8_e5m2 codes with a scale per token and kv head (about twice the "
        "tokens per GiB; the banner prints tokens_per_gib)",
        choices=KV_CACHE_DTYPES,
    )
    attention_backend: str = option(
        "auto",
        "auto (flashinfer on CUDA when its start-up probe passes, else torch) | torch "
        "| flashinfer (fails at start, with the reason, when it cannot run)",
    )
    decode_kernel: str = option(
        "auto",
        "torch backend's decode attention: native (reads KV pages in place; CPU, "
        "float32/float64/bfloat16) or torch (gather + SDPA); auto: native where it runs",
        choices=DECODE_KERNELS,
    )
    cache_dir: str | None = option(
        None,
        "converted-model cache dir (default: $RADIXSERVE_CACHE_DIR or ~/.cache/radixserve)",
    )
    seed: int = option(0, "seeds requests that bring no seed")
    malloc_tuning: bool = option(
        True, "fix glibc's malloc policy in the worker so step buffers stay mapped"
    )
    warmup: bool = option(True, "run a largest-chunk prefill and a full decode step before serving")
    grammar_cache_size: int = option(
        64,
        "compiled grammars kept for reuse once no request uses them",
        at_least=0,
        group=STRUCTURED,
    )
    jump_forward: bool = option(
        True,
        "append the tokens a grammar forces without sampling them one by one",
        group=STRUCTURED,
    )
    tp: int = option(
        1,
        "tensor-parallel ranks: the model split over N worker processes (gloo on the "
        "CPU, NCCL on CUDA, one device each); --kv-memory is then per rank",
        at_least=1,
        group=PARALLEL,
    )
    dist_timeout: float = option(
        120.0,
        "seconds a tensor-parallel collective may take before its rank fails (and "
        "the server with it); also how long the ranks wait for each other at start",
        above=0.0,
        group=PARALLEL,
    )
    threads: int = option(
        0,
        "torch CPU threads per worker rank; 0: torch's default with one rank (one "
        "fewer on the CPU during steps while the cache tiers' copy thread has work), "
        "cores // --tp with several",
        at_least=0,
        group=PARALLEL,
    )
    disable_cuda_graph: bool = option(
        False,
        "run decode steps eagerly instead of replaying CUDA graphs (graphs: CUDA "
        "with the flashinfer backend only)",
        negatable=False,
    )
    flashinfer_prefill_backend: str = option(
        "auto",
        "flashinfer's prefill kernels: auto (fa3 on Hopper, else fa2), fa2 or fa3; "
        "fa2 JIT-builds much faster where no prebuilt kernels are installed",
        choices=PREFILL_BACKENDS,
    )
    state_snapshots: int | None = option(
        None,
        "hybrid models: recurrent-state snapshots the prefix cache may keep, each "
        "one request's state (default: --max-running-requests)",
        at_least=1,
    )
    sliding_pool_pages: int | None = option(
        None,
        "models with sliding-window layers: pages of the window pool holding those "
        "layers' K/V (default: sized from the KV budget; 0: one pool for every layer)",
        at_least=0,
    )
    host_cache_gb: float = option(
        0.0,
        "the KV cache's host tier: GiB of host memory (pinned on CUDA) that keeps "
        "pages evicted from the pool and gives them back on a hit; 0: off",
        at_least=0.0,
    )
    deterministic: bool = option(
        False,
        "batch-invariant steps: the same tokens and logprobs for a request whatever "
        "its batch, chunking or cache hits (CPU; costs step time: docs/deterministic.md)",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters (PEFT folders: adapter_config.json + adapter_model.safetensors) "
        "served beside the base model; a request picks one by name (HTTP: the model "
        "field) (docs/lora.md)",
        check=parse_lora_modules,
        metavar="NAME=PATH",
    )
    max_lora_rank: int = option(
        64, "the highest LoRA rank accepted; an adapter above it is refused", at_least=1
    )
    encoder_cache_mb: float = option(
        256.0,
        "vision-language models: MiB of image features kept by image content, so a "
        "repeated image does not run the vision encoder again (LRU; 0: off)",
        at_least=0.0,
    )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(WorkerOptions):
    """How to build a ``ModelRunner``: the worker's options, checked."""

    def __post_init__(self) -> None:
        check_options(self)
        # What combines with what: combinations.py's table.
        check_features(
            features_on(
                host_tier=bool(self.host_cache_gb),
                disk_tier=self.disk_cache_dir is not None,
                kv_store=self.kv_store is not None,
                tensor_parallel=self.tp > 1,
            )
        )

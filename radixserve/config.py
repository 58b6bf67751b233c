"""The options of an Engine or a server, in one place, and what each part gets from them.

``EngineConfig`` is the one frozen dataclass a user fills: the in-process
``Engine`` builds it from its keyword arguments, ``radixserve launch`` from its
flags (``cli.py``; every field has a flag). Each library keeps its own config,
so it can be built alone in tests (``WorkerConfig`` in ``worker/config.py``,
``SchedulerConfig`` in ``scheduler/config.py``, ``TokenizerConfig`` in
``tokenizer/config.py``); they are derived from an ``EngineConfig`` by field
name (``worker_config``, ``scheduler_config``, ``tokenizer_config``), and
``EngineConfig``'s defaults are those configs' defaults, so no value is
declared twice. ``ModelInfo`` is what the worker reports once its model is
loaded (``model_info.py``, re-exported here); the scheduler's page count, context
length and EOS ids come from it.

This module holds data only: it imports the libraries' config modules and nothing
that runs. The parts are put together above it (``compose.py``: ``build_worker``,
``build_scheduler``), so the libraries' processes may import this module without
a loop. It imports no torch: the launcher, the CLI and every process import it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from radixserve.model_info import ModelInfo
from radixserve.scheduler.combinations import check_features, features_on
from radixserve.scheduler.config import SchedulerConfig
from radixserve.tokenizer.config import TokenizerConfig
from radixserve.worker.config import WorkerConfig

__all__ = [
    "MODEL_FIELDS",
    "EngineConfig",
    "ModelInfo",
    "scheduler_config",
    "tokenizer_config",
    "worker_config",
]

_W, _S, _T = WorkerConfig, SchedulerConfig, TokenizerConfig


@dataclass(frozen=True)
class EngineConfig:
    """Every option of the Engine and of ``radixserve launch`` (docs/serving.md lists the
    flags, docs/worker.md and docs/scheduler.md what they do)."""

    # The worker (WorkerConfig).
    model: str | None = _W.model
    dtype: str = _W.dtype
    device: str = _W.device
    page_size: int = _W.page_size
    num_pages: int | None = _W.num_pages
    kv_memory: int | None = _W.kv_memory
    kv_cache_dtype: str = _W.kv_cache_dtype
    max_running_requests: int = _W.max_running_requests
    attention_backend: str = _W.attention_backend
    decode_kernel: str = _W.decode_kernel
    cache_dir: str | None = _W.cache_dir
    seed: int = _W.seed
    malloc_tuning: bool = _W.malloc_tuning
    warmup: bool = _W.warmup
    grammar_cache_size: int = _W.grammar_cache_size
    jump_forward: bool = _W.jump_forward
    tp: int = _W.tp
    dist_timeout: float = _W.dist_timeout
    threads: int = _W.threads
    disable_cuda_graph: bool = _W.disable_cuda_graph
    flashinfer_prefill_backend: str = _W.flashinfer_prefill_backend
    state_snapshots: int | None = _W.state_snapshots
    sliding_pool_pages: int | None = _W.sliding_pool_pages
    host_cache_gb: float = _W.host_cache_gb
    disk_cache_dir: str | None = _W.disk_cache_dir  # the scheduler's too
    deterministic: bool = _W.deterministic
    lora_modules: tuple[str, ...] = _W.lora_modules
    max_lora_rank: int = _W.max_lora_rank
    # The scheduler (SchedulerConfig; page_size and max_running_requests above too;
    # the worker reads chunked_prefill_size for its warm-up).
    cache: str = _S.cache
    radix_impl: str = _S.radix_impl
    chunked_prefill_size: int = _S.chunked_prefill_size
    decode_step_tokens: int = _S.decode_step_tokens
    schedule_policy: str = _S.schedule_policy
    lpm_max_waiting: int = _S.lpm_max_waiting
    max_wait_steps: int = _S.max_wait_steps
    decode_reserve_ratio: float = _S.decode_reserve_ratio
    decode_reserve_min_ratio: float = _S.decode_reserve_min_ratio
    decode_reserve_decay_steps: int = _S.decode_reserve_decay_steps
    max_admit_skips: int = _S.max_admit_skips
    max_preemptions: int = _S.max_preemptions
    radix_eviction_policy: str = _S.radix_eviction_policy
    max_retained_share: float = _S.max_retained_share
    shared_prefix_min_tokens: int = _S.shared_prefix_min_tokens
    speculative_algorithm: str = _S.speculative_algorithm
    speculative_num_draft_tokens: int = _S.speculative_num_draft_tokens
    speculative_min_match: int = _S.speculative_min_match
    speculative_max_batch: int = _S.speculative_max_batch
    disk_cache_gb: float = _S.disk_cache_gb
    max_loras: int = _S.max_loras
    # The tokenizer (TokenizerConfig): limits on input (docs/security.md), chat parsing.
    max_message_bytes: int = _T.max_message_bytes
    max_queued_replies: int = _T.max_queued_replies
    max_requests_per_client: int = _T.max_requests_per_client
    max_prompt_chars: int = _T.max_prompt_chars
    max_prompt_tokens: int | None = _T.max_prompt_tokens
    max_stop: int = _T.max_stop
    max_stop_len: int = _T.max_stop_len
    max_n: int = _T.max_n
    chat_special_tokens: bool = _T.chat_special_tokens

    def __post_init__(self) -> None:
        # The cache features' combinations (combinations.py), refused before any
        # process or model starts (the libraries' configs check them again when built
        # alone).
        check_features(
            features_on(
                no_cache=self.cache == "none",
                host_tier=self.host_cache_gb > 0,
                disk_tier=self.disk_cache_dir is not None,
                tensor_parallel=self.tp > 1,
            )
        )


#: SchedulerConfig fields that come from the loaded model, not from the user.
MODEL_FIELDS = (
    "num_pages",
    "page_size",
    "max_context_len",
    "eos_token_ids",
    "host_pages",
    "page_bytes",
    "kv_identity",
    "loras",
    "state_snapshots",
    "window_pages",
    "window_span",
)

_C = TypeVar("_C")


def _derive(cls: type[_C], config: EngineConfig, **given: Any) -> _C:
    """``cls`` built from the fields of ``config`` it shares by name, plus ``given``."""
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    shared = {f.name: getattr(config, f.name) for f in fields(config) if f.name in names}
    return cls(**{**shared, **given})


def worker_config(config: EngineConfig) -> WorkerConfig:
    return _derive(WorkerConfig, config)


def tokenizer_config(config: EngineConfig) -> TokenizerConfig:
    return _derive(TokenizerConfig, config)


def scheduler_config(config: EngineConfig, info: ModelInfo) -> SchedulerConfig:
    if info.page_size != config.page_size:
        raise ValueError(f"the worker's page size {info.page_size} != {config.page_size}")
    check_features(
        features_on(
            recurrent_states=info.state_snapshots > 0,
            host_tier=config.host_cache_gb > 0,
            speculation=config.speculative_algorithm != "off",
            lora=bool(info.loras),
        ),
        model=info.model_name,
    )
    return _derive(SchedulerConfig, config, **{n: getattr(info, n) for n in MODEL_FIELDS})

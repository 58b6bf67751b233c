"""The options of an Engine or a server, in one place, and what each part gets from them.

``EngineConfig`` is the one frozen dataclass a user fills: the in-process
``Engine`` builds it from its keyword arguments, ``radixserve launch`` from its
flags (``launch_flags.py`` derives one flag per field). Each library declares
its own options, once, with their help, choices and ranges (``options.py``:
``WorkerOptions`` in ``worker/config.py``, ``SchedulerOptions`` in
``scheduler/config.py``, ``TokenizerOptions`` in ``tokenizer/config.py``,
``SharedOptions`` those of both the worker and the scheduler), and keeps its own
config, so it can be built alone in tests (``WorkerConfig``, ``SchedulerConfig``,
``TokenizerConfig``); ``EngineConfig`` inherits every library's options, and the
libraries' configs are derived from it by field name (``worker_config``,
``scheduler_config``, ``tokenizer_config``). ``ModelInfo`` is what the worker reports once its model is
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

from radixserve.combinations import check_features, features_on
from radixserve.model_info import ModelInfo
from radixserve.scheduler.config import SchedulerConfig, SchedulerOptions
from radixserve.tokenizer.config import TokenizerConfig, TokenizerOptions
from radixserve.utils.kv_store import StoreConfig, parse_store_url
from radixserve.worker.config import WorkerConfig, WorkerOptions

__all__ = [
    "MODEL_FIELDS",
    "EngineConfig",
    "ModelInfo",
    "scheduler_config",
    "tokenizer_config",
    "worker_config",
]


@dataclass(frozen=True, kw_only=True)
class EngineConfig(TokenizerOptions, SchedulerOptions, WorkerOptions):
    """Every option of the Engine and of ``radixserve launch``: the libraries' options,
    inherited, each declared once where its library declares it (``options.py``;
    docs/serving.md lists the flags, docs/worker.md and docs/scheduler.md what they
    do). Fields in order: the options shared by the worker and the scheduler, the
    worker's, the scheduler's, the tokenizer's."""

    def __post_init__(self) -> None:
        # The cache features' combinations (combinations.py), refused before any
        # process or model starts (the libraries' configs check them again when built
        # alone).
        check_features(
            features_on(
                no_cache=self.cache == "none",
                host_tier=self.host_cache_gb > 0,
                disk_tier=self.disk_cache_dir is not None,
                kv_store=self.kv_store is not None,
                tensor_parallel=self.tp > 1,
            )
        )
        if self.kv_store is not None:  # malformed settings fail here, before any process starts
            parse_store_url(self.kv_store)
            StoreConfig.parse(self.kv_store_config)


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
            kv_store=config.kv_store is not None,
            speculation=config.speculative_algorithm != "off",
            lora=bool(info.loras),
        ),
        model=info.model_name,
    )
    return _derive(SchedulerConfig, config, **{n: getattr(info, n) for n in MODEL_FIELDS})

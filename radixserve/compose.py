"""Where the parts are put together: the worker and the scheduler built from an
``EngineConfig``.

The in-process ``Engine`` and the server's processes (``worker/process.py``,
``scheduler/process.py``) call these, so both build the same parts the same way.
They sit above the config (data only) and the libraries they build, and import
their library when called: the worker's imports torch, and the scheduler's
process never imports the worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.config import EngineConfig, ModelInfo, scheduler_config, worker_config

if TYPE_CHECKING:
    from radixserve.scheduler.scheduler import Scheduler
    from radixserve.worker.model_runner import ModelRunner


def build_worker(config: EngineConfig, tokenizer: Any = None, comm: Any = None) -> ModelRunner:
    """The worker's ``ModelRunner`` (loads the model; imports torch), its parts
    built by ``worker/build.py``. ``tokenizer``: the model's, if loaded already
    (structured output needs it). ``comm``: this rank's tensor-parallel group
    (``worker/tp.py``), for a rank of a server. Without it and with ``tp > 1`` (the
    in-process Engine): a ``WorkerGroup``, rank 0 here and the other ranks as child
    processes, behind the same interface."""
    from radixserve.worker.build import build_runner

    if comm is not None:
        return build_runner(worker_config(config), tokenizer, comm)
    if config.tp > 1:
        from radixserve.worker.tp import WorkerGroup

        return WorkerGroup(config, tokenizer)  # type: ignore[return-value]
    return build_runner(worker_config(config), tokenizer)


def build_scheduler(config: EngineConfig, info: ModelInfo) -> Scheduler:
    """A ``Scheduler`` over the pool the worker reported in ``info``."""
    from radixserve.scheduler.scheduler import Scheduler

    return Scheduler(scheduler_config(config, info))

"""centralpipe: PyTorch data loading whose state lives in the main process.

Stateful stages run in the main process behind a round-robin dispatch
boundary; worker processes only run stateless per-item functions. So
checkpoints are exact and instant, state is queryable live, and output is the
same for any number of workers.

The public names are imported on first use (PEP 562): a worker process
imports ``centralpipe.dispatch.worker.loop`` without the builder, the central
stages or torch, which a worker needs only if its functions or items do
(see :mod:`centralpipe.dispatch.executors.preload`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from centralpipe import _moved

if TYPE_CHECKING:
    from centralpipe import packing as packing
    from centralpipe.checkpoint.elastic import merge_states
    from centralpipe.checkpoint.gather import gather_states
    from centralpipe.config import DistributedConfig, LoaderConfig, WorkerConfig
    from centralpipe.errors import (
        CentralpipeError,
        CheckpointError,
        ConfigError,
        PipelineError,
        ServiceError,
        WorkerError,
    )
    from centralpipe.integrations.progress import progress
    from centralpipe.loader import Loader
    from centralpipe.plan.pipeline import Pipeline
    from centralpipe.stages.totals import Total

__all__ = [
    "CentralpipeError",
    "CheckpointError",
    "ConfigError",
    "DistributedConfig",
    "Loader",
    "LoaderConfig",
    "Pipeline",
    "PipelineError",
    "ServiceError",
    "Total",
    "WorkerConfig",
    "WorkerError",
    "gather_states",
    "merge_states",
    "progress",
]

__version__ = "0.1.0"

#: Where each public name lives; ``packing`` is a submodule.
_HOMES = {
    "CentralpipeError": "centralpipe.errors",
    "CheckpointError": "centralpipe.errors",
    "ConfigError": "centralpipe.errors",
    "DistributedConfig": "centralpipe.config",
    "Loader": "centralpipe.loader",
    "LoaderConfig": "centralpipe.config",
    "Pipeline": "centralpipe.plan.pipeline",
    "PipelineError": "centralpipe.errors",
    "ServiceError": "centralpipe.errors",
    "Total": "centralpipe.stages.totals",
    "WorkerConfig": "centralpipe.config",
    "WorkerError": "centralpipe.errors",
    "gather_states": "centralpipe.checkpoint.gather",
    "merge_states": "centralpipe.checkpoint.elastic",
    "packing": "centralpipe.packing",
    "progress": "centralpipe.integrations.progress",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'centralpipe' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if name == "packing" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


# Old module paths import their module from its new path (:mod:`centralpipe._moved`).
_moved.install()

"""centralpipe: PyTorch data loading whose state lives in the main process.

Stateful stages run in the main process behind a round-robin dispatch
boundary; worker processes only run stateless per-item functions. So
checkpoints are exact and instant, state is queryable live, and output is the
same for any number of workers.
"""

from centralpipe import packing as packing
from centralpipe.config import DistributedConfig, LoaderConfig, WorkerConfig
from centralpipe.distributed import gather_states
from centralpipe.elastic import merge_states
from centralpipe.errors import (
    CentralpipeError,
    CheckpointError,
    ConfigError,
    PipelineError,
    WorkerError,
)
from centralpipe.loader import Loader
from centralpipe.pipeline import Pipeline
from centralpipe.progress import progress
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
    "Total",
    "WorkerConfig",
    "WorkerError",
    "gather_states",
    "merge_states",
    "progress",
]

__version__ = "0.1.0"

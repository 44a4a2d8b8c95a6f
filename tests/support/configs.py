"""The LoaderConfig most tests build: fork workers (lambdas allowed), explicit
buffer, chunk size, seed and rank."""

from __future__ import annotations

import centralpipe as cp


def loader_config(
    *,
    num_workers: int = 0,
    buffer_size: int | None = 4096,
    chunk_size: int | None = None,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    executor: str = "process",
) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=num_workers,
            buffer_size=buffer_size,
            chunk_size=chunk_size,
            start_method="fork",
            executor=executor,
        ),
        distributed=cp.DistributedConfig(rank=rank, world_size=world_size),
        seed=seed,
    )


#: Environment variables that launchers set and ``DistributedConfig.from_env()``
#: reads; tests clear them so the machine's environment cannot leak in.
LAUNCHER_ENV_NAMES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "SLURM_NNODES",
)

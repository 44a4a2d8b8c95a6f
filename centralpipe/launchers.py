"""This process's rank under any launcher, and the guard against duplicated data.

Launchers tell a process its place in different ways:

- an initialised ``torch.distributed`` process group (any launcher, once the
  training script or framework called ``init_process_group``) — the truth;
- torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK`` (the node);
- Lightning's own launcher (``strategy="ddp"`` from a script): ``WORLD_SIZE``,
  ``LOCAL_RANK`` and ``NODE_RANK`` but *no* ``RANK`` until the group exists.

:func:`ranks_from_env` reads them in that order and refuses to guess: a rank
that cannot be derived without doubt is a ``ConfigError`` saying what to set.
:func:`warn_if_duplicating` is the loud warning for a loader configured as
rank 0 of 1 in a job that has more ranks, where every rank would read the same
data.
"""

from __future__ import annotations

import os
import warnings

from centralpipe.errors import ConfigError

__all__ = ["job_world_size", "ranks_from_env", "warn_if_duplicating"]


def env_int(name: str) -> int | None:
    """The int value of environment variable ``name``; ``None`` if unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        msg = f"environment variable {name} must be an int, got {raw!r}."
        raise ConfigError(msg) from None


def group_ranks() -> tuple[int, int] | None:
    """(rank, world size) of the initialised default process group, else ``None``."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def ranks_from_env() -> tuple[int, int, int | None]:
    """(rank, world size, local rank) of this process; see the module docstring.

    Raises:
        ConfigError: the variables contradict each other or the process group,
            or the rank cannot be derived without doubt.
    """
    local = env_int("LOCAL_RANK")
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
    group = group_ranks()
    if group is not None:
        if (rank is not None and rank != group[0]) or (world is not None and world != group[1]):
            msg = (
                f"torch.distributed says rank {group[0]} of {group[1]}, but RANK/WORLD_SIZE "
                f"say {rank} of {world}; unset the variables or fix the launcher."
            )
            raise ConfigError(msg)
        return group[0], group[1], local
    if rank is not None and world is None:
        msg = f"RANK={rank} is set but WORLD_SIZE is not; set both, or neither."
        raise ConfigError(msg)
    if world is None:
        return 0, 1, local
    if rank is None:
        rank = _rank_without_rank(world, local)
    return rank, world, local  # DistributedConfig checks 0 <= rank < world


def _rank_without_rank(world: int, local: int | None) -> int:
    """The global rank from ``WORLD_SIZE`` and ``LOCAL_RANK`` (Lightning's
    launcher): ``node * ranks per node + LOCAL_RANK``, only when that is sure."""
    if world == 1:
        return 0
    if local is None:
        msg = (
            f"WORLD_SIZE={world} is set but neither RANK nor LOCAL_RANK is; set RANK (torchrun "
            "does), or call DistributedConfig.from_env() after "
            "torch.distributed.init_process_group()."
        )
        raise ConfigError(msg)
    node_rank, group_rank = env_int("NODE_RANK"), env_int("GROUP_RANK")
    if node_rank is not None and group_rank is not None and node_rank != group_rank:
        msg = f"NODE_RANK={node_rank} and GROUP_RANK={group_rank} disagree; set RANK."
        raise ConfigError(msg)
    node = node_rank if node_rank is not None else group_rank
    per_node = env_int("LOCAL_WORLD_SIZE")
    nnodes = env_int("SLURM_NNODES")
    if node is None:
        several = (per_node is not None and per_node < world) or (nnodes or 1) > 1
        if several:
            msg = (
                f"RANK is not set and this job spans several nodes (WORLD_SIZE={world}, "
                f"LOCAL_WORLD_SIZE={per_node}, nodes={nnodes}): the rank is ambiguous. Set RANK "
                "or NODE_RANK, or call DistributedConfig.from_env() after "
                "torch.distributed.init_process_group()."
            )
            raise ConfigError(msg)
        node = 0
    if node == 0:
        return local
    if per_node is None:
        msg = (
            f"RANK is not set on node {node}: the rank needs LOCAL_WORLD_SIZE (ranks per node), "
            "which is not set either. Set RANK, or call DistributedConfig.from_env() after "
            "torch.distributed.init_process_group()."
        )
        raise ConfigError(msg)
    return node * per_node + local


def job_world_size() -> int:
    """The job's number of ranks as far as this process can tell: the
    process group's, else ``WORLD_SIZE``, else 1. Never raises."""
    group = group_ranks()
    if group is not None:
        return group[1]
    try:
        return env_int("WORLD_SIZE") or 1
    except ConfigError:
        return 1


def warn_if_duplicating(world_size: int, *, stacklevel: int = 3) -> None:
    """Warn loudly when a loader of world size 1 runs in a job of several ranks:
    every rank would read the same items."""
    job = job_world_size()
    if world_size != 1 or job <= 1:
        return
    msg = (
        f"centralpipe: this Loader's DistributedConfig says world_size=1, but this job has "
        f"{job} ranks (torch.distributed or WORLD_SIZE): every rank will read the SAME items, "
        "duplicating data. Pass LoaderConfig(distributed=cp.DistributedConfig.from_env()). If "
        "every rank should read everything (e.g. an evaluation set), filter this warning."
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=stacklevel)

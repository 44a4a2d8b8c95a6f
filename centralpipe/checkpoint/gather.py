"""The collective side of elastic resume: every rank's state, gathered into one.

:func:`gather_states` is called on every rank of an initialised
``torch.distributed`` process group (gloo or NCCL). It gathers each rank's
``loader.state_dict()`` with ``all_gather_object`` (or ``gather_object`` to one
rank) and merges them with :func:`~centralpipe.merge_states`, so a training
loop saves one loader state next to its model — with ``torch.save`` from rank 0,
or under one key with ``torch.distributed.checkpoint`` — that resumes on any
world size. The data moved is every rank's in-flight items; with NCCL the
objects travel through the current CUDA device (``torch.cuda.set_device``
first, as for any object collective).
"""

from __future__ import annotations

from typing import Any

from centralpipe.checkpoint.elastic import merge_states
from centralpipe.errors import CheckpointError

__all__ = ["gather_states"]


def gather_states(
    loader: Any, *, group: Any = None, dst: int | None = None
) -> dict[str, Any] | None:
    """The global state of ``loader`` across the ranks of ``group``.

    A collective: call it on every rank, after the same number of steps.
    With ``dst=None`` every rank returns the global state; with ``dst=r`` (a
    global rank) only rank ``r`` does and the others return ``None``, which
    moves and holds less. Raises ``CheckpointError`` when the process group
    and the loader's ``DistributedConfig`` disagree, and whatever
    :func:`~centralpipe.merge_states` raises (on every rank alike)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        msg = (
            "gather_states needs an initialised torch.distributed process group "
            "(init_process_group); without one, collect each rank's state_dict() yourself "
            "and call cp.merge_states."
        )
        raise CheckpointError(msg)
    config = loader.config.distributed
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if (rank, world) != (config.rank, config.world_size):
        msg = (
            f"the process group says rank {rank} of {world}, the loader's DistributedConfig "
            f"says rank {config.rank} of {config.world_size}; build the loader with "
            "DistributedConfig.from_env() (or pass the group the loader was sharded for)."
        )
        raise CheckpointError(msg)
    state = loader.state_dict()
    if dst is None:
        states: list[Any] = [None] * world
        dist.all_gather_object(states, state, group=group)
        return merge_states(states)
    gathered: list[Any] | None = [None] * world if dist.get_rank() == dst else None
    dist.gather_object(state, gathered, dst=dst, group=group)
    return merge_states(gathered) if gathered is not None else None

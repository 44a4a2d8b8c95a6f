"""Assembling a boundary: one ordered stream and who runs its chunks.

:func:`open_stream` is the one entry point the Loader uses: it builds a
:class:`~centralpipe.dispatch.reorder.Stream` over the tip of the central
chain and gives it its driver — the worker stages inline in the consumer's
thread (no pool), or the pool's feeder and supervisor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from centralpipe.dispatch.chain import WorkerChain
from centralpipe.dispatch.pool import WorkerPool
from centralpipe.dispatch.protocol import InFlight
from centralpipe.dispatch.reorder import Stream, StreamStats
from centralpipe.dispatch.sender import InlineDriver
from centralpipe.dispatch.supervisor import Supervisor
from centralpipe.stages import CentralNode

__all__ = ["PoolPolicy", "open_stream"]


class PoolPolicy:
    """How the supervisor treats faults (from ``WorkerConfig``)."""

    def __init__(self, *, timeout_s: float | None, max_restarts: int, item_retries: int) -> None:
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.item_retries = item_retries


def open_stream(
    *,
    nodes: Sequence[CentralNode[Any]],
    chain: WorkerChain,
    epoch: int,
    next_seq: int,
    resume: InFlight | None,
    delivered_stamp: Any,
    delivered: int = 0,
    buffer_size: int | None,
    chunk_size: int | None,
    on_error: str,
    stats: StreamStats,
    dispatch_name: str,
    pool: WorkerPool | None = None,
    run_id: int = 0,
    policy: PoolPolicy | None = None,
) -> Stream:
    """A started stream: inline when ``pool`` is ``None``, else over the pool."""
    stream = Stream(
        nodes=nodes,
        chain=chain,
        epoch=epoch,
        next_seq=next_seq,
        resume=resume,
        delivered_stamp=delivered_stamp,
        delivered=delivered,
        buffer_size=buffer_size,
        chunk_size=chunk_size,
        on_error=on_error,
        stats=stats,
        dispatch_name=dispatch_name,
        parallelism=1 if pool is None else len(pool.slots),
    )
    if pool is None:
        stream.driver = InlineDriver(stream)
    else:
        assert policy is not None
        stream.driver = Supervisor(
            stream,
            pool=pool,
            run_id=run_id,
            timeout_s=policy.timeout_s,
            max_restarts=policy.max_restarts,
            item_retries=policy.item_retries,
        )
    return stream

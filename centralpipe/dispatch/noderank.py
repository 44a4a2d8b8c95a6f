"""``central="node"``: one local rank's central part inside the node service.

A :class:`RankCentral` is a :class:`~centralpipe.dispatch.local.LocalCentral`
whose central nodes are the node's shared stages (:class:`~centralpipe.dispatch.node.NodeStream`)
and the rank's own :class:`~centralpipe.dispatch.node.NodeShard`: its runs
drive its dispatch stream over its share of the workers, under the node's one
chain lock; the shared parallel stages' streams are the node's
(:mod:`centralpipe.dispatch.nodepool`). Its ``state_dict()`` is today's
per-rank format (the design is in :mod:`centralpipe.dispatch.node`), and its
``load_state_dict()`` waits for every local rank's state and resumes from
their merge.
"""

from __future__ import annotations

from typing import Any

from centralpipe import checkpoint
from centralpipe.checkpoint import resume
from centralpipe.config import LoaderConfig
from centralpipe.dispatch.local import LocalCentral
from centralpipe.dispatch.node import NodeShard, NodeStream
from centralpipe.plan.options import ShardOptions
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages import Parallel

__all__ = ["RankCentral"]


class RankCentral(LocalCentral):
    """One local rank's central part inside the node service."""

    def __init__(
        self, pipeline: Pipeline, config: LoaderConfig, stream: NodeStream, local_rank: int
    ) -> None:
        self._stream = stream
        self._local = local_rank
        super().__init__(pipeline, config)
        # One lock for every rank: their feeders share the stages before shard().
        self._res.chain_lock = stream.lock
        self._res.nodes = [self._nodes[-1]]

    def _driven_nodes(self) -> list[Any]:
        # The shared parallel stages' streams are the node's (NodeStream.segments).
        return [n for n in self._nodes if not isinstance(n, Parallel)]

    def _build_nodes(self, pipeline: Pipeline) -> list[Any]:
        spec = self._stream.shard_spec
        equalize = spec.options_as(ShardOptions).equalize
        shard = NodeShard(self._stream, self._local, equalize, spec.name, self._ctx)
        self._stream.shards[self._local] = shard
        return [*self._stream.nodes, shard]

    def _state(self, what: str) -> dict[str, Any]:
        if self._resume is not None:
            return self._resume.state()
        stream, shard = self._stream, self._nodes[-1]
        with stream.lock:
            run = self._res.run
            if run is not None:
                body = run.capture(what)
                epoch = run.stream.epoch
            else:
                body = resume.idle([], self._nodes)
                epoch = self.epoch
            state, items, stamps = shard.ahead()
            shared, body.segments = stream.shared_state(shard)
            body.central = {**shared, shard.name: state}
        # A feeder waiting for a stalled rank (NodeStream.advance) let go of
        # the chain lock inside its pull: its chunk's items are in flight
        # already, their seq numbers not yet counted.
        body.count_seqs()
        body.extend(items, stamps)
        return self._assemble(body, epoch)

    def worker_pids(self) -> list[int]:
        """This rank's workers, then the node-wide pool of the shared parallel stages."""
        # No lock (never waits): the pool attribute is read once.
        return [*super().worker_pids(), *self._stream.segments.worker_pids()]

    def load(self, state_dict: dict[str, Any]) -> None:
        """Every local rank loads its own state; the node resumes from their merge."""
        self._res.end_run()
        try:
            ckpt = checkpoint.structure(state_dict)
            checkpoint.check_pipeline(ckpt, self._expected())
            mine: dict[str, Any] | BaseException = state_dict
        except Exception as exc:
            mine = exc
        merged = self._stream.exchange_load(self._local, mine)
        if isinstance(mine, BaseException):
            raise mine
        pending = resume.pending(merged)
        with self._stream.lock:
            self._restore(pending)

"""``central="node"``: one central service per node, shared by its local ranks.

Local rank 0's Loader starts the service (a helper process, as
``central="service"`` does); the other local ranks' Loaders find it in the
job's private ``0700`` directory (:mod:`centralpipe.dispatch.rendezvous`)
and authenticate the same way. The per-Loader token reaches them as a file
in that directory, created ``0600`` and exclusively by the service's
starter: only this user can enter the directory, and the file needs no
process group (a Loader may be built before ``init_process_group``, and the
store of one would be reachable from every node, which the token is not
for). The service removes the socket and the token once every local rank
is connected. The ``k``-th node-mode Loader of each local rank (ranks build
them in the same order) meets the ``k``-th of the others.

Finding the service, its process and the clients are in
:mod:`centralpipe.dispatch.nodeservice`; inside the service:

- the central stages before ``shard()`` run **once** (:class:`NodeStream`):
  their outputs go into a window (:class:`_Window`) from which each local
  rank's own ``shard`` (:class:`NodeShard`, the rank's global rank and the
  job's world size) takes the items of its rank, exactly as that rank's
  shard would in ``central="process"``; node ``n``'s local rank ``l`` is
  global rank ``n * W + l``;
- each local rank has its own dispatch stream and checkpoint (a
  :class:`~centralpipe.dispatch.noderank.RankCentral`, a
  :class:`~centralpipe.dispatch.local.LocalCentral` over the shared
  stages): ``num_workers`` is the node's, split evenly between the local
  ranks (the shared parallel stages have the node's ``num_workers`` to
  themselves);
- a rank's ``state_dict()`` is today's per-rank format: the shared stages'
  states at the window's head, its shard there, and the items of its rank
  between its shard's position and the head as the dispatch boundary's
  in-flight inputs (after those it had dispatched), so ``merge_states``,
  ``gather_states`` and ``inspect`` work and a state resumes in any mode;
- ``load_state_dict()``: each local rank gives its state; once all have,
  they are merged (``merge_states``, node-local) and every rank resumes from
  the merged state: the node's one stream continues exactly, whichever mode
  the states were saved in;
- the window is bounded (:data:`WINDOW_ITEMS` central items between the
  slowest local rank and the head): a rank that stops reading stops the
  others there, and after :data:`~centralpipe.dispatch.timeouts.STALL_TIMEOUT_S` they get a
  ``ServiceError`` naming it. A rank whose connection ends without a close
  (killed) is a ``ServiceError`` naming it on every other rank's next call;
  a killed service is one on every rank at once (the connection ends). The
  service ends when its last client closes or dies.

A ``parallel=True`` stage among the shared stages (the seed pipeline's
tokenizer) runs once per node too, on the node-wide worker pool of
:mod:`centralpipe.dispatch.nodepool`; its in-flight inputs at the head are
part of every rank's state, as its stream's entry is in ``central="process"``.

Node mode needs ``shard()`` as the last central stage, right before
``dispatch()``; other pipelines are a ``PipelineError`` naming why.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from centralpipe import checkpoint
from centralpipe.checkpoint.model import empty_entry
from centralpipe.config import LoaderConfig
from centralpipe.dispatch import timeouts
from centralpipe.dispatch.nodepool import SharedSegments
from centralpipe.dispatch.worker.loop import main_alive
from centralpipe.errors import CheckpointError, PipelineError, ServiceError
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages import Count, RunContext, Shard, build_central
from centralpipe.stages.base import CentralNode

__all__ = [
    "WINDOW_ITEMS",
    "NodeShard",
    "NodeStream",
    "check_node_pipeline",
]

#: Most central items between the slowest local rank's shard and the head.
WINDOW_ITEMS = 4096


class _AtHead(Exception):
    """The window has no more items without running the shared stages."""


def check_node_pipeline(pipeline: Pipeline) -> None:
    """``PipelineError`` unless node mode can run ``pipeline`` (see the module docstring)."""
    specs = pipeline.central_stages
    kinds = [s.kind for s in specs]
    if "shard" not in kinds:
        raise PipelineError(
            "central='node' shares the stages before shard() between the node's ranks, "
            "and this pipeline has no shard(): add .shard() before .dispatch(), or use "
            "central='service'."
        )
    if kinds[-1] != "shard" or (not pipeline.worker_stages and pipeline.dispatch_name is None):
        after = [s.name for s in specs[kinds.index("shard") + 1 :]]
        raise PipelineError(
            "central='node' needs shard() to be the last central stage, right before "
            f"dispatch(); this pipeline has {after or 'no dispatch()'} after it: move those "
            "stages after dispatch() (as worker stages) or before shard(), or use "
            "central='service'."
        )
    if kinds.count("shard") > 1:
        raise PipelineError("central='node' needs exactly one shard(); this pipeline has more.")


class _Window:
    """One epoch of the shared stages' outputs, from the slowest rank's
    position to the head, each with the ``count`` totals it left with."""

    def __init__(self, stream: NodeStream, epoch: int, start: int) -> None:
        self.stream = stream
        self.epoch = epoch
        self.start = start
        #: Where a rank that has not started this epoch yet will read from.
        self.first = start
        self.head = start
        self.items: deque[tuple[Any, tuple[tuple[int, float], ...]]] = deque()
        self.ended = False
        #: The shared stages' states at the end of the epoch (kept for the
        #: ranks still delivering it once the node moved on).
        self.end_states: dict[str, Any] | None = None
        #: The shared parallel stages' in-flight entries then (none in flight).
        self.end_segments: dict[str, Any] | None = None

    def get(self, n: int, reader: NodeShard, produce: bool = True) -> Any:
        while n >= self.head:
            if self.ended:
                raise StopIteration
            if not produce:
                raise _AtHead
            self.stream.advance(self, reader)
        return self.items[n - self.start]

    def trim(self, lowest: int) -> None:
        while self.start < lowest and self.items:
            self.items.popleft()
            self.start += 1


class NodeShard(Shard):
    """A local rank's ``shard``, reading the node's shared stream (the
    window) instead of running the stages before it."""

    def __init__(
        self, stream: NodeStream, local_rank: int, equalize: Any, name: str, ctx: RunContext
    ) -> None:
        super().__init__(None, equalize, name=name, ctx=ctx)
        self.stream = stream
        self.local_rank = local_rank
        self.counts = stream.counts
        self.window: _Window | None = None
        #: This rank's pass reached the end of its window's epoch.
        self.ended = False
        #: The epoch this rank waits to start (see NodeStream.begin_epoch).
        self.wants: int | None = None

    def _consume(self) -> Any:
        if self._queue:
            item, stamp = self._queue.popleft()
            self.arrival = stamp
            self.index += 1
            return item
        window = self.window
        assert window is not None
        drop = self._drop
        while True:
            n = self._source_index
            try:
                item, stamp = window.get(n, self, self._produce)
            except StopIteration:
                self.ended = True
                raise
            self._source_index = n + 1
            self.stream.moved(window)
            if drop and drop[0] == n:
                drop.popleft()
                continue
            self.arrival = stamp
            self.index += 1
            return item

    _produce = True

    def restore(self, state: dict[str, Any] | None) -> None:
        super().restore(state)
        self.ended = False
        if state is None:
            self.stream.begin_epoch(self)
        else:
            self.window = self.stream.window

    def ahead(self) -> tuple[dict[str, Any], list[Any], list[Any]]:
        """This shard's state at its window's head, and the items of its rank
        (with their stamps) between its position and the head, in order."""
        if self.window is None:  # not started: nothing read ahead
            return self.own_state(), [], []
        scratch = NodeShard(self.stream, self.local_rank, self.equalize, self.name, self.ctx)
        scratch.restore_state(self.own_state(), self.window, self.ended)
        scratch._produce = False
        items: list[Any] = []
        stamps: list[Any] = []
        k = len(self.counts)
        while True:
            try:
                item = scratch.produce()
            except (_AtHead, StopIteration):
                break
            items.append(item)
            stamps.append((*(scratch.count_stamp(i) for i in range(k)), scratch.stamp()))
        return scratch.own_state(), items, stamps

    def restore_state(self, state: dict[str, Any], window: _Window | None, ended: bool) -> None:
        Shard.restore(self, state)
        self.window, self.ended = window, ended


class NodeStream:
    """The node's shared stages before ``shard()`` and their window."""

    def __init__(self, pipeline: Pipeline, config: LoaderConfig, local_world: int) -> None:
        specs = pipeline.central_stages
        self.ctx = RunContext(
            seed=config.seed,
            epoch=0,
            rank=config.distributed.rank,
            world_size=config.distributed.world_size,
        )
        self.nodes: list[CentralNode[Any]] = build_central(specs[:-1], self.ctx)
        for node in self.nodes:
            node.prepare()
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        #: The parallel stages among the shared ones, on the node-wide pool.
        self.segments = SharedSegments(self.nodes, config, self.lock)
        self._boundary = pipeline.dispatch_name or "dispatch"
        #: The shared stages' states before the first epoch (a rank's state
        #: before it iterates).
        self.fresh_states = {n.name: n.own_state() for n in self.nodes}
        self.counts = [n for n in self.nodes if isinstance(n, Count)]
        self.shard_spec = specs[-1]
        self.local_world = local_world
        self.epoch = 0
        self.window = _Window(self, 0, 0)
        self.shards: list[NodeShard | None] = [None] * local_world
        self.pids: list[int] = [0] * local_world
        self.closed = [False] * local_world
        #: Why the node cannot go on (a rank died), or None.
        self.broken: str | None = None
        self._loads: dict[int, dict[str, Any] | BaseException] = {}
        self._loaded: dict[str, Any] | None = None
        self._load_round = 0

    # -- the window ---------------------------------------------------------------

    def _open(self) -> list[NodeShard]:
        return [s for i, s in enumerate(self.shards) if s is not None and not self.closed[i]]

    def _positions(
        self, window: _Window, skip: NodeShard | None = None
    ) -> list[tuple[int, NodeShard]]:
        """``(position, shard)`` of every open rank that reads ``window`` or
        will (it has not started that epoch yet: it starts at its beginning)."""
        out = []
        for s in self._open():
            if s is skip:
                continue
            if s.window is window:
                out.append((s._source_index, s))
            elif window is self.window and (s.window is None or s.window.epoch < window.epoch):
                out.append((window.first, s))
        return out

    def _check(self) -> None:
        if self.broken is not None:
            raise ServiceError(self.broken)

    def advance(self, window: _Window, reader: NodeShard) -> None:
        """One more item of the shared stages into ``window`` (the caller
        holds the lock, as the feeders do): waits while the window is full
        (``STALL_TIMEOUT_S`` at most, then ``ServiceError`` naming the
        slowest rank)."""
        self._check()
        if window is not self.window:
            raise ServiceError(
                f"local rank {reader.local_rank} is still in epoch {window.epoch}, which "
                f"another local rank left early for epoch {self.epoch}; every local rank "
                "must iterate the same epochs."
            )
        deadline = time.monotonic() + timeouts.STALL_TIMEOUT_S
        while True:
            readers = self._positions(window, skip=reader)
            lowest = min((pos for pos, _ in readers), default=window.head)
            if window.head - lowest < WINDOW_ITEMS:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                slow = min(readers, key=lambda x: x[0])[1]
                if not main_alive(self.pids[slow.local_rank]):
                    self.mark_gone(slow.local_rank, clean=False)  # dead, not just slow
                    self._check()
                raise ServiceError(
                    f"local rank {slow.local_rank} (global rank {slow.ctx.rank}) has not read "
                    f"for {timeouts.STALL_TIMEOUT_S} s while {WINDOW_ITEMS} central items wait "
                    "for it; "
                    f"local rank {reader.local_rank} cannot go on. Every local rank must "
                    "iterate its loader."
                )
            self.cond.wait(min(left, 0.5))
            self._check()
        try:
            item = self.nodes[-1].next()
        except StopIteration:
            window.ended = True
            window.end_states, window.end_segments = self._capture()
            self.cond.notify_all()
            return
        window.items.append((item, self._stamp()))
        window.head += 1

    def moved(self, window: _Window) -> None:
        """A reader of ``window`` advanced: trim what every reader has passed."""
        readers = self._positions(window)
        if readers:
            window.trim(min(pos for pos, _ in readers))
        self.cond.notify_all()

    def begin_epoch(self, shard: NodeShard) -> None:
        """Bind ``shard`` to its epoch's window, starting that epoch on the
        shared stages when it is the first rank there (once every other rank
        ended the current one or waits for the same)."""
        epoch = shard.ctx.epoch
        with self.lock:
            if self.epoch != epoch:
                shard.wants = epoch
                deadline = time.monotonic() + timeouts.STALL_TIMEOUT_S
                try:
                    while self.epoch != epoch:
                        self._check()
                        late = [
                            s
                            for s in self._open()
                            if s is not shard
                            and s.window is self.window
                            and not s.ended
                            and s.wants != epoch
                        ]
                        if not late or self.window.head == self.window.start == 0:
                            self.ctx.epoch = epoch
                            self.nodes[-1].load_flat(None)
                            self.epoch = epoch
                            self.window = _Window(self, epoch, 0)
                            self.segments.start(epoch, None)
                            self.cond.notify_all()
                            break
                        left = deadline - time.monotonic()
                        if left <= 0:
                            names = ", ".join(str(s.local_rank) for s in late)
                            raise ServiceError(
                                f"local rank(s) {names} did not finish epoch {self.epoch} "
                                f"within {timeouts.STALL_TIMEOUT_S} s while local rank "
                                f"{shard.local_rank} starts epoch {epoch}."
                            )
                        self.cond.wait(min(left, 0.5))
                finally:
                    shard.wants = None
            shard.window = self.window

    # -- checkpoints --------------------------------------------------------------

    def shared_state(self, shard: NodeShard) -> tuple[dict[str, Any], dict[str, Any]]:
        """The shared stages' states at ``shard``'s window's head and the
        in-flight entries of the parallel stages among them (the caller
        holds the lock)."""
        window = shard.window
        if window is None:
            empty = {n.name: empty_entry() for n in self.segments.segments}
            return dict(self.fresh_states), empty
        if window is not self.window and window.end_states is not None:
            return dict(window.end_states), dict(window.end_segments or {})
        return self._capture()

    def _capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        captured = self.segments.capture()
        if captured is not None:
            return captured
        empty = {n.name: empty_entry() for n in self.segments.segments}
        return {n.name: n.own_state() for n in self.nodes}, empty

    def _stamp(self) -> tuple[tuple[int, float], ...]:
        """The ``count`` totals the item just out of the shared stages leaves
        with (through a parallel stage, as ``central="process"`` stamps it)."""
        if not self.segments.segments:
            return tuple(c.snapshot for c in self.counts)
        return tuple(tuple(x) for x in self.segments.stamper() or ())

    def exchange_load(
        self, local_rank: int, state: dict[str, Any] | BaseException
    ) -> dict[str, Any]:
        """Every local rank's state (or its error) in, the merged state out,
        once all are in; the shared stages and the window are then at the
        merged state's position."""
        with self.lock:
            round_ = self._load_round
            self._loads[local_rank] = state
            self.cond.notify_all()
            deadline = time.monotonic() + timeouts.STALL_TIMEOUT_S
            while self._load_round == round_ and len(self._loads) < self.local_world:
                self._check()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.local_world)) - set(self._loads))
                    del self._loads[local_rank]
                    raise ServiceError(
                        f"local rank(s) {missing} did not call load_state_dict() within "
                        f"{timeouts.STALL_TIMEOUT_S} s; in central='node' every local rank "
                        "loads its state."
                    )
                self.cond.wait(min(left, 0.5))
            if self._load_round == round_:
                loads, self._loads = self._loads, {}
                self._load_round += 1
                try:
                    self._loaded = self._merge(loads)
                except BaseException as exc:
                    self._loaded = None
                    self._load_error: BaseException = exc
                    self.cond.notify_all()
                    raise
                self.cond.notify_all()
            if self._loaded is None:
                raise self._load_error
            return self._loaded

    def _merge(self, loads: dict[int, Any]) -> dict[str, Any]:
        from centralpipe.checkpoint import elastic

        bad = {r: s for r, s in loads.items() if isinstance(s, BaseException)}
        if bad:
            r, exc = min(bad.items())
            raise CheckpointError(f"local rank {r}'s state cannot be loaded: {exc}") from exc
        states = [loads[r] for r in sorted(loads)]
        flags = [elastic.is_global(s) for s in states]
        if all(flags):
            merged = states[0]
        elif any(flags):
            raise CheckpointError(
                "in central='node' the local ranks load either each its own state_dict() or "
                "all the same merge_states() result; got a mix of both."
            )
        else:
            merged = elastic.merge_states(states)
        self.ctx.epoch = merged["epoch"]
        self.nodes[-1].load_flat(dict(merged["central"]))
        shard = merged["central"][self.shard_spec.name]
        start = int(shard.get("source_index", shard["index"]))
        self.epoch = merged["epoch"]
        self.window = _Window(self, self.epoch, start)
        self.segments.start(self.epoch, checkpoint.structure(merged))
        return merged

    def mark_gone(self, local_rank: int, clean: bool) -> None:
        with self.lock:
            self.closed[local_rank] = True
            if not clean and self.broken is None:
                self.broken = (
                    f"local rank {local_rank} (pid {self.pids[local_rank]}) ended without "
                    "closing its Loader (killed?); the node's stream cannot go on. Restart "
                    "the job and load_state_dict() the last checkpoints."
                )
            self.cond.notify_all()

    def release(self) -> None:
        """End the shared parallel streams and their pool; close the files."""
        with self.lock:
            self.segments.close()
        if self.nodes:
            self.nodes[-1].release()

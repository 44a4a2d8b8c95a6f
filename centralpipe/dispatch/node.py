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

Inside the service:

- the central stages before ``shard()`` run **once** (:class:`NodeStream`):
  their outputs go into a window (:class:`_Window`) from which each local
  rank's own ``shard`` (:class:`NodeShard`, the rank's global rank and the
  job's world size) takes the items of its rank, exactly as that rank's
  shard would in ``central="process"``; node ``n``'s local rank ``l`` is
  global rank ``n * W + l``;
- each local rank has its own dispatch stream and checkpoint (a
  :class:`RankCentral`, a :class:`~centralpipe.dispatch.local.LocalCentral`
  over the shared stages): ``num_workers`` is the node's, split evenly
  between the local ranks;
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
  others there, and after :data:`STALL_TIMEOUT_S` they get a
  ``ServiceError`` naming it. A rank whose connection ends without a close
  (killed) is a ``ServiceError`` naming it on every other rank's next call;
  a killed service is one on every rank at once (the connection ends). The
  service ends when its last client closes or dies.

Node mode needs ``shard()`` as the last central stage, right before
``dispatch()``, and no ``parallel=True`` stage before it (its worker stream
would be one rank's); other pipelines are a ``PipelineError`` naming why.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import multiprocessing
import os
import signal
import socket
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import attrs

from centralpipe import checkpoint, resume
from centralpipe.config import DistributedConfig, LoaderConfig
from centralpipe.dispatch import rendezvous
from centralpipe.dispatch.client import START_TIMEOUT_S, ServiceClient, _Link, _shutdown
from centralpipe.dispatch.local import LocalCentral
from centralpipe.dispatch.pinning import make_pinner
from centralpipe.dispatch.service import ACCEPT_TIMEOUT_S, WATCHDOG_S, _Server
from centralpipe.dispatch.wire import shm
from centralpipe.dispatch.wire.stash import RingWriter, receive_ring
from centralpipe.dispatch.worker.loop import main_alive
from centralpipe.errors import CheckpointError, PipelineError, ServiceError
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages import Count, Parallel, RunContext, Shard, build_central
from centralpipe.stages.base import CentralNode

__all__ = [
    "STALL_TIMEOUT_S",
    "WINDOW_ITEMS",
    "NodeClient",
    "NodeShard",
    "NodeStream",
    "RankCentral",
    "check_node_pipeline",
    "local_ranks",
    "serve_node",
]

#: Most central items between the slowest local rank's shard and the head.
WINDOW_ITEMS = 4096
#: Longest wait of a rank for a stalled local rank (full window, an epoch
#: change, a load) before a ``ServiceError`` naming it.
STALL_TIMEOUT_S = 60.0
#: How long a local rank waits for the token file of local rank 0's service.
FIND_TIMEOUT_S = 120.0


class _AtHead(Exception):
    """The window has no more items without running the shared stages."""


def local_ranks() -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` from the launcher (``(0, 1)`` if unset)."""
    try:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ServiceError(
            f"central='node' needs integer LOCAL_RANK and LOCAL_WORLD_SIZE, got {exc}."
        ) from None
    if per_node < 1 or not 0 <= local < per_node:
        raise ServiceError(
            f"central='node' needs 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE, got LOCAL_RANK={local}, "
            f"LOCAL_WORLD_SIZE={per_node}."
        )
    return local, per_node


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
        if any(isinstance(n, Parallel) for n in self.nodes):
            raise PipelineError(
                "central='node' cannot share a parallel=True stage before shard() between "
                "ranks (its worker stream would be one rank's): drop parallel=True there, or "
                "use central='service'."
            )
        for node in self.nodes:
            node.prepare()
        #: The shared stages' states before the first epoch (a rank's state
        #: before it iterates).
        self.fresh_states = {n.name: n.own_state() for n in self.nodes}
        self.counts = [n for n in self.nodes if isinstance(n, Count)]
        self.shard_spec = specs[-1]
        self.local_world = local_world
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
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
        deadline = time.monotonic() + STALL_TIMEOUT_S
        while True:
            readers = self._positions(window, skip=reader)
            lowest = min((pos for pos, _ in readers), default=window.head)
            if window.head - lowest < WINDOW_ITEMS:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                slow = min(readers, key=lambda x: x[0])[1]
                raise ServiceError(
                    f"local rank {slow.local_rank} (global rank {slow.ctx.rank}) has not read "
                    f"for {STALL_TIMEOUT_S} s while {WINDOW_ITEMS} central items wait for it; "
                    f"local rank {reader.local_rank} cannot go on. Every local rank must "
                    "iterate its loader."
                )
            self.cond.wait(min(left, 0.5))
            self._check()
        try:
            item = self.nodes[-1].next()
        except StopIteration:
            window.ended = True
            window.end_states = {n.name: n.own_state() for n in self.nodes}
            self.cond.notify_all()
            return
        window.items.append((item, tuple((c.items, c.weight) for c in self.counts)))
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
                deadline = time.monotonic() + STALL_TIMEOUT_S
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
                            self.cond.notify_all()
                            break
                        left = deadline - time.monotonic()
                        if left <= 0:
                            names = ", ".join(str(s.local_rank) for s in late)
                            raise ServiceError(
                                f"local rank(s) {names} did not finish epoch {self.epoch} "
                                f"within {STALL_TIMEOUT_S} s while local rank "
                                f"{shard.local_rank} starts epoch {epoch}."
                            )
                        self.cond.wait(min(left, 0.5))
                finally:
                    shard.wants = None
            shard.window = self.window

    # -- checkpoints --------------------------------------------------------------

    def shared_states(self, shard: NodeShard) -> dict[str, Any]:
        window = shard.window
        if window is None:
            return dict(self.fresh_states)
        if window is not self.window and window.end_states is not None:
            return dict(window.end_states)
        return {n.name: n.own_state() for n in self.nodes}

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
            deadline = time.monotonic() + STALL_TIMEOUT_S
            while self._load_round == round_ and len(self._loads) < self.local_world:
                self._check()
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.local_world)) - set(self._loads))
                    del self._loads[local_rank]
                    raise ServiceError(
                        f"local rank(s) {missing} did not call load_state_dict() within "
                        f"{STALL_TIMEOUT_S} s; in central='node' every local rank loads its "
                        "state."
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
        if self.nodes:
            self.nodes[-1].release()


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

    def _build_nodes(self, pipeline: Pipeline) -> list[Any]:
        spec = self._stream.shard_spec
        shard = NodeShard(self._stream, self._local, spec.options["equalize"], spec.name, self._ctx)
        self._stream.shards[self._local] = shard
        return [*self._stream.nodes, shard]

    def _state(self, what: str) -> dict[str, Any]:
        if self._resume is not None:
            return resume.copy_state(self._resume)
        stream, shard = self._stream, self._nodes[-1]
        with stream.lock:
            run = self._res.run
            if run is not None:
                body = run.capture(what)
                epoch = run.stream.epoch
            else:
                body = resume.idle_body([], self._nodes)
                epoch = self.epoch
            state, items, stamps = shard.ahead()
            body["central"] = {**stream.shared_states(shard), shard.name: state}
        flight = body["in_flight"]
        # A feeder waiting for a stalled rank (NodeStream.advance) let go of
        # the chain lock inside its pull: its chunk's items are in flight
        # already, their seq numbers not yet counted.
        body["next_seq"] = max(body["next_seq"], flight["first_seq"] + len(flight["items"]))
        if items:
            flight["items"] = [*flight["items"], *items]
            if flight.get("stamps") is not None:
                flight["stamps"] = [*flight["stamps"], *stamps]
            if not flight["items"][: -len(items)]:
                flight["first_seq"] = body["next_seq"]
            body["next_seq"] += len(items)
        dist = self._config.distributed
        return resume.assemble(
            body,
            fingerprint=self._pipe.fingerprint(),
            seed=self._config.seed,
            epoch=epoch,
            rank=dist.rank,
            world_size=dist.world_size,
            boundary=self._boundary,
            stamped=self._stamped,
        )

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
        sd = resume.copy_state(merged)
        with self._stream.lock:
            self._restore(sd)


# -- the service process --------------------------------------------------------------


def token_path(directory: Path, k: int) -> Path:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return directory / f"node-{rendezvous.job_key()}-{restart}-{k}.token"


def socket_path(directory: Path, k: int) -> Path:
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return directory / f"node-{restart}-{k}.sock"


def write_token(path: Path, token: bytes) -> None:
    """``token`` at ``path``, readable by this user only (replacing a stale one)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, token)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_token(path: Path, timeout_s: float) -> bytes:
    """The token at ``path`` once it exists (``ServiceError`` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"no central service of this node appeared at {str(path.parent)!r} within "
                    f"{timeout_s} s: local rank 0 must create a Loader with central='node' too "
                    "(the local ranks build their node-mode Loaders in the same order)."
                ) from None
            time.sleep(0.05)
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise ServiceError(
                    f"the node service's token {str(path)!r} must be a file of user "
                    f"{os.getuid()} with mode 0600: remove it."
                )
            data = os.read(fd, rendezvous.TOKEN_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) == rendezvous.TOKEN_BYTES:
            return data
        if time.monotonic() > deadline:
            raise ServiceError(f"the node service's token {str(path)!r} is damaged: remove it.")
        time.sleep(0.05)


def _watchdog(stream_pids: list[int], ready: threading.Event) -> None:
    """End the service once every client is gone (dead, even unreaped)."""
    while True:
        time.sleep(WATCHDOG_S)
        if ready.is_set() and not any(p and main_alive(p) for p in stream_pids):
            os._exit(0)


def serve_node(
    pipeline: Pipeline,
    config: LoaderConfig,
    path: str,
    token: bytes,
    token_file: str,
    owner_pid: int,
    ready: Connection,
    local_world: int,
) -> None:
    """Entry point of the node service (a ``multiprocessing.Process`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids = [owner_pid] * local_world
    connected = threading.Event()
    threading.Thread(
        target=_watchdog, args=(pids, connected), daemon=True, name="centralpipe-node-watchdog"
    ).start()
    links = _accept_all(path, token, token_file, ready, local_world)
    if links is None:
        return
    for rank, (_, _, pid, _) in links.items():
        pids[rank] = pid
    connected.set()
    base = config.distributed.rank
    stream: NodeStream | None = None
    try:
        stream = NodeStream(pipeline, config, local_world)
    except Exception as exc:
        failure: Exception | None = exc
    else:
        failure = None
        stream.pids = list(pids)
    share = max(1, config.workers.num_workers // local_world) if config.workers.num_workers else 0
    threads = []
    build = threading.Lock()
    for rank, (conn, control, _pid, ring) in links.items():
        dist = DistributedConfig(rank=base + rank, world_size=config.distributed.world_size)
        inner = attrs.evolve(
            config,
            central="process",
            pin_memory=False,
            distributed=dist,
            workers=attrs.evolve(config.workers, num_workers=share),
        )
        t = threading.Thread(
            target=_serve_rank,
            args=(pipeline, inner, stream, failure, rank, conn, control, ring, build),
            name=f"centralpipe-node-rank{rank}",
            daemon=True,
        )
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    if stream is not None:
        stream.release()


def _serve_rank(
    pipeline: Pipeline,
    config: LoaderConfig,
    stream: NodeStream | None,
    failure: Exception | None,
    rank: int,
    conn: Connection,
    control: Connection,
    ring: RingWriter | None,
    build: threading.Lock,
) -> None:
    clean = False

    def make() -> LocalCentral:
        if failure is not None:
            raise failure
        assert stream is not None
        with build:
            return RankCentral(pipeline, config, stream, rank)

    server = _NodeServer(conn, ring, stream)
    try:
        server.run(pipeline, config, control, make)
        clean = True
    except (EOFError, OSError):
        pass
    finally:
        if stream is not None:
            stream.mark_gone(rank, clean)
        conn.close()
        control.close()


class _NodeServer(_Server):
    """A rank's request loop; every request fails once the node is broken."""

    def __init__(
        self, conn: Connection, ring: RingWriter | None, stream: NodeStream | None
    ) -> None:
        super().__init__(conn, ring)
        self._stream = stream

    def _handle(self, central: LocalCentral, op: str, args: tuple[Any, ...]) -> None:
        stream = self._stream
        if stream is not None and stream.broken is not None and op != "metrics":
            self._reply("err", ServiceError(stream.broken))
            return
        super()._handle(central, op, args)


def _accept_all(
    path: str, token: bytes, token_file: str, ready: Connection, local_world: int
) -> dict[int, tuple[Connection, Connection, int, RingWriter | None]] | None:
    """Every local rank's two authenticated connections, keyed by local rank."""
    found: dict[int, dict[str, Any]] = {}
    listener = rendezvous.listen(path)
    try:
        listener.settimeout(ACCEPT_TIMEOUT_S)
        write_token(Path(token_file), token)
        ready.send_bytes(b"ready")
        ready.close()
        deadline = time.monotonic() + ACCEPT_TIMEOUT_S
        while not _complete(found, local_world) and time.monotonic() < deadline:
            try:
                conn = rendezvous.accept(listener, token)
            except ServiceError:
                continue
            except (TimeoutError, OSError):
                break
            if not conn.poll(rendezvous.HANDSHAKE_TIMEOUT_S):
                conn.close()
                continue
            kind, rank, pid, with_ring = conn.recv()
            entry = found.setdefault(int(rank), {})
            entry["pid"] = int(pid)
            entry[kind] = conn
            if kind == "requests":
                entry["ring"] = receive_ring(conn) if with_ring else None
    finally:
        listener.close()
        rendezvous.remove_socket(path)
        with contextlib.suppress(OSError):
            os.unlink(token_file)
    complete = {
        r: (e["requests"], e["reads"], e["pid"], e.get("ring"))
        for r, e in found.items()
        if "requests" in e and "reads" in e and 0 <= r < local_world
    }
    if len(complete) < local_world:
        for e in found.values():
            for key in ("requests", "reads"):
                if key in e:
                    e[key].close()
        return None
    return complete


def _complete(found: dict[int, dict[str, Any]], local_world: int) -> bool:
    return all(
        "requests" in found.get(r, {}) and "reads" in found.get(r, {}) for r in range(local_world)
    )


_IDS = itertools.count()


class NodeClient(ServiceClient):
    """A local rank's client of its node's service (local rank 0 starts it)."""

    def __init__(self, pipeline: Pipeline, config: LoaderConfig) -> None:
        check_node_pipeline(pipeline)
        local, per_node = local_ranks()
        dist = config.distributed
        if dist.world_size % per_node or dist.rank % per_node != local:
            raise ServiceError(
                f"central='node' needs global rank = node * LOCAL_WORLD_SIZE + LOCAL_RANK "
                f"(torchrun's layout); got rank {dist.rank} of {dist.world_size} with "
                f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={per_node}."
            )
        k = next(_IDS)
        directory = rendezvous.private_dir(rendezvous.job_key())
        path = str(socket_path(directory, k))
        tpath = token_path(directory, k)
        self._service_pid = 0
        self._epoch = 0
        self._dead: str | None = None
        self._owed: collections.deque[tuple[str, tuple[Any, ...]]] = collections.deque()
        self._held: tuple[tuple[str, tuple[Any, ...]], tuple[str, Any]] | None = None
        self._lock = threading.Lock()
        self._reads_lock = threading.Lock()
        with_ring = shm.available()
        proc: Any = None
        if local == 0:
            method = config.workers.resolved_start_method()
            ctx: Any = multiprocessing.get_context(method)
            token = rendezvous.new_token()
            inner = attrs.evolve(config, central="process", pin_memory=False)
            ready_r, ready_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=serve_node,
                args=(pipeline, inner, path, token, str(tpath), os.getpid(), ready_w, per_node),
                name="centralpipe-node-service",
            )
        link = self._link = _Link(proc=proc, path=path if local == 0 else "")
        link.close_timeout_s = STALL_TIMEOUT_S
        try:
            if proc is not None:
                try:
                    proc.start()
                except Exception as exc:
                    raise PipelineError(
                        f"central='node' with start method {method!r} pickles the pipeline to "
                        f"send it to the service, and that failed: {exc}. Define its functions "
                        "at module level, or use WorkerConfig(start_method='fork')."
                    ) from exc
                finally:
                    ready_w.close()
            self._finalizer = weakref.finalize(self, _shutdown, link)
            link.exit_hook = self._finalizer
            atexit.register(self._finalizer)
            if proc is not None:
                try:
                    if not wait([ready_r, proc.sentinel], START_TIMEOUT_S):
                        raise ServiceError(
                            f"the node's central service (pid {proc.pid}) did not start within "
                            f"{START_TIMEOUT_S} s."
                        )
                    if not ready_r.poll():
                        self._died("while starting")
                finally:
                    ready_r.close()
                self._service_pid = proc.pid
            else:
                token = read_token(tpath, FIND_TIMEOUT_S)
            link.conn = self._connect(path, token, proc, "requests", local, with_ring)
            if with_ring:
                link.ring = shm.Ring(config.workers.shared_memory_bytes)
                if not link.ring.hand_over(link.conn):
                    self._died("while starting")
            link.control = self._connect(path, token, proc, "reads", local, False)
            kind, value = self._receive()
            if kind == "err":
                raise value
            self._epoch = value
            link.pinner = make_pinner(config.pin_memory)
        except BaseException:
            _shutdown(link)
            raise

    def _connect(
        self, path: str, token: bytes, proc: Any, kind: str, local: int, with_ring: bool
    ) -> Connection:
        deadline = time.monotonic() + FIND_TIMEOUT_S
        while True:
            try:
                conn = rendezvous.connect(
                    path, token, expect_pid=None if proc is None else proc.pid
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise ServiceError(
                        f"could not connect to the node's central service at {path!r} within "
                        f"{FIND_TIMEOUT_S} s."
                    ) from None
                time.sleep(0.05)
        with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            self._service_pid = rendezvous.peer_credentials(sock)[0]
        conn.send((kind, local, os.getpid(), with_ring))
        return conn

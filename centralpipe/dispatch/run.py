"""Assembling a run: every ordered stream of one pass, and who drives each.

A :class:`Run` is one pass (an epoch, or the rest of one): one
:class:`~centralpipe.dispatch.reorder.Stream` per parallel central stage
(stream ids ``0..k-1``, in chain order) and one for the dispatch boundary
(stream id ``k``), all over one executor through one
:class:`~centralpipe.dispatch.supervisor.Supervisor`. It is what
:mod:`~centralpipe.dispatch.central` drives: outputs, the checkpoint of every stream under one
lock, the delivered view of ``count`` stages, worker states, and stop.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

from centralpipe.checkpoint.model import Captured, Checkpoint, later_entry, stamp_tuple
from centralpipe.dispatch.executors.pool import Executor
from centralpipe.dispatch.reorder import Driver, Stamper, Stream, StreamStats
from centralpipe.dispatch.segments import Segment, unfused_for
from centralpipe.dispatch.sender import FeederDriver, InlineDriver, SegmentDriver
from centralpipe.dispatch.supervisor import Policy, Supervisor
from centralpipe.dispatch.warm import WarmDriver, WarmStart
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.stages import CentralNode, Parallel, Shard

__all__ = ["Policy", "Run", "WarmStart", "idle_worker_states"]


class Run:
    """One pass over the central chain; see the module docstring."""

    def __init__(
        self,
        *,
        nodes: Sequence[CentralNode[Any]],
        chain: WorkerChain,
        segment_chains: Sequence[WorkerChain],
        epoch: int,
        resume: Checkpoint | None,
        buffer_size: int | None,
        chunk_size: int | None,
        policy: Policy,
        stats: StreamStats,
        segment_stats: dict[str, StreamStats],
        dispatch_name: str,
        executor: Executor | None = None,
        run_id: int = 0,
        pinner: Any = None,
        chain_lock: threading.RLock | None = None,
        warm: WarmStart | None = None,
        read_in_workers: bool = True,
        fused: Sequence[Segment] = (),
    ) -> None:
        self.nodes = list(nodes)
        self._read_in_workers = read_in_workers
        self.segments = [n for n in nodes if isinstance(n, Parallel)]
        self.session: Supervisor | None = None
        self.feeder: FeederDriver | None = None
        self._policy, self._run_id, self._stats = policy, run_id, stats
        if executor is not None:
            parallelism = len(executor.slots)
        else:
            parallelism = 1 if warm is None else warm.num_workers
        common: dict[str, Any] = {
            "epoch": epoch,
            "buffer_size": buffer_size,
            "chunk_size": chunk_size,
            "on_error": policy.on_error,
            "parallelism": parallelism,
        }
        self.segment_streams: list[Stream] = []
        #: Each parallel stream and the stages it runs (two or more: a fused
        #: segment, ``dispatch.segments``), in chain order.
        self.owners: list[tuple[list[Parallel], Stream]] = []
        fused = [f for f in fused if not unfused_for(f, self.segments, resume)]
        lead = {f.members[0]: f for f in fused}
        inside = {i for f in fused for i in f.members[1:]}
        for i, (node, seg_chain) in enumerate(zip(self.segments, segment_chains)):
            if i in inside:
                continue
            segment = lead.get(i)
            members = [node] if segment is None else [self.segments[j] for j in segment.members]
            assert isinstance(node.source, CentralNode)
            stamper = Stamper(node.source.chain())
            for member in members:
                member.stamper = stamper
            entry = None if resume is None else resume.in_flight[node.name]
            stream = Stream(
                tip=node.source,
                stamper=stamper,
                chain=seg_chain if segment is None else segment.chain,
                next_seq=0 if entry is None else entry.next_seq,
                resume=entry,
                delivered_stamp=None if entry is None else stamp_tuple(entry.delivered_stamp),
                stats=segment_stats[node.name],
                dispatch_name=node.name,
                stream_id=i if segment is None else segment.chain_id,
                **common,
            )
            # While the workers start (a warm run), parallel stages run inline
            # through the workers' serialisation, as the dispatch stream does.
            stream.driver = InlineDriver(stream, as_worker=warm is not None)
            self.segment_streams.append(stream)
            self.owners.append((members, stream))
        # The dispatch boundary's stamp as of its last output is the
        # checkpoint's top-level one.
        # A run with no dispatch entry in ``resume`` (the node's shared run:
        # its tip is never pulled) resumes its parallel stages only.
        tip = None if resume is None else resume.in_flight.get(dispatch_name)
        if tip is None:
            resume = None
        self.stream = Stream(
            tip=self.nodes[-1],
            stamper=Stamper(self.nodes),
            chain=chain,
            next_seq=0 if tip is None else tip.next_seq,
            resume=tip,
            delivered_stamp=None if resume is None else stamp_tuple(resume.delivered_stamp),
            stats=stats,
            dispatch_name=dispatch_name,
            stream_id=len(self.segments),
            delivered=0 if resume is None else resume.position.delivered,
            skipped=0 if resume is None else resume.skipped(dispatch_name),
            rng_base=_rng_base(self.nodes),
            chain_lock=chain_lock,
            **common,
        )
        self.stream.pinner = pinner
        if executor is not None:
            self.session = self._new_session(executor)
            self._wire(self.session)
            self.stream.driver = self._pool_driver()
        elif warm is not None:
            # The workers are still starting: run inline until they are ready.
            self.stream.driver = WarmDriver(
                self.stream, warm, hand_over=self.hand_over, stop=self.stop_session
            )
        else:
            self.stream.driver = InlineDriver(self.stream, on_stop=self.stop_session)

    def _new_session(self, executor: Executor) -> Supervisor:
        session = Supervisor(executor, self._run_id, self._policy, self._stats)
        session.streams = [*self.segment_streams, self.stream]
        session.held.streams = session.streams
        return session

    def _wire(self, session: Supervisor) -> None:
        """Have every stream run over ``session``'s workers (no thread starts)."""
        for stream in session.streams:
            stream.held = session.held
        for stream in self.segment_streams:
            stream.driver = SegmentDriver(stream, session)
            if self._read_in_workers:
                stream.ranges = _range_reader(stream)
        if self.stream.chain.specs and self.feeder is None:
            self.feeder = FeederDriver(self.stream, session)

    def _pool_driver(self) -> Driver:
        """The dispatch stream's driver over the workers: the feeder, or
        without worker stages after the boundary the consumer's thread
        (parallel stages still use the workers)."""
        if self.feeder is not None:
            return self.feeder
        return InlineDriver(self.stream, on_stop=self.stop_session)

    def hand_over(self, executor: Executor) -> None:
        """Warm start (``dispatch.warm``): the workers are ready; from the
        next chunk on, they run the worker stages. In the consumer's thread,
        at a chunk boundary (every pending chunk has its result). Each step
        can be repeated: a hand-over cut short is finished by the next call,
        and :meth:`stop` ends whatever it started."""
        session = self.session
        if session is None:
            session = self.session = self._new_session(executor)
        if not session.launched:
            session.start()
        for stream in session.streams:
            with stream.lock:
                for chunk in stream.pending:
                    if chunk.sent_gen < 0 and chunk.held_bytes == 0:
                        chunk.release_bytes()  # run inline: holds no bytes of a worker's
        self._wire(session)
        if self.feeder is not None and not self.feeder.launched:
            self.feeder.start()
        # Last: until here the stream's driver is the warm one, which
        # finishes a hand-over cut short.
        self.stream.driver = self._pool_driver()

    def start(self) -> None:
        """Start the supervisor and the feeder (nothing starts before this).

        The owner keeps the run before calling it: an error or Ctrl-C at any
        point in here leaves threads that :meth:`stop` ends, and stopped
        streams pull nothing more."""
        for members, stream in self.owners:
            members[-1].attach(stream)
        if self.session is not None:
            self.session.start()
        if self.feeder is not None:
            self.feeder.start()

    # -- what the Loader reads ---------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self.stream.stopping

    def __iter__(self) -> Run:
        return self

    def __next__(self) -> Any:
        """The next output in order (:meth:`Stream.next_output`)."""
        return self.stream.next_output()

    def reading(self, what: str) -> contextlib.AbstractContextManager[None]:
        """The chain lock, to read central stages (``chainlock.Holding``)."""
        return self.stream.reading(what)

    def capture(self, what: str = "state_dict()") -> Captured:
        """Central states, the dispatch boundary's and every parallel stage's
        in-flight inputs, all at the consumer's position (one lock)."""
        with self.stream.reading(what), self.stream.lock:
            body = self.stream.capture_unlocked()
            body.central = {node.name: node.own_state() for node in self.nodes}
            body.segments = {}
            for members, stream in self.owners:
                body.segments.update(_member_entries(members, stream.capture_unlocked().entry))
        return body

    def delivered_stamp(self) -> Any:
        return self.stream.delivered_stamp()

    def stamped_nodes(self) -> list[CentralNode[Any]]:
        return self.stream.stamper.stamped

    @property
    def in_flight(self) -> int:
        return self.stream.in_flight

    def delivered_in_chunk(self) -> int:
        return self.stream.delivered_in_chunk()

    def held_bytes(self) -> int:
        """Bytes of results received from workers and not yet delivered."""
        return 0 if self.session is None else self.session.held.held

    def held_limit(self, configured: int | None) -> int | None:
        """The bound on held bytes in force: ``configured`` (``buffer_bytes``),
        lowered to what the workers' rings can lend once they exist."""
        return configured if self.session is None else self.session.held.limit

    def segment_in_flight(self) -> dict[str, int]:
        return {
            node.name: stream.in_flight if k == 0 else 0
            for members, stream in self.owners
            for k, node in enumerate(members)
        }

    def worker_states(self) -> list[Any] | None:
        """Each worker's stateful-stage states (``None`` without workers)."""
        return None if self.session is None else self.session.worker_states()

    # -- stopping ----------------------------------------------------------------

    def stop_session(self) -> None:
        """Stop the session (and the feeder, waited for first); bounded."""
        if self.feeder is not None:
            self.feeder.stop()
        elif self.session is not None:
            self.session.stop()

    def abandon(self) -> None:
        """Set the stop flags only: plain attribute writes, no lock, no wait
        (safe in a finalizer). Senders, pullers and waiters give up at their
        next look; :meth:`stop` still has to follow."""
        if self.session is not None:
            self.session.abandoned = True
        for stream in [*self.segment_streams, self.stream]:
            stream.stopping = True

    def stop(self) -> None:
        """Stop every stream and the session; idempotent and bounded. It never
        waits for a central ``next()`` in progress: the thread inside it pulls
        nothing more once that call returns."""
        self.abandon()  # flags first, without any lock
        if self.session is not None:
            self.session.notify()
        streams = [*self.segment_streams, self.stream]
        for stream in streams:
            stream.stop()
        self.stop_session()


def _member_entries(members: Sequence[Parallel], entry: dict[str, Any]) -> dict[str, Any]:
    """Each stage's in-flight entry of a stream over ``members``: the
    stream's inputs are the first stage's; a later stage of a fused segment
    has nothing in flight, its next input the first one not delivered."""
    return {members[0].name: entry, **{node.name: later_entry(entry) for node in members[1:]}}


def _range_reader(stream: Stream) -> Any:
    """The stage whose lines ``stream`` pulls as ranges for the workers to
    read (``take_range``: ``read_lines``), or ``None``. Not when stages
    before it are stamped (a ``count`` of the paths): each line's stamp is
    taken as it is pulled."""
    if stream.stamped_nodes():
        return None
    return stream.tip if callable(getattr(stream.tip, "take_range", None)) else None


def idle_worker_states(pool: Executor, stats: StreamStats) -> list[dict[str, Any]]:
    """Worker states between runs: a short session with no streams."""
    w = Policy(timeout_s=None, max_restarts=2**31, item_retries=0, on_error="raise")
    session = Supervisor(pool, run_id=-1, policy=w, stats=stats)
    try:
        session.start()  # also replaces a worker that died since the last run
        return session.worker_states()
    finally:
        session.stop()


def _rng_base(nodes: Sequence[CentralNode[Any]]) -> tuple[int, int, int]:
    """``with_rng`` keys after ``dispatch()``: an item's stream position (rank r
    of W gets base + s*W + r), so its random stream is the same on any world
    size; its seq without a shard."""
    shard = next((n for n in nodes if isinstance(n, Shard)), None)
    return (0, 1, 0) if shard is None else (shard.base, shard.ctx.world_size, shard.ctx.rank)

"""The reordering side of a boundary: in-order delivery (checkpoint capture:
:mod:`centralpipe.dispatch.capture`).

A :class:`Stream` is one ordered stream over a boundary: the central items
pulled for it are numbered (``seq``) and grouped into chunks (see
:mod:`centralpipe.dispatch.sender`); whoever runs the worker stages (inline,
or the pool — see :mod:`centralpipe.dispatch.supervisor`) puts each chunk's
result on the chunk; :meth:`Stream.outputs` yields the outputs in ``seq``
order. ``pending`` holds every chunk pulled but not yet fully delivered; with
the central stages' state it is the whole checkpoint (:meth:`Stream.capture`).

Two locks: ``chain_lock`` is held by the thread running the central chain
across the tip's ``next()`` (user code; see :mod:`centralpipe.dispatch.chainlock`),
``lock`` guards the bookkeeping below and is only ever held for a few
statements, never across user code: the consumer taking a result, and
stopping, never wait on the central chain. A reader of the checkpoint holds
both (``chain_lock`` first, bounded).

Invariants (under ``lock``, and under both for the pulled items):

- every item the central chain produced is either delivered, or in a pending
  chunk — always both or neither;
- ``in_flight`` == the number of items in pending chunks plus resumed items
  already taken from ``pulls.resume``, i.e. dispatched and not yet retired;
- chunks in ``pending`` have increasing, contiguous ``seq`` ranges; only the
  head chunk is ever being delivered (``current``).
"""

from __future__ import annotations

import abc
import concurrent.futures
import itertools
import logging
import operator
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any, NoReturn, cast

from centralpipe.checkpoint.model import Boundary, Captured
from centralpipe.dispatch import timeouts
from centralpipe.dispatch.budget import ResultBytes
from centralpipe.dispatch.capture import Capture
from centralpipe.dispatch.chainlock import Holding, Wake, new_chain_lock
from centralpipe.dispatch.chunk import Chunk
from centralpipe.dispatch.pullstate import PullState
from centralpipe.dispatch.stamps import Stamper
from centralpipe.dispatch.wire.protocol import ChunkResult, StageFailure
from centralpipe.dispatch.worker.chain import WorkerChain
from centralpipe.dispatch.worker.ranges import LineRange
from centralpipe.errors import CheckpointError, WorkerError
from centralpipe.stages import CentralNode
from centralpipe.stages.base import add_stage_note

__all__ = ["FIRST_CHUNK", "Driver", "Outputs", "Stamper", "Stream", "StreamStats"]

logger = logging.getLogger("centralpipe")

FIRST_CHUNK = 16


class Driver(abc.ABC):
    """Who runs a stream's chunks: inline, or the worker pool."""

    @abc.abstractmethod
    def wait_head(self) -> Chunk | None:
        """The oldest pending chunk once its result is in; ``None`` at the end."""

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Called once the stream is stopping; must return in bounded time."""

    def worker_states(self) -> list[Any] | None:
        """The workers' stateful-stage states (``None``: not a pool)."""
        return None


#: ``next(it, _END)``: the current chunk has no more outputs.
_END: Any = object()


class Outputs(Iterator[Any]):
    """A stream's outputs in ``seq`` order (:meth:`Stream.next_output`).

    Not a generator: a Ctrl-C raised inside a generator would end it, and the
    pass could not go on. This iterator ends only at the end of the stream or
    after an error."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __iter__(self) -> Outputs:
        return self

    def __next__(self) -> Any:
        return self.stream.next_output()


class StreamStats:
    """Counters that outlive one run (the Loader's ``metrics()``)."""

    def __init__(self, num_slots: int) -> None:
        self.dispatched = 0
        self.delivered = 0
        self.skipped = 0
        self.restarts = 0
        self.epoch_restarts = 0
        self.high_water = 0
        self.bytes_high_water = 0  # of results held before their turn (dispatch.budget)
        self.bytes_per_item = -1.0  # of this stream's results, measured (-1: not yet)
        self.wait_workers_s = 0.0
        self.wait_central_s = 0.0
        self.items_per_worker = [0] * num_slots
        #: Items whose worker stages the main process ran while the workers
        #: started (``dispatch.warm``).
        self.inline_items = 0
        #: Lines sent as byte ranges that the workers read (``dispatch.worker.ranges``).
        self.range_lines = 0
        self.chunk_size = FIRST_CHUNK


def _is_read_failure(chunk: Chunk, failure: StageFailure) -> bool:
    """``failure`` is a line of the chunk's range that could not be read."""
    items = chunk.items
    return isinstance(items, LineRange) and failure.stage == items.stage


class Stream:
    """One ordered stream over a boundary; see the module docstring."""

    def __init__(
        self,
        *,
        tip: CentralNode[Any],
        stamper: Stamper,
        chain: WorkerChain,
        epoch: int,
        next_seq: int,
        resume: Boundary | None,
        delivered_stamp: Any,
        buffer_size: int | None,
        chunk_size: int | None,
        on_error: str,
        stats: StreamStats,
        dispatch_name: str,
        parallelism: int,
        stream_id: int = 0,
        delivered: int = 0,
        skipped: int = 0,
        rng_base: tuple[int, int, int] = (0, 1, 0),
        chain_lock: threading.RLock | None = None,
    ) -> None:
        self.tip = tip
        self.stamper = stamper
        self.stream_id = stream_id
        self.chain = chain
        self.epoch = epoch
        self.next_seq = next_seq
        self.buffer_size = buffer_size
        self.fixed_chunk = chunk_size
        self.on_error = on_error
        self.stats = stats
        self.dispatch_name = dispatch_name
        self.parallelism = max(1, parallelism)
        self.driver: Driver | None = None  # set by whoever assembles the stream
        self.pinner: Any = None  # a dispatch.pinning.Pinner with pin_memory=True
        #: Outputs delivered this epoch (since its start or its last elastic
        #: resume) before the current chunk: the "step count" of a checkpoint.
        self.delivered = delivered
        #: Inputs before the current chunk that gave no output (skipped with
        #: on_error="skip", dropped by a worker filter, poison items passed at
        #: a resume), counted like ``delivered``: with worker stages that make
        #: at most one output per input, ``delivered + skipped`` is the first
        #: undelivered input's seq, which lets a checkpoint's step count be
        #: checked (``position.skipped``).
        self.skipped = skipped
        # with_rng keys: (base, step, offset): an item's key is base + seq*step + offset.
        self._key = rng_base
        #: Notified when room appears in the buffer (the pool's wake-up condition).
        self.wake: Wake | None = None
        #: The run's count of bytes held by results (with workers; see dispatch.budget).
        self.held: ResultBytes | None = None
        #: Held across the central chain's ``next()``; the Loader's, for the
        #: dispatch stream (it outlives runs); a parallel stage's stream is
        #: only pulled under that one already.
        self.chain_lock = new_chain_lock() if chain_lock is None else chain_lock
        #: The thread pulling this stream holds the chain lock (runs the
        #: central chain): set by ``dispatch.pull`` once it has the lock,
        #: cleared before it lets it go.
        self.in_chain = False
        self._chain_nodes = tip.chain()
        #: The bookkeeping lock: never held across user code.
        self.lock = threading.Lock()
        self.pending: deque[Chunk] = deque()
        self.by_cid: dict[int, Chunk] = {}
        self.next_cid = 0
        self.in_flight = 0
        self.exhausted = False
        self.central_error: BaseException | None = None
        self.finished = False
        self.broken = False
        self.stopping = False
        self.cost_per_item = 0.0
        self.waiting_readers = 0
        self.readers_lock = threading.Lock()  # += on an int is not atomic
        self._stamped = stamper.stamped
        #: The reader whose lines this stream pulls as ranges that workers
        #: read (``ReadLines.take_range``), or ``None``; set by the run.
        self.ranges: Any = None
        #: The chunk whose line could not be read (raised as read_lines raises).
        self.read_failed: Chunk | None = None
        # In-flight byte ranges become ranges of lines, read by the tip
        # (check_pipeline refused ranges for a stage that reads none).
        reader: Any = tip
        ranges = [] if resume is None else [reader.resumed_range(r) for r in resume.ranges]
        #: The pull's part (``dispatch.pull`` alone changes it): the
        #: checkpoint's in-flight inputs to dispatch again first, and more.
        self.pulls = PullState(resume, ranges)
        #: Reads this stream's part of a checkpoint (``dispatch.capture``).
        self.checkpoint = Capture(self)
        self.last_stamp = delivered_stamp if delivered_stamp is not None else stamper()
        # Delivery position inside the current chunk.
        self.current: Chunk | None = None
        self._cur_list: list[Any] = []
        self._cur_it: Iterator[Any] | None = None
        self._cur_base = 0
        #: The current chunk has no failures: its outputs may be taken in bulk.
        self._cur_plain = False
        #: Outputs of the current chunk before its first failure, and that failure.
        self._cur_limit = 0
        self._cur_failure: StageFailure | None = None
        #: The iteration is ending (finished or failed), and with what error;
        #: ended: every later ``next()`` raises ``StopIteration``.
        self._ending = False
        self._end_error: BaseException | None = None
        self._ended = False

    # -- checkpoints (read by dispatch.capture) ---------------------------------

    def reading(self, what: str = "state_dict()") -> Holding:
        """``with s.reading(what), s.lock:`` holds both locks to read state.
        The central thread yields to waiting readers between pull slices, so
        a reader waits for at most one ``next()`` of the chain, and never
        longer than ``config.CENTRAL_WAIT_S`` (then ``TimeoutError`` naming the stage
        that keeps the chain). Both locks are released at C level (see
        :class:`~centralpipe.dispatch.chainlock.Holding`): no interrupt can leave
        either held."""
        return Holding(self.chain_lock, what, self._chain_nodes, readers=self)

    def capture(self) -> Captured:
        """This stream's part of the checkpoint (:meth:`Capture.capture`)."""
        return self.checkpoint.capture()

    def capture_unlocked(self) -> Captured:
        """:meth:`capture` for a caller holding the locks (:meth:`Capture.capture_unlocked`)."""
        return self.checkpoint.capture_unlocked()

    def delivered_stamp(self) -> Any:
        """The count/shard stamp of the last delivered output (:meth:`Capture.delivered_stamp`)."""
        return self.checkpoint.delivered_stamp()

    def last_output_stamp(self) -> Any:
        """:meth:`delivered_stamp` without the lock (:meth:`Capture.last_output_stamp`)."""
        return self.checkpoint.last_output_stamp()

    # -- the delivery position -------------------------------------------------

    def delivered_in_current(self) -> int:
        """Outputs of the current chunk delivered so far."""
        it = self._cur_it
        if it is None:
            return 0
        return self._cur_base + len(self._cur_list) - operator.length_hint(it)

    def split_current(self, chunk: Chunk) -> tuple[int, int, int]:
        """(first input not fully delivered, outputs of it delivered, input of
        the last delivered output or -1) for the chunk being delivered."""
        d = self.delivered_in_current() if chunk is self.current else 0
        result = chunk.result
        if result is None or (d == 0 and chunk is not self.current):
            return 0, 0, -1
        counts = result.counts
        if counts is None and result.failures is None:
            return d, 0, d - 1
        counts = counts or [1] * len(chunk.items)
        done = 0
        last = -1
        for i, n in enumerate(counts):
            if i == chunk.raised_at and chunk is self.read_failed:
                # A line that could not be read is consumed, as read_lines
                # consumes it: a checkpoint resumes after it.
                return i + 1, 0, last
            if i == chunk.raised_at or done + n > d:
                return i, d - done, (i if d > done else last)
            done += n
            if n:
                last = i
        return len(counts), 0, last

    # -- stamps ----------------------------------------------------------------

    def stamp_now(self) -> Any:
        return self.stamper()

    def rng_key(self, chunk: Chunk) -> tuple[int, int]:
        """The ``with_rng`` key of the chunk's first item, and the step between items."""
        base, world, rank = self._key
        return (base + chunk.first_seq * world + rank, world)

    def stamped_nodes(self) -> list[CentralNode[Any]]:
        return self._stamped

    def accept(self, chunk: Chunk, result: ChunkResult) -> ChunkResult:
        """Bookkeeping for a chunk's result before it is delivered."""
        if chunk.unsendable:
            failures = sorted([*(result.failures or ()), *chunk.unsendable], key=lambda f: f.at)
            result = result._replace(
                failures=failures, counts=result.counts or [1] * len(chunk.items)
            )
        if result.elapsed_s > 0 and chunk.items:
            per_item = result.elapsed_s / len(chunk.items)
            self.cost_per_item = (
                per_item if self.cost_per_item <= 0 else 0.7 * self.cost_per_item + 0.3 * per_item
            )
        if chunk.skip_first:
            k = chunk.skip_first
            counts = result.counts or [1] * len(chunk.items)
            failed_first = any(f.at == 0 for f in result.failures or ())
            if k > counts[0] and not failed_first:
                # Only a worker flat_map makes several outputs per input, and
                # only running it tells how many: checked here, before delivery.
                chunk.mark_bad_skip(
                    f"damaged checkpoint: in_flight['{self.dispatch_name}'].skip_outputs must "
                    f"be <= {counts[0]} (the outputs of item seq {chunk.first_seq}), got {k}."
                )
                return result
            counts = [max(0, counts[0] - k), *counts[1:]]
            result = result._replace(outputs=result.outputs[k:], counts=counts)
        if result.failures and self.on_error == "skip":
            # A range's line that cannot be read is the reader's failure (as
            # read_lines raises it), not the worker stage's: never skipped.
            kept = [f for f in result.failures if _is_read_failure(chunk, f)]
            for failure in result.failures:
                if _is_read_failure(chunk, failure):
                    continue
                self.stats.skipped += 1
                seq = chunk.first_seq + failure.at
                if failure.text:
                    logger.warning("skipping item seq %d: %s", seq, failure.text)
                    continue
                logger.warning(
                    "skipping item seq %d: worker stage '%s' raised %s: %s",
                    seq,
                    failure.stage,
                    failure.exc_type,
                    failure.message,
                )
            result = result._replace(
                failures=kept or None, counts=result.counts or [1] * len(chunk.items)
            )
        if self.pinner is not None and result.outputs:
            chunk.set_pinned(self.pinner.submit(result.outputs))
        return result

    # -- delivery --------------------------------------------------------------

    def wait_head(self) -> Chunk | None:
        assert self.driver is not None
        return self.driver.wait_head()

    def outputs(self) -> Outputs:
        """Outputs in ``seq`` order (see :meth:`next_output`)."""
        return Outputs(self)

    def next_output(self) -> Any:
        """The next output in ``seq`` order; raises the central stage's
        exception (after delivering everything before it) or a
        ``WorkerError``, and then ends (``StopIteration``).

        A Ctrl-C (or any ``BaseException`` that is not an ``Exception``) is
        raised as it lands and ends nothing: every step re-reads the
        stream's state, which stays whole at every function call, so the
        next call goes on exactly where the interrupted one was."""
        if self._ended:
            raise StopIteration
        if self._ending:
            self._end()
        while True:
            chunk = self.current
            if chunk is not None:
                out = self._next_in_current(chunk)
                if out is not _END:
                    return out
                self._retire(chunk)
                continue
            if self.stopping:
                self._ended = True
                raise RuntimeError(
                    "this iterator was superseded: iter(loader), load_state_dict() or close() "
                    "was called since it started; iterate the loader again."
                )
            chunk = self.wait_head()
            if chunk is None:
                if self.central_error is not None:
                    # Not finished: a checkpoint now resumes after the item the
                    # central stage raised on (consumed by the failing stage).
                    self.broken = True
                    self._end_error = self.central_error
                else:
                    self.finished = True
                self._ending = True
                self._end()
            result = chunk.result
            assert result is not None
            if chunk.bad_skip:
                self.broken = True
                self._end_error = CheckpointError(chunk.bad_skip)
                self._ending = True
                self._end()
            if chunk.pinned is not None:
                result = self._take_pinned(chunk, result)
            self._begin(chunk, result)

    @property
    def end_handed_out(self) -> bool:
        """The pass finished and its end reached the consumer: ``finished``
        is set first, and an interrupt in :meth:`_end` (the next call
        finishes it) must not make a checkpoint skip the end the consumer
        has not seen (it would resume the next pass at once)."""
        return self.finished and self._ended

    def _end(self) -> NoReturn:
        """Stop the stream and end the iteration (``StopIteration``, or the
        error that ended it); finished by the next call if cut short."""
        self.stop()
        self._ended = True
        if self._end_error is None:
            raise StopIteration
        raise self._end_error

    def _begin(self, chunk: Chunk, result: ChunkResult) -> None:
        """Start delivering ``chunk``: its outputs up to its first failure."""
        outputs = result.outputs
        limit = len(outputs)
        failure = None
        if result.failures:
            failure = result.failures[0]
            for f in result.failures:
                if f.at < failure.at:
                    failure = f
            counts = result.counts or [1] * len(chunk.items)
            limit = sum(counts[: failure.at])
        # Plain assignments only, ``current`` last: a Ctrl-C leaves the chunk
        # either not begun or begun whole.
        self._cur_base = 0
        self._cur_list = outputs
        self._cur_limit = limit
        self._cur_failure = failure
        self._cur_plain = result.failures is None
        self._cur_it = iter(outputs)
        self.current = chunk

    def _next_in_current(self, chunk: Chunk) -> Any:
        """The current chunk's next output, ``_END`` once it is delivered
        (or ended by ``stop()``); raises its failure in its item's place."""
        it = self._cur_it
        assert it is not None
        failure = self._cur_failure
        if failure is None or self.delivered_in_current() < self._cur_limit:
            # ``for``, not ``next(it, _END)``: CPython may handle a Ctrl-C
            # right after a call returns, so the interrupt would land with
            # the iterator advanced and the output dropped (every later
            # batch shifted by one). ``for`` advances it without a call, and
            # the output is returned with no call in between.
            for out in it:
                return out
            return _END
        if self.stopping:  # stop() ended the chunk: superseded
            return _END
        if _is_read_failure(chunk, failure):
            # As read_lines raises it: a central stage's error, after the
            # lines before it; the stream ends (a checkpoint resumes after it).
            chunk.mark_raised(failure.at)
            self.read_failed = chunk
            self.broken = True
            lines = cast(LineRange, chunk.items)
            error = lines.error_at(failure.at, failure.message)
            add_stage_note(error, lines.stage)
            self._end_error = error
            self._ending = True
            self._end()
        seq = chunk.first_seq + failure.at
        msg = failure.text or (
            f"worker stage '{failure.stage}' raised {failure.exc_type} on item seq {seq}: "
            f"{failure.message}"
        )
        error = WorkerError(
            msg,
            stage=failure.stage,
            seq=seq,
            exc_type=failure.exc_type or None,
            remote_traceback=failure.traceback or None,
            exitcode=failure.exitcode,
        )
        chunk.mark_raised(failure.at)
        self.broken = True
        self._ended = True
        raise error

    # -- delivery ahead of the consumer (``central="service"``) ------------------

    def ready_ahead(self) -> bool:
        """Whether :meth:`next_output` would return an output at once, from
        a chunk without failures: the rest of the current chunk, or the
        first output of the next one when its plain result is in. Only then
        may a service deliver ahead of its client, because only such a
        delivery can be stepped back (:meth:`step_back`). Never waits."""
        if self._ended or self._ending or self.stopping:
            return False
        nxt = 0
        if self.current is not None:
            it = self._cur_it
            if not self._cur_plain or it is None:
                return False
            if operator.length_hint(it) > 0:
                return True
            nxt = 1  # the current chunk is pending[0] until it is retired
        with self.lock:
            head = self.pending[nxt] if len(self.pending) > nxt else None
        if head is None or head.bad_skip or head.pinned is not None:
            return False
        result = head.result
        return result is not None and result.failures is None and len(result.outputs) > 0

    def step_back(self) -> int:
        """Move the delivery position back by the last output, which came
        from the current chunk (a delivery that :meth:`ready_ahead`
        allowed); returns the position to give :meth:`step_to` to undo it.

        Every output before it is delivered still, and the chunk before the
        current one stays retired: its last output is one the consumer got.
        The checkpoint, ``delivered_stamp`` and ``split_current`` all read the
        position from the iterator, so they describe the consumer's
        position again."""
        it = self._cur_it
        if self.current is None or it is None or not self._cur_plain:
            raise RuntimeError("step_back() needs an output delivered from the current chunk")
        position = len(self._cur_list) - operator.length_hint(it)
        if position < 1:
            raise RuntimeError("step_back() needs an output delivered from the current chunk")
        it.__setstate__(position - 1)  # type: ignore[attr-defined]
        return position

    def step_to(self, position: int) -> None:
        """Deliver again up to ``position`` of the current chunk (undoes
        :meth:`step_back`: the same outputs, nothing is run again)."""
        it = self._cur_it
        if it is not None:
            it.__setstate__(position)  # type: ignore[attr-defined]

    def take_plain(self, out: list[Any], n: int) -> int:
        """Append up to ``n`` undelivered outputs of the current chunk to
        ``out`` in one slice, when it has no failures (else none); returns
        how many. Delivers them exactly as :meth:`next_output` would: it
        reads the same iterator, which the next :meth:`next_output` finds
        advanced. Only for the thread consuming this stream."""
        it = self._cur_it
        if it is None or not self._cur_plain:
            return 0
        before = len(out)
        out.extend(itertools.islice(it, n))
        return len(out) - before

    def _take_pinned(self, chunk: Chunk, result: ChunkResult) -> ChunkResult:
        """The chunk's outputs as the pin thread pinned them. A failure to pin
        (say, out of pinned memory) is raised once, as itself with a note,
        and ends the iteration as a central stage's error does; the chunk is
        not begun, so a checkpoint resumes at its first output."""
        future = chunk.pinned
        while True:
            try:
                pinned = future.result(timeout=timeouts.PIN_POLL_S)
                break
            except concurrent.futures.TimeoutError:
                if self.stopping:
                    self._ended = True
                    raise RuntimeError("this iterator was superseded while pinning") from None
            except Exception as exc:
                exc.add_note(
                    f"raised while pinning the outputs of item seq {chunk.first_seq} and "
                    "after (LoaderConfig(pin_memory=True))"
                )
                self._end_error = exc
                self._ending = True
                self._end()
        result = result._replace(outputs=pinned)
        chunk.put_pinned(result)
        return result

    def _retire(self, chunk: Chunk) -> None:
        """The current chunk is delivered. Its bytes first (idempotent), then
        the counts it needs (calls, changing nothing), then plain bookkeeping
        with no call in between, ending with the one call that changes
        ``pending``: CPython handles a Ctrl-C only at a call (after a C call
        returns, or as a Python function starts), so it leaves the chunk
        retired whole or not at all (then the next call retires it)."""
        if self.held is not None:
            self.held.release(self, chunk)
        with self.lock:
            self.by_cid.pop(chunk.cid, None)  # idempotent
            n = len(chunk.items)
            done = len(chunk.result.outputs) if chunk.result else 0
            counts = chunk.result.counts if chunk.result else None
            empty = counts.count(0) if counts else 0
            pending = self.pending
            # From here on no call until the last statement.
            self.in_flight -= n
            if chunk.stamps:
                self.last_stamp = chunk.stamps[-1]
            self.stats.delivered += done
            self.delivered += done
            self.skipped += empty
            self._cur_it = None
            self._cur_list = []
            self._cur_plain = False
            self.current = None
            pending.popleft()
        if self.wake is not None:
            self.wake.notify_all()

    def stop(self) -> None:
        """Abandon or finish the run; idempotent and bounded (the bookkeeping
        lock only: a central ``next()`` in progress is not waited for). An
        iterator still delivering a chunk stops at its next item and raises
        (see ``outputs``)."""
        self.stopping = True  # first, without the lock: pullers and waiters give up
        with self.lock:
            it = self._cur_it
            if it is not None and not self.finished:
                it.__setstate__(len(self._cur_list))  # type: ignore[attr-defined]
        if self.driver is not None:
            self.driver.stop()

    def delivered_in_chunk(self) -> int:
        """Outputs of the current chunk already delivered (for metrics)."""
        return self.delivered_in_current() if self.current is not None else 0

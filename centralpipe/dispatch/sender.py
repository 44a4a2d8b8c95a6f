"""The sending side of a boundary: sending chunks round-robin, and who drives it.

:func:`~centralpipe.dispatch.pull.pull_chunk` pulls up to one chunk of items
from the stream's source (:mod:`centralpipe.dispatch.pull`). Then one of the
drivers has the chunk run:

- :class:`InlineDriver` (no workers, or no worker stages): in the thread that
  consumes the stream;
- :class:`FeederDriver` (the dispatch boundary with workers): a *feeder*
  thread runs the central chain, pulls chunks and sends them round-robin;
  the consumer waits for results;
- :class:`SegmentDriver` (a parallel central stage with workers): the thread
  running the central chain pulls, sends and waits itself.

Only the thread running the central chain sends chunks (and re-sends the
chunks of a replaced worker, :func:`drain_resends`), so a chunk is never sent
twice to the same worker generation, and the supervisor thread, which reads
every result, never blocks on a send.

A Ctrl-C in the thread that drives a stream (the consumer, inline or
running a parallel stage) leaves a chunk closed but not run or not sent; the
next call runs it (``InlineDriver``) or sends it (``SegmentDriver``) before
it pulls another. A re-send stays queued until it is sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.chunk import Chunk
from centralpipe.dispatch.pull import has_room, pull_chunk, target_chunk
from centralpipe.dispatch.reorder import FIRST_CHUNK, Driver, Stream
from centralpipe.dispatch.supervisor import Supervisor
from centralpipe.dispatch.wire import protocol
from centralpipe.dispatch.wire.protocol import ChunkResult, StageFailure
from centralpipe.dispatch.worker.loop import result_message, run_received
from centralpipe.dispatch.worker.ranges import LineRange, run_range

__all__ = [
    "FIRST_CHUNK",
    "FeederDriver",
    "InlineDriver",
    "SegmentDriver",
    "drain_resends",
    "encode_chunk",
    "has_room",
    "pull_chunk",
    "run_as_worker",
    "run_skip",
    "send_chunk",
    "target_chunk",
]


# -- results ---------------------------------------------------------------


def copy_items(s: Stream, chunk: Chunk) -> list[Any]:
    """The chunk's items as a worker stage sees them: a serialised copy.

    Inline (``num_workers=0``) this keeps a stage that mutates its item in
    place from changing the checkpoint's in-flight items, as a worker
    process would. Items that cannot be pickled become ``None`` and are
    failures of the boundary stage (:func:`sendable_items`)."""
    flat = s.chain.flat_arrays
    try:
        return protocol.copy_items(chunk.items, flat)
    except Exception:  # an item cannot be pickled, or unpickled again
        return protocol.copy_items(sendable_items(s, chunk, roundtrip=True), flat)


def sendable_items(s: Stream, chunk: Chunk, *, roundtrip: bool = False) -> list[Any]:
    """Items with each one that cannot be pickled (or, with ``roundtrip``,
    unpickled again) replaced by ``None`` and recorded in ``chunk.unsendable``
    (the rest of the chunk goes on)."""
    items = list(chunk.items)
    failures = [f for f in chunk.unsendable if f.text]  # keep poison items
    for i, item in enumerate(items):
        exc = protocol.picklable_error(item, roundtrip=roundtrip)
        if exc is not None:
            text = (
                "an item from the central stages cannot be pickled (or unpickled again) "
                "for the worker stages: "
                f"{protocol.exception_text(exc)}"
            )
            failures.append(StageFailure(i, s.dispatch_name, type(exc).__name__, text, ""))
            items[i] = None
    chunk.set_unsendable(failures)
    return items


def run_skip(chunk: Chunk) -> frozenset[int]:
    """Inputs the worker stages must not run: poison and unsendable items."""
    return frozenset(chunk.skip).union(f.at for f in chunk.unsendable)


def encode_chunk(run_id: int, s: Stream, chunk: Chunk) -> protocol.Encoded:
    """The chunk's ``MSG_CHUNK`` as it goes to a worker: items that cannot be
    pickled are failures of the boundary stage (:func:`sendable_items`)."""

    def message(items: list[Any]) -> tuple[Any, ...]:
        msg, flats = protocol.chunk_message(
            run_id,
            s.stream_id,
            chunk.cid,
            s.epoch,
            chunk.first_seq,
            items,
            run_skip(chunk),
            chunk.per_item,
            s.rng_key(chunk),
            s.chain.flat_arrays,
        )
        if flats is not None:
            chunk.set_flats(flats)
        return msg

    try:
        return protocol.encode(message(chunk.items))
    except Exception:
        return protocol.encode(message(sendable_items(s, chunk)))


def run_as_worker(s: Stream, chunk: Chunk) -> ChunkResult:
    """Run the chunk's worker stages in this thread exactly as a worker
    process would, serialisation included (the inline warm start,
    ``dispatch.warm``): the chunk is encoded as :func:`send_chunk` encodes
    it and decoded as the worker decodes it, its result is encoded as the
    worker sends it (:func:`~centralpipe.dispatch.worker.result_message`)
    and decoded as the supervisor receives it. So an item or a result that
    cannot cross the boundary fails here exactly as it fails with workers
    (a chunk that cannot be decoded whole is run again item by item, as the
    supervisor has it re-sent), whatever the timing of the hand-over."""
    while True:
        msg = protocol.decode(encode_chunk(0, s, chunk))
        _, _, stream, cid, epoch, first_seq, items, skip, per_item, key = msg
        result = run_received(s.chain, stream, epoch, first_seq, items, skip, per_item, None, key)
        reply = protocol.decode(result_message(0, stream, cid, result, per_item, s.chain))
        result = reply[-1]
        if not isinstance(result.outputs, protocol.Undecodable):
            break
        if chunk.per_item:  # cannot happen: each item is sealed on its own
            raise RuntimeError(f"chunk {chunk.cid} cannot be decoded even item by item")
        chunk.seal_per_item()
    if chunk.per_item:
        stage = s.chain.specs[-1].name if s.chain.specs else None
        result = protocol.unseal_outputs(result, stage, s.dispatch_name)
    return result


def send_chunk(session: Supervisor, s: Stream, chunk: Chunk) -> None:
    """Send ``chunk`` to its worker (round-robin within its stream for a
    new one), unless that worker already has it or its result is in."""
    ex = session.executor
    if chunk.slot < 0:
        chunk.assign(session.next_slot(s.stream_id))
    slot = ex.slots[chunk.slot]
    # ``session.sending`` tells a stop that this thread waits on a worker, not
    # on a central stage (FeederDriver.in_central). A send from inside a
    # parallel stage's next() restores the outer value (False) as it ends.
    outer = session.sending
    session.sending = True
    try:
        with slot.send_lock:
            if chunk.sent_gen == slot.gen or chunk.result is not None:
                return
            encoded = encode_chunk(session.run_id, s, chunk)
            # Marked sent before writing: the result (or a request to send the
            # chunk again per item) may come back before the write returns. A
            # failed write means a dead worker: its replacement bumps ``gen``.
            chunk.mark_sent(slot.gen)
            try:
                ex.send(slot, encoded)
            except BaseException:
                # Cut short (Ctrl-C): not known to be sent. A worker process
                # that may hold part of it is replaced by the executor (and the
                # chunk sent again); a worker thread is sent it again.
                chunk.mark_unsent()
                raise
    finally:
        session.sending = outer


def drain_resends(session: Supervisor) -> None:
    """Re-send the chunks of replaced workers (the sending thread only)."""
    while session.resend:
        # Taken off the queue once sent: a Ctrl-C in the send (a parallel
        # stage run by the consumer) leaves it queued, not lost. Only this
        # thread takes from the queue.
        stream, chunk = session.resend[0]
        if not stream.stopping:
            send_chunk(session, stream, chunk)
        session.resend.popleft()


def _head_ready(s: Stream) -> bool:
    try:
        head = s.pending[0]
    except IndexError:
        return s.exhausted
    return head.closed and head.result is not None


def _take_head(s: Stream) -> tuple[bool, Chunk | None]:
    """Under ``s.lock``: ``(True, head)`` once the oldest chunk's result is in,
    ``(True, None)`` when nothing is pending and the stream is exhausted,
    ``(False, None)`` while the head is still being worked on."""
    with s.lock:
        if s.pending:
            head = s.pending[0]
            if head.closed and head.result is not None:
                return True, head
            return False, None
        return s.exhausted, None


class InlineDriver(Driver):
    """Worker stages run in the thread consuming the stream, a chunk at a
    time: over a copy of the items (``num_workers=0``), or with
    ``as_worker`` through a worker's serialisation both ways
    (:func:`run_as_worker`: the inline warm start)."""

    def __init__(
        self,
        stream: Stream,
        on_stop: Callable[[], None] | None = None,
        *,
        as_worker: bool = False,
    ) -> None:
        self.stream = stream
        self.on_stop = on_stop
        self.as_worker = as_worker

    def stop(self) -> None:
        if self.on_stop is not None:
            self.on_stop()

    def wait_head(self) -> Chunk | None:
        s = self.stream
        with s.lock:
            head = s.pending[0] if s.pending else None
        if head is not None and head.result is not None:
            return head
        if head is not None and head.closed:
            # Pulled, but a Ctrl-C cut the pull or its run short: run it now
            # (the worker stages depend only on the item and its seq).
            chunk = head
        else:
            pulled = pull_chunk(s)
            if pulled is None:
                return None
            chunk = pulled
        if isinstance(chunk.items, LineRange):  # resumed in-flight lines of a range
            result = run_range(
                s.chain, chunk.items, s.epoch, chunk.first_seq, run_skip(chunk), None, 0,
                s.rng_key(chunk),
            )  # fmt: skip
        elif s.chain.specs and self.as_worker:
            result = run_as_worker(s, chunk)
        elif s.chain.specs:
            # The worker stages get a copy, as a worker would: a stage that
            # mutates its item in place must not change the checkpoint.
            items = copy_items(s, chunk)
            result = s.chain.run_chunk(
                s.epoch, chunk.first_seq, items, run_skip(chunk), None, 0, s.rng_key(chunk)
            )
        else:
            result = ChunkResult(list(chunk.items), None, None, 0.0)
        chunk.put_result(s.accept(chunk, result))
        return chunk


def _send_cut_short(session: Supervisor, s: Stream) -> None:
    """Send the newest chunk if a Ctrl-C left it closed but never sent (in
    ``pull_chunk``, or in ``send_chunk`` before its write). A chunk whose
    write was cut short is handled by the executor (its worker is replaced
    and the chunk sent again); those of replaced workers by
    :func:`drain_resends`."""
    with s.lock:
        last = s.pending[-1] if s.pending else None
    if last is not None and last.closed and last.result is None and last.sent_gen < 0:
        send_chunk(session, s, last)


class SegmentDriver(Driver):
    """A parallel central stage's stream over the workers, driven by the
    thread running the central chain: each call pulls and sends at most one
    chunk, then returns the head chunk once its result is in."""

    def __init__(self, stream: Stream, session: Supervisor) -> None:
        self.stream = stream
        self.session = session

    def wait_head(self) -> Chunk | None:
        s, session = self.stream, self.session
        while True:
            if s.stopping or session.abandoned:
                raise RuntimeError("the run was stopped")
            session.check()
            drain_resends(session)
            _send_cut_short(session, s)
            room = has_room(s) and session.held.may_pull(s)
            if room:
                chunk = pull_chunk(s)
                if chunk is not None:
                    send_chunk(session, s, chunk)
            done, head = _take_head(s)
            if done:
                return head
            if room:
                continue  # keep the workers fed before waiting
            session.wake.wait_unless(
                lambda: _head_ready(s) or bool(session.resend) or session.error is not None,
                timeouts.POLL_S,
            )


class FeederDriver(Driver):
    """The dispatch boundary over the workers: a feeder thread pulls chunks
    from the central chain and sends them; the consumer waits for results."""

    def __init__(self, stream: Stream, session: Supervisor) -> None:
        self.stream = stream
        self.session = session
        self.error: BaseException | None = None
        stream.wake = session.wake
        self.thread = threading.Thread(target=self._feed, name="centralpipe-feeder", daemon=True)
        #: ``thread.start()`` was called (it may have been interrupted).
        self.launched = False

    def start(self) -> None:
        self.launched = True
        self.thread.start()

    def in_central(self) -> bool:
        """The feeder is inside a central ``next()`` (holds the chain lock to
        pull: ``Stream.in_chain``) and not sending to a worker
        (``Supervisor.sending``): a stop does not wait for it, as only that
        ``next()`` returning can free it."""
        return self.stream.in_chain and not self.session.sending

    def _room(self) -> bool:
        return has_room(self.stream) and self.session.held.may_pull(self.stream)

    def _feed(self) -> None:
        s, session = self.stream, self.session
        try:
            while not (s.stopping or session.abandoned):
                drain_resends(session)
                if not self._room():
                    session.wake.wait_unless(
                        lambda: s.stopping or bool(session.resend) or self._room(), timeouts.POLL_S
                    )
                    continue
                chunk = pull_chunk(s)
                if chunk is not None:
                    send_chunk(session, s, chunk)
        except BaseException as exc:  # a bug, or a central stage's BaseException
            self.error = exc
            session.notify()

    def wait_head(self) -> Chunk | None:
        s, session = self.stream, self.session
        started = time.perf_counter()
        try:
            while True:
                done, head = _take_head(s)
                if done:
                    return head
                error = self.error
                if error is not None:
                    if not isinstance(error, Exception):
                        # KeyboardInterrupt, SystemExit raised by a central
                        # stage in the feeder: what it raised, at once. The
                        # items pulled so far are kept (pull_chunk).
                        raise error
                    raise RuntimeError("centralpipe feeder thread failed") from error
                session.check()
                session.wake.wait_unless(
                    lambda: _head_ready(s) or session.error is not None or self.error is not None,
                    timeouts.POLL_S,
                )
        finally:
            s.stats.wait_workers_s += time.perf_counter() - started

    def stop(self) -> None:
        sender = self.thread if self.launched else None
        self.session.stop(sender=sender, in_central=self.in_central)

    def worker_states(self) -> list[Any] | None:
        return self.session.worker_states()

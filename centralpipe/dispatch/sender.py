"""The sending side of a boundary: pulling chunks and sending them round-robin.

:func:`pull_chunk` pulls up to one chunk of items from the stream's source
(the central stage before the boundary) into a
:class:`~centralpipe.dispatch.reorder.Stream`, holding the stream's lock in
short slices so ``state_dict()``/``query()`` get it promptly. Then one of the
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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from centralpipe.dispatch import protocol
from centralpipe.dispatch.guard import busy_stage
from centralpipe.dispatch.protocol import Chunk, ChunkResult, StageFailure
from centralpipe.dispatch.reorder import FIRST_CHUNK, Driver, Stream
from centralpipe.dispatch.supervisor import POLL_S, Session

__all__ = [
    "FeederDriver",
    "InlineDriver",
    "SegmentDriver",
    "drain_resends",
    "pull_chunk",
    "run_skip",
    "send_chunk",
]

#: A chunk being filled is sent after this long even if not full.
FLUSH_S = 0.02
#: The feeder releases the lock at least this often while pulling.
LOCK_SLICE_S = 0.0005
#: Work per chunk the adaptive chunk size aims at.
TARGET_CHUNK_S = 0.005
MAX_CHUNK = 1024
#: Most result bytes per chunk (as measured): a quarter of the default
#: shared-memory ring, so a worker writes its next results while the main
#: process copies out the previous ones.
MAX_CHUNK_RESULT_BYTES = 16 * 2**20
#: Most items pulled between two looks at the clock (one at a time; in
#: bulk, up to ``MAX_CHUNK``).
PULL_BURST = 32


def target_chunk(s: Stream) -> int:
    """Items for the next chunk: fixed, or adapted to the measured cost."""
    n = _chunk_target(s)
    s.stats.chunk_size = n
    return n


def _chunk_target(s: Stream) -> int:
    if s.fixed_chunk is not None:
        n = s.fixed_chunk
    elif s.cost_per_item <= 0:
        n = FIRST_CHUNK
    else:
        n = max(1, min(MAX_CHUNK, int(TARGET_CHUNK_S / s.cost_per_item)))
        per_item = s.stats.bytes_per_item  # measured by dispatch.budget; < 0: not yet
        if per_item > 0:
            n = max(1, min(n, int(MAX_CHUNK_RESULT_BYTES / per_item)))
    if s.buffer_size is not None:
        n = min(n, max(1, s.buffer_size // (2 * s.parallelism)))
    return n


def has_room(s: Stream) -> bool:
    """Whether the buffer has room for a whole chunk. Pulling as soon as one
    item fits would size every later chunk like the one just retired: the
    small first chunks would stay small for the whole epoch."""
    if s.exhausted:
        return False
    if s.buffer_size is None:
        return True
    return s.buffer_size - s.in_flight >= _chunk_target(s)


def pull_chunk(s: Stream) -> Chunk | None:
    """Pull up to one chunk of items; ``None`` when nothing is left (or
    stopping). The chunk is in ``pending`` from its first item on.

    The central chain runs under ``s.chain_lock``, in slices; the counters
    move under ``s.lock`` before the slice ends, so a reader holding both
    sees every pulled item either in a pending chunk or not yet pulled.
    After the stream is stopped, no slice starts: a thread that was inside
    ``next()`` leaves the chain when that call returns.

    Only an ``Exception`` from the chain is a central stage's failure (it
    ends the stream after the items before it). Anything else — Ctrl-C
    (``KeyboardInterrupt``), ``SystemExit`` — is re-raised at once, after the
    items pulled so far are kept in the chunk, closed (:func:`_keep`): the
    drivers then run it like any other, so the pass goes on exactly."""
    target = target_chunk(s)
    stamped = bool(s._stamped)
    with s.lock:
        if s.exhausted or s.stopping:
            return None
        if s.buffer_size is not None:
            target = max(1, min(target, s.buffer_size - s.in_flight))
        first_seq = s._resume[0][0] if s._resume else s.next_seq
        chunk = Chunk(s.next_cid, first_seq, stamped)
        s.next_cid += 1
        s.pending.append(chunk)
        s.by_cid[chunk.cid] = chunk
    counted = [0]  # items of the chunk already counted in next_seq and in_flight
    try:
        return _fill(s, chunk, target, counted)
    except BaseException:
        _keep(s, chunk, counted)
        raise


def _count(s: Stream, chunk: Chunk, counted: list[int]) -> None:
    """Under ``s.lock``: count the chunk's items not yet counted. Derived
    from the chunk itself (its seqs are contiguous, resumed items first), so
    it is right wherever a slice was cut short."""
    n = len(chunk.items)
    s.in_flight += n - counted[0]
    counted[0] = n
    end = chunk.first_seq + n
    if end > s.next_seq:
        s.next_seq = end
    if s.in_flight > s.stats.high_water:
        s.stats.high_water = s.in_flight


def _keep(s: Stream, chunk: Chunk, counted: list[int]) -> None:
    """The chunk being filled was cut short (Ctrl-C, or a bug of ours): keep
    what it holds as a closed chunk, or drop it if empty. No stage has moved
    since its last item was pulled, so a missing stamp is taken now."""
    stamps = chunk.stamps
    try:
        if stamps is not None and len(stamps) < len(chunk.items):
            stamps.append(s._stamp_now())
    finally:
        with s.lock:
            _count(s, chunk, counted)
            if chunk.closed:
                pass
            elif chunk.items:
                chunk.closed = True
                s.stats.dispatched += len(chunk.items)
            elif chunk in s.pending:
                s.pending.remove(chunk)
                del s.by_cid[chunk.cid]


def _fill(s: Stream, chunk: Chunk, target: int, counted: list[int]) -> Chunk | None:
    started = time.perf_counter()
    nxt = s.tip.next
    items, stamps = chunk.items, chunk.stamps
    append = items.append
    # Without stamps, items come in bulk (``pull_into``): a source or a
    # parallel stage hands out a slice at a time instead of one per call.
    pull = s.tip.pull_into if stamps is None else None
    most = PULL_BURST if pull is None else MAX_CHUNK
    chain_lock = s.chain_lock
    resume = s._resume
    while True:
        if s._readers:
            # Lock hand-off is not fair: drop the GIL so a waiting
            # state_dict()/query() gets the lock before we take it again.
            time.sleep(0)
        # Taken inside the try and noted in one statement: an interrupt
        # (Ctrl-C) between taking it and entering the try would keep the
        # chain locked for good (every state_dict() would time out).
        acquired = False
        try:
            acquired = chain_lock.acquire(timeout=POLL_S)
            if not acquired:
                if s.stopping:
                    break
                continue  # a reader, or a stopped run's thread still in next()
            if s.stopping:
                break
            t0 = time.perf_counter()
            slice_end = t0 + LOCK_SLICE_S
            while resume and len(items) < target:
                seq, item, stamp = resume[0]
                if stamps is not None and stamp is None:
                    stamp = s._stamp_now()
                # From here to the popleft no function is called: an item is
                # in the chunk or still to resume, never both or neither.
                if seq in s._resume_skip:
                    chunk.skip.add(len(items))
                if seq == s._resume_skip_first[0]:
                    chunk.skip_first = s._resume_skip_first[1]
                if stamps is not None:
                    stamps.append(stamp)
                append(item)
                resume.popleft()
            before = len(items)
            exhausted = False
            error: Exception | None = None
            try:
                while len(items) < target:
                    # Pull in short bursts; look at the clock between them.
                    burst = min(s._burst, target - len(items))
                    if pull is not None:
                        pull(items, burst)
                    else:
                        for _ in range(burst):
                            if s.stopping:  # a next() that blocked may have outlived the run
                                break
                            # Appended before it is stamped: an interrupt at
                            # the stamp's call would otherwise drop the item
                            # the chain has just produced (a whole batch).
                            append(nxt())
                            if stamps is not None:
                                stamps.append(s._stamp_now())
                    if time.perf_counter() > slice_end or s.stopping:
                        break
            except StopIteration:
                exhausted = True
            except Exception as exc:  # a central stage failed
                error = exc
                exhausted = True
                if stamps is not None and len(stamps) < len(items):
                    # Raised between the pull and its stamp: no stage has
                    # moved since, so the stamp now is that item's.
                    stamps.append(s._stamp_now())
            added = len(items) - before
            now = time.perf_counter()
            if added:
                # Slow central stages get a look at the clock after every
                # item, so the lock is never held much past LOCK_SLICE_S.
                per_item = max(1e-9, (now - t0) / added)
                s._burst = max(1, min(most, int(LOCK_SLICE_S / per_item / 4)))
            with s.lock:
                if exhausted:
                    s.exhausted = True
                    s.central_error = error
                _count(s, chunk, counted)
                s.stats.wait_central_s += now - t0
                done = s.exhausted or len(items) >= target
                if done or now - started > FLUSH_S:
                    if not items:
                        s.pending.remove(chunk)
                        del s.by_cid[chunk.cid]
                        return None
                    chunk.closed = True
                    s.stats.dispatched += len(items)
                    return chunk
        finally:
            if acquired:
                chain_lock.release()
    # stopping: leave the chunk in pending (the run is abandoned anyway)
    return None


# -- results ---------------------------------------------------------------


def copy_items(s: Stream, chunk: Chunk) -> list[Any]:
    """The chunk's items as a worker stage sees them: a serialised copy.

    Inline (``num_workers=0``) this keeps a stage that mutates its item in
    place from changing the checkpoint's in-flight items, as a worker
    process would. Items that cannot be pickled become ``None`` and are
    failures of the boundary stage (:func:`sendable_items`)."""
    try:
        return protocol.copy_items(chunk.items)
    except Exception:  # an item cannot be pickled, or unpickled again
        return protocol.copy_items(sendable_items(s, chunk, roundtrip=True))


def sendable_items(s: Stream, chunk: Chunk, *, roundtrip: bool = False) -> list[Any]:
    """Items with each one that cannot be pickled (or, with ``roundtrip``,
    unpickled again) replaced by ``None`` and recorded in ``chunk.unsendable``
    (the rest of the chunk goes on)."""
    items = list(chunk.items)
    chunk.unsendable = [f for f in chunk.unsendable if f.text]  # keep poison items
    for i, item in enumerate(items):
        exc = protocol.picklable_error(item, roundtrip=roundtrip)
        if exc is not None:
            text = (
                "an item from the central stages cannot be pickled (or unpickled again) "
                "for the worker stages: "
                f"{protocol.exception_text(exc)}"
            )
            chunk.unsendable.append(StageFailure(i, s.dispatch_name, type(exc).__name__, text, ""))
            items[i] = None
    return items


def run_skip(chunk: Chunk) -> frozenset[int]:
    """Inputs the worker stages must not run: poison and unsendable items."""
    return frozenset(chunk.skip).union(f.at for f in chunk.unsendable)


def send_chunk(session: Session, s: Stream, chunk: Chunk) -> None:
    """Send ``chunk`` to its worker (round-robin for a new one), unless that
    worker already has it or its result is in."""
    ex = session.executor
    if chunk.slot < 0:
        chunk.slot = session.next_slot()
    slot = ex.slots[chunk.slot]
    with slot.send_lock:
        if chunk.sent_gen == slot.gen or chunk.result is not None:
            return

        def message(items: list[Any]) -> tuple[Any, ...]:
            return protocol.chunk_message(
                session.run_id,
                s.stream_id,
                chunk,
                s.epoch,
                items,
                run_skip(chunk),
                s.rng_key(chunk),
            )

        try:
            encoded = protocol.encode(message(chunk.items))
        except Exception:
            encoded = protocol.encode(message(sendable_items(s, chunk)))
        # Marked sent before writing: the result (or a request to send the
        # chunk again per item) may come back before the write returns. A
        # failed write means a dead worker: its replacement bumps ``gen``.
        chunk.sent_gen = slot.gen
        try:
            ex.send(slot, encoded)
        except BaseException:
            # Cut short (Ctrl-C): not known to be sent. A worker process
            # that may hold part of it is replaced by the executor (and the
            # chunk sent again); a worker thread is sent it again.
            chunk.sent_gen = -1
            raise


def drain_resends(session: Session) -> None:
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
    """Worker stages run in the thread consuming the stream, a chunk at a time."""

    def __init__(self, stream: Stream, on_stop: Callable[[], None] | None = None) -> None:
        self.stream = stream
        self.on_stop = on_stop

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
        if s.chain.specs:
            # The worker stages get a copy, as a worker would: a stage that
            # mutates its item in place must not change the checkpoint.
            items = copy_items(s, chunk)
            result = s.chain.run_chunk(
                s.epoch, chunk.first_seq, items, run_skip(chunk), None, 0, s.rng_key(chunk)
            )
        else:
            result = ChunkResult(list(chunk.items), None, None, 0.0)
        chunk.result = s.accept(chunk, result)
        return chunk


def _send_cut_short(session: Session, s: Stream) -> None:
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

    def __init__(self, stream: Stream, session: Session) -> None:
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
            with session.wake:
                if not _head_ready(s) and not session.resend and session.error is None:
                    session.wake.wait(POLL_S)


#: A feeder in these is not stuck in a central stage (a worker may unblock it).
_SEND_CODES = frozenset({send_chunk.__code__})


class FeederDriver(Driver):
    """The dispatch boundary over the workers: a feeder thread pulls chunks
    from the central chain and sends them; the consumer waits for results."""

    def __init__(self, stream: Stream, session: Session) -> None:
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

    def _in_central(self) -> bool:
        """The feeder is inside a central ``next()`` (not sending to a worker)."""
        ident = self.thread.ident
        if ident is None:  # not started
            return False
        return busy_stage(self.stream._chain_nodes, ident, _SEND_CODES) is not None

    def _room(self) -> bool:
        return has_room(self.stream) and self.session.held.may_pull(self.stream)

    def _feed(self) -> None:
        s, session = self.stream, self.session
        try:
            while not (s.stopping or session.abandoned):
                drain_resends(session)
                if not self._room():
                    with session.wake:
                        if not (s.stopping or session.resend or self._room()):
                            session.wake.wait(POLL_S)
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
                with session.wake:
                    if not _head_ready(s) and session.error is None and self.error is None:
                        session.wake.wait(POLL_S)
        finally:
            s.stats.wait_workers_s += time.perf_counter() - started

    def stop(self) -> None:
        sender = self.thread if self.launched else None
        self.session.stop(sender=sender, in_central=self._in_central)

    def worker_states(self) -> list[Any] | None:
        return self.session.worker_states()

"""Supervision: receiving results, deaths, hangs, poison items and restarts.

A :class:`Supervisor` is one run's use of the executor (see
:mod:`centralpipe.dispatch.executors.pool`) by every ordered stream of that run (each
parallel central stage, then the dispatch boundary). Its *supervisor thread*
is the only reader of the workers' results: it puts each result on its chunk
(never taking a stream's lock), watches worker deaths and per-item deadlines,
replaces dead or hung workers and queues their unfinished chunks for the
sending thread to re-send. An item that killed or hung ``item_retries + 1``
workers is a poison item: skipped (``on_error="skip"``), or its chunk is
re-sent without it and it is reported as a ``WorkerError`` in its place,
after every item before it. A result that cannot be unpickled has its chunk
re-sent item by item to find which item it was. Threads cannot be killed: a
hung thread is reported that way at once, its slot gets a fresh thread.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.budget import ResultBytes
from centralpipe.dispatch.chainlock import Wake, join_started
from centralpipe.dispatch.chunk import Chunk
from centralpipe.dispatch.executors.pool import Executor, Slot
from centralpipe.dispatch.reorder import Stream, StreamStats, logger
from centralpipe.dispatch.wire import protocol
from centralpipe.dispatch.wire.protocol import MSG_RESULT, MSG_STATES, StageFailure
from centralpipe.errors import WorkerError

__all__ = ["Policy", "Supervisor"]


class Policy:
    """How faults are treated (from ``WorkerConfig``)."""

    def __init__(
        self,
        *,
        timeout_s: float | None,
        max_restarts: int,
        item_retries: int,
        on_error: str,
        buffer_bytes: int | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.item_retries = item_retries
        self.on_error = on_error
        self.buffer_bytes = buffer_bytes

    @classmethod
    def of(cls, workers: Any) -> Policy:
        """The policy of a ``WorkerConfig``."""
        return cls(
            timeout_s=workers.timeout_s,
            max_restarts=workers.max_restarts,
            item_retries=workers.item_retries,
            on_error=workers.on_error,
            buffer_bytes=workers.buffer_bytes,
        )


class Supervisor:
    """One run over the executor; see the module docstring.

    Invariants: only the supervisor thread calls ``executor.wait`` (and
    reads nothing once a later run has claimed the executor) and
    ``executor.replace`` (under the slot's ``send_lock``); only the run's
    sending thread sends chunks; ``wake`` is notified whenever a result, a
    re-send, an error or room in a buffer appears, and no thread holds it
    while waiting for anything else.
    """

    def __init__(self, executor: Executor, run_id: int, policy: Policy, stats: StreamStats) -> None:
        self.executor = executor
        self.run_id = run_id
        self.policy = policy
        self.stats = stats
        self.streams: list[Stream] = []
        self.wake = Wake()
        self.resend: deque[tuple[Stream, Chunk]] = deque()
        self.error: BaseException | None = None
        #: Set first when the run is stopped: senders and waiters give up.
        self.abandoned = False
        #: The sending thread is in :func:`~centralpipe.dispatch.sender.send_chunk`
        #: (encoding a chunk or writing it to a worker), even from inside a
        #: parallel stage's ``next()``: a worker may unblock it, so it is not
        #: stuck in a central stage. Written by the sending thread alone.
        self.sending = False
        self.stopping = False
        self.strikes: dict[tuple[int, int], int] = defaultdict(int)
        self.states: dict[int, Any] = {}
        #: The next slot of each stream (by ``stream_id``): see :meth:`next_slot`.
        self._rr: dict[int, int] = {}
        self._owed_since: dict[int, float] = {}
        #: Bytes of received results not yet delivered, bounded by ``buffer_bytes``
        #: and by what the workers' rings can lend (read further ahead, results
        #: would be copied out of the rings: see ``dispatch.shm``).
        limit, lendable = policy.buffer_bytes, executor.lendable_bytes()
        if limit is not None and lendable is not None:
            limit = min(limit, lendable)
        self.held = ResultBytes(limit, on_room=executor.interrupt, stats=stats)
        #: A state request is being answered: every worker is read.
        self.asking = False
        self._paused: frozenset[int] = frozenset()
        #: ``thread.start()`` was called (it may have been interrupted).
        self.launched = False
        self.stopped = False
        self.thread = threading.Thread(
            target=self._supervise, name="centralpipe-supervisor", daemon=True
        )

    def start(self) -> None:
        # The workers' messages are this run's from now on, even if the
        # thread of an earlier run is still waiting on them.
        self.executor.claim(self)
        self.executor.measure = self.held.limit is not None
        self.executor.set_run(self.run_id)
        self.executor.ensure_alive()
        self.launched = True
        self.thread.start()

    def next_slot(self, stream_id: int) -> int:
        """Round-robin over the workers, each stream on its own: the k-th
        chunk of stream ``i`` goes to worker ``(i + k) % num_workers``.

        One turn shared by every stream would let their interleaving decide
        the load: a parallel stage's chunks alternating with the dispatch
        boundary's, on 2 workers, would all land on one worker and the
        boundary's on the other, however unequal their costs."""
        n = len(self.executor.slots)
        index = self._rr.get(stream_id, stream_id % n)
        self._rr[stream_id] = (index + 1) % n
        return index

    def notify(self) -> None:
        self.wake.notify_all()

    def check(self) -> None:
        """Raise the session's failure (a ``WorkerError``) in the caller."""
        if self.error is not None:
            raise self.error

    # -- the supervisor thread -------------------------------------------------

    def _supervise(self) -> None:
        try:
            # A later run's claim ends this thread too (its stop may have
            # given up waiting for it, or been cut short).
            while not self.stopping and self.executor.reader is self:
                self._paused = paused = self._pause()
                for event in self.executor.wait(timeouts.POLL_S, paused, self):
                    if self.stopping:
                        break
                    if event.message is None:
                        self._recover(event.slot, hung=False)
                    else:
                        self._handle(event.slot, event.message, event.nbytes)
                if self.policy.timeout_s is not None and not self.stopping:
                    self._check_deadlines(self.policy.timeout_s)
        except BaseException as exc:  # WorkerError, or a failed replacement
            self.error = exc
            for stream in self.streams:
                stream.broken = True
        finally:
            self.notify()

    def _pause(self) -> frozenset[int]:
        """Slots not to read now: see :mod:`centralpipe.dispatch.budget`."""
        if self.asking or self.abandoned:
            return frozenset()
        return self.held.paused(self.executor.slots)

    def _stream(self, stream_id: int) -> Stream | None:
        """The run's stream of id ``stream_id`` (a fused segment's id is
        past the dispatch stream's: ``dispatch.segments``)."""
        for stream in self.streams:
            if stream.stream_id == stream_id:
                return stream
        return None

    def _handle(self, slot: Slot, msg: Any, nbytes: int = 0) -> None:
        if msg[0] == MSG_RESULT:
            _, run_id, stream_id, cid, result = msg
            stream = self._stream(stream_id)
            if run_id != self.run_id or stream is None:
                return
            chunk = stream.by_cid.get(cid)
            if chunk is None or chunk.result is not None:
                return
            if isinstance(result.outputs, protocol.Undecodable):
                # An item or an output cannot be unpickled on its way: find
                # which by sending the chunk again, item by item.
                self._resend_per_item(stream, chunk)
                return
            if chunk.per_item:
                stage = stream.chain.specs[-1].name if stream.chain.specs else None
                result = protocol.unseal_outputs(result, stage, stream.dispatch_name)
            stream.stats.items_per_worker[slot.index] += len(chunk.items)
            sized = stream.stats.bytes_per_item >= 0
            self.held.add(stream, chunk, nbytes)
            chunk.put_result(stream.accept(chunk, result))
            # Only the head chunk's result is waited for (a result never makes
            # room, except the first, which tells the stream's size): a later
            # chunk is found ready by the reader before it waits (``wake`` is
            # checked under its lock after ``result`` is set), so waking it for
            # every chunk would only hand the GIL back and forth.
            if not sized or (stream.pending and stream.pending[0] is chunk):
                self.notify()
        elif msg[0] == MSG_STATES:
            self.states[slot.index] = msg[1]
            self.notify()

    def _resend_per_item(self, stream: Stream, chunk: Chunk) -> None:
        if chunk.per_item:  # cannot happen: each item is sealed on its own
            raise RuntimeError(f"chunk {chunk.cid} cannot be decoded even item by item")
        chunk.resend_per_item()
        self.resend.append((stream, chunk))
        self.notify()

    def _owes(self, slot: Slot) -> bool:
        for stream in self.streams:
            for chunk in list(stream.pending):
                if chunk.slot == slot.index and chunk.result is None and chunk.sent_gen == slot.gen:
                    return True
        return False

    def _check_deadlines(self, timeout_s: float) -> None:
        now = time.monotonic()
        for slot in self.executor.slots:
            busy = slot.busy()
            if busy is not None:
                self._owed_since.pop(slot.index, None)
                if now - busy[3] > timeout_s:
                    self._recover(slot, hung=True)
                continue
            if slot.index in self._paused:
                # Its results are left unread on purpose (the byte bound).
                self._owed_since.pop(slot.index, None)
                continue
            # Idle, or not started: hung too if it owes results for too long.
            if not self._owes(slot):
                self._owed_since.pop(slot.index, None)
                continue
            since = self._owed_since.setdefault(slot.index, now)
            allowed = timeout_s if slot.ready() else max(timeout_s, timeouts.STARTUP_GRACE_S)
            if now - since > allowed:
                self._owed_since.pop(slot.index, None)
                self._recover(slot, hung=True)

    def _locate(self, slot: Slot) -> tuple[Stream, Chunk, int, str | None] | None:
        """The stream, chunk, input index and stage of the item ``slot`` is on."""
        busy = slot.busy()
        if busy is None:
            return None
        stream_id, seq, stage_index, _ = busy
        stream = self._stream(stream_id)
        if stream is None:
            return None
        for chunk in list(stream.pending):
            if chunk.first_seq <= seq < chunk.first_seq + len(chunk.items):
                specs = stream.chain.specs
                stage = specs[stage_index].name if 0 <= stage_index < len(specs) else None
                return stream, chunk, seq - chunk.first_seq, stage
        return None  # busy with an abandoned run's item: not this run's business

    def _recover(self, slot: Slot, *, hung: bool) -> None:
        """A worker died or hung: replace it and have its chunks re-sent."""
        where = self._locate(slot)
        ex, timeout_s = self.executor, self.policy.timeout_s
        if hung:
            ex.kill(slot)
            what = f"hung for more than timeout_s={timeout_s}"
            if not slot.ready():
                what = f"did not start within {max(timeout_s or 0, timeouts.STARTUP_GRACE_S)} s"
        else:
            what = ex.exit_text(slot)
            if not slot.ready():
                what += ex.startup_death_text()
        exitcode = ex.exitcode(slot)
        seq = stage = None
        if where is not None:
            stream, chunk, at, stage = where
            seq = chunk.first_seq + at
        text = f" on item seq {seq}" + (f" in stage '{stage}'" if stage else "")
        text = text if seq is not None else ""
        kind = ex.kind
        self.stats.restarts += 1
        if not slot.cut_short:
            # A worker killed because a Ctrl-C cut a send to it short is no
            # failure: Ctrl-C pressed often must not use up max_restarts.
            self.stats.epoch_restarts += 1
        logger.warning("%s worker %d %s%s; replacing it", kind, slot.index, what, text)
        if self.stats.epoch_restarts > self.policy.max_restarts and not slot.cut_short:
            msg = (
                f"{kind} worker {slot.index} {what}{text}; that is {self.stats.epoch_restarts} "
                f"worker restarts this epoch, more than max_restarts={self.policy.max_restarts}."
            )
            raise WorkerError(msg, stage=stage, seq=seq, exitcode=exitcode)
        if where is not None and not slot.cut_short:
            stream, chunk, at, stage = where
            key = (stream.stream_id, chunk.first_seq + at)
            self.strikes[key] += 1
            # A hung thread cannot be killed: report it at once.
            if self.strikes[key] > self.policy.item_retries or (hung and not ex.can_kill):
                self._poison(stream, chunk, at, stage, what, exitcode)
        with slot.send_lock:
            try:
                ex.replace(slot)
            except Exception as exc:  # EMFILE, out of memory, ...: the slot is left empty
                msg = (
                    f"{kind} worker {slot.index} {what}{text}; could not start a replacement: "
                    f"{type(exc).__name__}: {protocol.exception_text(exc)}"
                )
                raise WorkerError(msg, stage=stage, seq=seq, exitcode=exitcode) from exc
        self._owed_since.pop(slot.index, None)
        for stream in self.streams:
            for chunk in list(stream.pending):
                if chunk.slot == slot.index and chunk.closed and chunk.result is None:
                    self.resend.append((stream, chunk))
        self.notify()

    def _poison(
        self,
        stream: Stream,
        chunk: Chunk,
        at: int,
        stage: str | None,
        what: str,
        exitcode: int | None,
    ) -> None:
        seq = chunk.first_seq + at
        verb = "hung" if what.startswith(("hung", "did not")) else "killed"
        strikes = self.strikes[(stream.stream_id, seq)]
        text = f"item seq {seq} {verb} {strikes} {self.executor.kind} worker(s) (last: {what})"
        if stage:
            text += f" in stage '{stage}'"
        if stream.on_error == "skip":
            chunk.add_skip(at)
            stream.stats.skipped += 1
            logger.warning("skipping %s", text)
            return
        if self.executor.can_kill:
            hint = (
                f"; it was retried {self.policy.item_retries} time(s) on a fresh worker "
                "(WorkerConfig.item_retries). Fix the item or use on_error='skip'."
            )
        else:
            hint = "; a thread cannot be stopped, so it was not retried. Use on_error='skip'."
        # Not raised here: the chunk is re-sent without the item, and the
        # error is raised in its place, after every item before it.
        failure = StageFailure(at, stage, "", "", "", text=text + hint, exitcode=exitcode)
        chunk.add_failure(failure)

    # -- control ---------------------------------------------------------------

    def worker_states(self) -> list[Any]:
        """Ask every worker for its stateful stages' state (a control message
        answered through the supervisor thread, never the consumer)."""
        self.states = {}
        self.asking = True  # workers paused for the byte bound answer too
        try:
            self.executor.interrupt()
            for slot in self.executor.slots:
                with slot.send_lock:
                    self.executor.send_control(slot, (MSG_STATES,))
            deadline = time.monotonic() + timeouts.STATES_TIMEOUT_S

            def answered() -> bool:
                return len(self.states) >= len(self.executor.slots) or self.error is not None

            while not answered():
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s.index for s in self.executor.slots if s.index not in self.states]
                    msg = f"workers {missing} did not answer a state request in "
                    raise RuntimeError(f"{msg}{timeouts.STATES_TIMEOUT_S} s.")
                self.wake.wait_unless(answered, min(left, timeouts.POLL_S))
        finally:
            self.asking = False
        self.check()
        return [self.states.get(i, {}) for i in range(len(self.executor.slots))]

    def stop(
        self,
        sender: threading.Thread | None = None,
        in_central: Callable[[], bool] | None = None,
    ) -> None:
        """Abandon the run; bounded. The sending thread (if any) is waited for
        while results are still read, so it can never stay blocked on a full
        pipe; if it is stuck in a send anyway the workers are killed. One that
        is inside a central stage's ``next()`` (``in_central``) is not waited
        for: it leaves the chain when that call returns and pulls nothing more
        (see :mod:`centralpipe.dispatch.chainlock`)."""
        if self.stopped:
            return
        self.abandoned = True
        if self.executor.reader is self:  # (a later run's chunks are never skipped)
            self.executor.set_run(self.run_id + 1)
        self.notify()
        if sender is not None and sender is not threading.current_thread():
            deadline = time.monotonic() + timeouts.STOP_TIMEOUT_S
            join_started(sender, timeouts.POLL_S)
            while sender.is_alive() and time.monotonic() < deadline:
                if in_central is not None and in_central():
                    break
                sender.join(timeouts.POLL_S)
            else:
                if sender.is_alive():
                    for slot in self.executor.slots:
                        self.executor.kill(slot)
                    sender.join(2.0)
        self.stopping = True
        self.executor.interrupt()
        if self.launched and self.thread is not threading.current_thread():
            join_started(self.thread, timeouts.STOP_TIMEOUT_S)
        self.stopped = True

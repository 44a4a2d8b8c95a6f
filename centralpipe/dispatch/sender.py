"""The sending side of a boundary: pulling chunks and sending them round-robin.

:func:`pull_chunk` pulls up to one chunk of items from the tip of the central
chain into a :class:`~centralpipe.dispatch.reorder.Stream`, holding the
stream's lock in short slices so ``state_dict()``/``query()`` get it promptly.
:class:`InlineDriver` (``num_workers=0``) then runs the worker stages on it in
the consumer's thread; with workers, the :class:`Feeder` thread pulls chunks
and sends them round-robin, and re-sends the chunks of a replaced worker.
Only the feeder sends chunks, so a chunk is never sent twice to the same
worker generation, and the thread that receives results never blocks on a
send.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from centralpipe.dispatch import protocol
from centralpipe.dispatch.pool import WorkerPool
from centralpipe.dispatch.protocol import Chunk, StageFailure
from centralpipe.dispatch.reorder import FIRST_CHUNK, Driver, Stream

__all__ = ["Feeder", "InlineDriver", "copy_items", "pull_chunk", "run_skip", "sendable_items"]

#: A chunk being filled is sent after this long even if not full.
FLUSH_S = 0.02
#: The feeder releases the lock at least this often while pulling.
LOCK_SLICE_S = 0.0005
#: Work per chunk the adaptive chunk size aims at.
TARGET_CHUNK_S = 0.005
MAX_CHUNK = 1024
#: Most items pulled between two looks at the clock.
PULL_BURST = 32
#: Longest wait of the feeder for room in the buffer before re-checking.
POLL_S = 0.1


def target_chunk(s: Stream) -> int:
    """Items for the next chunk: fixed, or adapted to the measured cost."""
    if s.fixed_chunk is not None:
        n = s.fixed_chunk
    elif s.cost_per_item <= 0:
        n = FIRST_CHUNK
    else:
        n = max(1, min(MAX_CHUNK, int(TARGET_CHUNK_S / s.cost_per_item)))
    if s.buffer_size is not None:
        n = min(n, max(1, s.buffer_size // (2 * s.parallelism)))
    s.stats.chunk_size = n
    return n


def pull_chunk(s: Stream) -> Chunk | None:
    """Pull up to one chunk of items; ``None`` when nothing is left (or
    stopping). The chunk is in ``pending`` from its first item on."""
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
    started = time.perf_counter()
    nxt = s.tip.next
    items, stamps = chunk.items, chunk.stamps
    append = items.append
    while True:
        if s._readers:
            # Lock hand-off is not fair: drop the GIL so a waiting
            # state_dict()/query() gets the lock before we take it again.
            time.sleep(0)
        with s.lock:
            if s.stopping:
                break
            t0 = time.perf_counter()
            slice_end = t0 + LOCK_SLICE_S
            while s._resume and len(items) < target:
                seq, item, stamp = s._resume.popleft()
                if seq in s._resume_skip:
                    chunk.skip.add(len(items))
                if seq == s._resume_skip_first[0]:
                    chunk.skip_first = s._resume_skip_first[1]
                if stamps is not None:
                    stamps.append(stamp if stamp is not None else s._stamp_now())
                append(item)
                s.in_flight += 1
            before = len(items)
            try:
                while len(items) < target:
                    # Pull in short bursts; look at the clock between them.
                    for _ in range(min(s._burst, target - len(items))):
                        item = nxt()
                        if stamps is not None:
                            stamps.append(s._stamp_now())
                        append(item)
                    if time.perf_counter() > slice_end:
                        break
            except StopIteration:
                s.exhausted = True
            except BaseException as exc:  # a central stage failed
                s.central_error = exc
                s.exhausted = True
            added = len(items) - before
            if added:
                # Slow central stages get a look at the clock after every
                # item, so the lock is never held much past LOCK_SLICE_S.
                per_item = max(1e-9, (time.perf_counter() - t0) / added)
                s._burst = max(1, min(PULL_BURST, int(LOCK_SLICE_S / per_item / 4)))
            s.next_seq += added
            s.in_flight += added
            s.stats.wait_central_s += time.perf_counter() - t0
            if s.in_flight > s.stats.high_water:
                s.stats.high_water = s.in_flight
            done = s.exhausted or len(items) >= target
            if done or time.perf_counter() - started > FLUSH_S:
                if not items:
                    s.pending.remove(chunk)
                    del s.by_cid[chunk.cid]
                    return None
                chunk.closed = True
                s.stats.dispatched += len(items)
                return chunk
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


class InlineDriver(Driver):
    """Worker stages run in the consumer's thread, one chunk at a time."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def wait_head(self) -> Chunk | None:
        s = self.stream
        with s.lock:
            if s.pending and s.pending[0].result is not None:
                return s.pending[0]
        chunk = pull_chunk(s)
        if chunk is None:
            return None
        # The worker stages get a copy, as a worker would: a stage that mutates
        # its item in place must not change the checkpoint's in-flight items.
        items = copy_items(s, chunk)
        result = s.chain.run_chunk(
            s.epoch, chunk.first_seq, items, run_skip(chunk), None, s.rng_key(chunk)
        )
        chunk.result = s.accept(chunk, result)
        return chunk


class Feeder:
    """The feeder thread: pull chunks, send them round-robin, re-send."""

    def __init__(self, stream: Stream, pool: WorkerPool, run_id: int) -> None:
        self.stream = stream
        self.pool = pool
        self.run_id = run_id
        self.resend: deque[Chunk] = deque()  # guarded by stream.lock
        self.error: BaseException | None = None
        self._rr = 0
        self.thread = threading.Thread(target=self._feed, name="centralpipe-feeder", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _feed(self) -> None:
        s = self.stream
        try:
            while True:
                with s.cond:
                    while (
                        not s.stopping
                        and not self.resend
                        and (
                            s.exhausted
                            or (s.buffer_size is not None and s.in_flight >= s.buffer_size)
                        )
                    ):
                        s.cond.wait(POLL_S)
                    if s.stopping:
                        return
                    resend = list(self.resend)
                    self.resend.clear()
                if resend:
                    for old in resend:
                        self._send(old)
                    continue
                chunk = pull_chunk(s)
                if chunk is not None:
                    chunk.slot = self._rr
                    self._rr = (self._rr + 1) % len(self.pool.slots)
                    self._send(chunk)
        except BaseException as exc:  # pragma: no cover - a bug; reported by the consumer
            self.error = exc

    def _send(self, chunk: Chunk) -> None:
        s = self.stream
        slot = self.pool.slots[chunk.slot]
        with slot.send_lock:
            if chunk.sent_gen == slot.gen or chunk.result is not None or slot.conn is None:
                return

            def message(items: list[Any]) -> tuple[Any, ...]:
                return protocol.chunk_message(
                    self.run_id, chunk, s.epoch, items, run_skip(chunk), s.rng_key(chunk)
                )

            try:
                encoded = protocol.encode(message(chunk.items))
            except Exception:
                encoded = protocol.encode(message(sendable_items(s, chunk)))
            # Marked sent before writing: the result (or a request to send
            # the chunk again per item) may come back before the write returns.
            # A failed write means a dead worker: its replacement bumps ``gen``.
            chunk.sent_gen = slot.gen
            try:
                protocol.send_encoded(slot.conn, encoded)
            except (OSError, EOFError, ValueError):
                pass  # the worker died; the supervisor replaces it and re-sends

"""Checkpoint capture: what a checkpoint holds of one ordered stream.

:class:`Capture` is the part of :class:`~centralpipe.dispatch.reorder.Stream`
that reads a stream's position for ``state_dict()``: under both locks
(:meth:`Capture.reading`), the next ``seq``, the inputs pulled but not yet
delivered (from the pending chunks and the resumed items not yet re-sent),
how many outputs of the first of them were delivered, and the count/shard
stamp as of the last delivered output. Lines that workers read from byte
ranges (``dispatch.worker.ranges``) stay ranges: ``[at, file, start, end,
lines, skip]``, never read here. It only reads the stream's
bookkeeping; the invariants it relies on are in
:mod:`centralpipe.dispatch.reorder`.
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from centralpipe.checkpoint.compact import join_parts, pack_part, part_of_flats
from centralpipe.dispatch.chunk import Chunk
from centralpipe.dispatch.guard import Holding
from centralpipe.dispatch.worker.ranges import LineRange
from centralpipe.stages import CentralNode

__all__ = ["Capture"]


def _chunk_part(chunk: Chunk) -> Any:
    """The checkpoint form of a whole chunk's items (``checkpoint.compact``),
    made once: from the flat buffers it was sent with when it has them."""
    n = len(chunk.items)
    cached = chunk.state_part
    if cached is not None and cached[0] == n:
        return cached[1]
    flats = chunk.flats
    part: dict[str, Any] | list[Any] | None = (
        part_of_flats(flats) if flats is not None and len(flats) == n else None
    )
    if part is None:
        part = pack_part(chunk.items)
    if chunk.closed:  # its items are final
        chunk.cache_state_part(n, part)
    return part


class Capture:
    """Checkpoint capture of a :class:`~centralpipe.dispatch.reorder.Stream`,
    which sets every attribute declared here."""

    lock: threading.Lock
    chain_lock: threading.RLock
    next_seq: int
    delivered: int
    skipped: int
    pending: deque[Chunk]
    current: Chunk | None
    finished: bool
    last_stamp: Any
    _chain_nodes: list[CentralNode[Any]]
    _readers: int
    _readers_lock: threading.Lock
    _stamped: list[CentralNode[Any]]
    _resume: deque[tuple[int, Any, Any]]
    _resume_skip: set[int]
    _resume_skip_first: tuple[int, int]
    read_failed: Chunk | None
    _cur_list: list[Any]
    _cur_it: Iterator[Any] | None
    _cur_base: int
    _stamp_now: Callable[[], Any]

    def _delivered_in_current(self) -> int:
        it = self._cur_it
        if it is None:
            return 0
        return self._cur_base + len(self._cur_list) - operator.length_hint(it)

    def _split_current(self, chunk: Chunk) -> tuple[int, int, int]:
        """(first input not fully delivered, outputs of it delivered, input of
        the last delivered output or -1) for the chunk being delivered."""
        d = self._delivered_in_current() if chunk is self.current else 0
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

    def reading(self, what: str = "state_dict()") -> Holding:
        """``with s.reading(what), s.lock:`` holds both locks to read state.
        The central thread yields to waiting readers between pull slices, so
        a reader waits for at most one ``next()`` of the chain, and never
        longer than ``config.CENTRAL_WAIT_S`` (then ``TimeoutError`` naming the stage
        that keeps the chain). Both locks are released at C level (see
        :class:`~centralpipe.dispatch.guard.Holding`): no interrupt can leave
        either held."""
        return Holding(self.chain_lock, what, self._chain_nodes, readers=self)

    def capture(self) -> dict[str, Any]:
        """This stream's part of the checkpoint at the consumer's position:
        ``next_seq``, ``in_flight``, ``delivered_stamp`` and ``finished``."""
        with self.reading(), self.lock:
            return self.capture_unlocked()

    def capture_unlocked(self) -> dict[str, Any]:
        """:meth:`capture` for a caller that holds the lock of the stream
        downstream (a parallel stage's stream is only changed under it)."""
        parts: list[Any] = []  # compact parts of the items (checkpoint.compact)
        n_items = 0  # items in ``parts`` so far: where a range's lines go
        ranges: list[list[Any]] = []  # lines read by workers stay byte ranges
        stamps: list[Any] | None = [] if self._stamped else None
        skip: list[int] = []
        first_seq = self.next_seq
        skip_outputs = 0
        delivered_stamp = self.last_stamp
        skipped = self.skipped
        first = True
        for chunk in self.pending:
            if not chunk.items:
                continue  # being filled: nothing pulled into it yet
            start = 0
            if first:
                j, k, last = self._split_current(chunk)
                start, skip_outputs = j, k
                if last >= 0 and chunk.stamps:
                    delivered_stamp = chunk.stamps[last]
                first_seq = chunk.first_seq + j
                first = False
                if chunk is self.current and chunk.result is not None and chunk.result.counts:
                    skipped += chunk.result.counts[:j].count(0)
                if chunk.skip_first and j == 0:
                    skip_outputs += chunk.skip_first
            if isinstance(chunk.items, LineRange):
                if start < len(chunk.items):
                    ranges.append(chunk.items.record(n_items, start))
            else:
                parts.append(_chunk_part(chunk) if start == 0 else pack_part(chunk.items[start:]))
                n_items += len(chunk.items) - start
            if stamps is not None and chunk.stamps is not None:
                stamps.extend(chunk.stamps[start:])
            skip.extend(chunk.first_seq + i for i in chunk.skip if i >= start)
        if self._resume:
            if first:
                first_seq = self._resume[0][0]
            plain: list[Any] = []
            for seq, item, stamp in self._resume:
                if isinstance(item, LineRange):
                    ranges.append(item.record(n_items + len(plain), 0))
                    skip.extend(x for x in range(seq, seq + len(item)) if x in self._resume_skip)
                    continue
                plain.append(item)
                if stamps is not None:
                    stamps.append(stamp)
                if seq in self._resume_skip:
                    skip.append(seq)
            if first and self._resume_skip_first[0] == first_seq:
                skip_outputs = self._resume_skip_first[1]
        if self.finished:
            delivered_stamp = self._stamp_now()
        if self._resume:
            parts.append(pack_part(plain))
        in_flight = {
            "first_seq": first_seq,
            "items": join_parts(parts),
            "stamps": stamps,
            "skip_outputs": skip_outputs,
            "skip": skip,
        }
        if ranges:
            in_flight["ranges"] = ranges
        return {
            "next_seq": self.next_seq,
            "in_flight": in_flight,
            "delivered_stamp": delivered_stamp,
            "finished": self.finished,
            "delivered": self.delivered
            + (self._delivered_in_current() if self.current is not None else 0),
            "skipped": skipped,
        }

    def delivered_stamp(self) -> Any:
        """Stamp of the count/shard stages as of the last delivered output:
        delivery bookkeeping only, so it never waits for the central chain."""
        with self.lock:
            return self.last_output_stamp()

    def last_output_stamp(self) -> Any:
        """:meth:`delivered_stamp` without the lock, for the thread that
        consumes this stream (a parallel stage's stream, in the central chain)."""
        if self.finished:
            return self._stamp_now()
        chunk = self.current
        if chunk is not None and chunk.stamps:
            _, _, last = self._split_current(chunk)
            if last >= 0:
                return chunk.stamps[last]
        return self.last_stamp

"""Checkpoint capture: what a checkpoint holds of one ordered stream.

:class:`Capture` is the collaborator of a
:class:`~centralpipe.dispatch.reorder.Stream` (``stream.checkpoint``) that
reads the stream's position for ``state_dict()``: under both locks
(``Stream.reading``), the next ``seq``, the inputs pulled but not yet
delivered (from the pending chunks and the resumed items not yet re-sent),
how many outputs of the first of them were delivered, and the count/shard
stamp as of the last delivered output. Lines that workers read from byte
ranges (``dispatch.worker.ranges``) stay ranges: ``[at, file, start, end,
lines, skip]``, never read here. It only reads the stream's
bookkeeping; the invariants it relies on are in
:mod:`centralpipe.dispatch.reorder`.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Protocol

from centralpipe.checkpoint.compact import join_parts, pack_part, part_of_flats
from centralpipe.checkpoint.model import Captured, entry_wire
from centralpipe.dispatch.chainlock import Holding
from centralpipe.dispatch.chunk import Chunk
from centralpipe.dispatch.pullstate import PullState
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


class Capturable(Protocol):
    """What a capture reads of its stream (a
    :class:`~centralpipe.dispatch.reorder.Stream`), and never changes."""

    lock: threading.Lock
    next_seq: int
    delivered: int
    skipped: int
    pending: deque[Chunk]
    current: Chunk | None
    finished: bool
    last_stamp: Any
    read_failed: Chunk | None
    pulls: PullState

    @property
    def end_handed_out(self) -> bool: ...

    def reading(self, what: str = ...) -> Holding: ...
    def stamped_nodes(self) -> list[CentralNode[Any]]: ...
    def delivered_in_current(self) -> int: ...
    def split_current(self, chunk: Chunk) -> tuple[int, int, int]: ...
    def stamp_now(self) -> Any: ...


class Capture:
    """Checkpoint capture of one stream: reads it (:class:`Capturable`), under
    its locks, and changes nothing of it."""

    __slots__ = ("stream",)

    def __init__(self, stream: Capturable) -> None:
        self.stream = stream

    def capture(self) -> Captured:
        """This stream's part of the checkpoint at the consumer's position:
        its boundary's entry (with the stamp as of its last delivered output),
        whether it finished, and its step count."""
        s = self.stream
        with s.reading(), s.lock:
            return self.capture_unlocked()

    def capture_unlocked(self) -> Captured:
        """:meth:`capture` for a caller that holds the lock of the stream
        downstream (a parallel stage's stream is only changed under it)."""
        s = self.stream
        parts: list[Any] = []  # compact parts of the items (checkpoint.compact)
        n_items = 0  # items in ``parts`` so far: where a range's lines go
        ranges: list[list[Any]] = []  # lines read by workers stay byte ranges
        stamps: list[Any] | None = [] if s.stamped_nodes() else None
        skip: list[int] = []
        first_seq = s.next_seq
        skip_outputs = 0
        delivered_stamp = s.last_stamp
        skipped = s.skipped
        first = True
        for chunk in s.pending:
            if not chunk.items:
                continue  # being filled: nothing pulled into it yet
            start = 0
            if first:
                j, k, last = s.split_current(chunk)
                start, skip_outputs = j, k
                if last >= 0 and chunk.stamps:
                    delivered_stamp = chunk.stamps[last]
                first_seq = chunk.first_seq + j
                first = False
                if chunk is s.current and chunk.result is not None and chunk.result.counts:
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
        if s.pulls.resume:
            if first:
                first_seq = s.pulls.resume[0][0]
            plain: list[Any] = []
            for seq, item, stamp in s.pulls.resume:
                if isinstance(item, LineRange):
                    ranges.append(item.record(n_items + len(plain), 0))
                    skip.extend(x for x in range(seq, seq + len(item)) if x in s.pulls.skip)
                    continue
                plain.append(item)
                if stamps is not None:
                    stamps.append(stamp)
                if seq in s.pulls.skip:
                    skip.append(seq)
            if first and s.pulls.skip_first[0] == first_seq:
                skip_outputs = s.pulls.skip_first[1]
        finished = s.end_handed_out
        if finished:
            delivered_stamp = s.stamp_now()
        if s.pulls.resume:
            parts.append(pack_part(plain))
        entry = entry_wire(
            next_seq=s.next_seq,
            first_seq=first_seq,
            items=join_parts(parts),
            stamps=stamps,
            skip_outputs=skip_outputs,
            skip=skip,
            delivered_stamp=delivered_stamp,
            ranges=ranges,
        )
        delivered = s.delivered + (s.delivered_in_current() if s.current is not None else 0)
        return Captured(entry, finished, delivered, skipped)

    def delivered_stamp(self) -> Any:
        """Stamp of the count/shard stages as of the last delivered output:
        delivery bookkeeping only, so it never waits for the central chain."""
        with self.stream.lock:
            return self.last_output_stamp()

    def last_output_stamp(self) -> Any:
        """:meth:`delivered_stamp` without the lock, for the thread that
        consumes this stream (a parallel stage's stream, in the central chain)."""
        s = self.stream
        if s.finished:
            return s.stamp_now()
        chunk = s.current
        if chunk is not None and chunk.stamps:
            _, _, last = s.split_current(chunk)
            if last >= 0:
                return chunk.stamps[last]
        return s.last_stamp

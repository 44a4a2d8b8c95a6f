"""Pulling a chunk from the central chain into a stream.

:func:`pull_chunk` pulls up to one chunk of items from the stream's source
(the central stage before the boundary) into a
:class:`~centralpipe.dispatch.reorder.Stream`, holding the stream's lock in
short slices so ``state_dict()``/``query()`` get it promptly; the drivers in
:mod:`centralpipe.dispatch.sender` then have the chunk run. The chunk size
adapts to the measured cost of the worker stages (:func:`target_chunk`), and
a chunk is pulled only when a whole one fits in the buffer
(:func:`has_room`). A range chunk (below) aims at more work
(``timeouts.TARGET_RANGE_CHUNK_S``): its main-process cost is per chunk.

A parallel stage that reads straight from ``read_lines`` on workers pulls
each chunk as one range of lines instead (:func:`_fill_range`; see
:mod:`centralpipe.dispatch.worker.ranges`): its lines are read by the
worker, and its seqs and the reader's position are those of the lines.

A Ctrl-C (any ``BaseException`` that is not an ``Exception``) from the
chain is not a stage's failure: the items pulled so far stay in the chunk,
closed, and it is re-raised at once (:func:`pull_chunk`).
"""

from __future__ import annotations

import time
from typing import Any

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.chunk import Chunk
from centralpipe.dispatch.reorder import FIRST_CHUNK, Stream
from centralpipe.dispatch.worker.ranges import LineRange

__all__ = [
    "MAX_CHUNK",
    "MAX_CHUNK_RESULT_BYTES",
    "PULL_BURST",
    "has_room",
    "pull_chunk",
    "target_chunk",
]

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
        # Ranges (read in the worker) cost the main process per chunk, not
        # per line: they aim at more work per chunk.
        aim = timeouts.TARGET_CHUNK_S if s.ranges is None else timeouts.TARGET_RANGE_CHUNK_S
        n = max(1, min(MAX_CHUNK, int(aim / s.cost_per_item)))
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
    stamped = bool(s.stamped_nodes())
    counted = [0]  # items of the chunk already counted in next_seq and in_flight
    chunk: Chunk | None = None
    # The chunk is registered inside the try, in pending last: CPython may
    # handle a Ctrl-C as any call returns (the append, the with's release),
    # and an empty chunk left in pending would be retired in place of the
    # next one (which would then be delivered twice).
    try:
        with s.lock:
            if s.exhausted or s.stopping:
                return None
            if s.buffer_size is not None:
                target = max(1, min(target, s.buffer_size - s.in_flight))
            first_seq = s.pulls.resume[0][0] if s.pulls.resume else s.next_seq
            new = Chunk(s.next_cid, first_seq, stamped)
            # A resumed range is one chunk; new ranges once nothing is to resume.
            if s.pulls.resume and isinstance(s.pulls.resume[0][1], LineRange):
                fill = _fill_resumed_range
            elif s.ranges is not None and not s.pulls.resume:
                fill = _fill_range
            else:
                fill = _fill
            # No call from here to the append: registered whole or not at all.
            chunk = new
            s.next_cid += 1
            s.by_cid[new.cid] = new
            s.pending.append(new)
        return fill(s, new, target, counted)
    except BaseException:
        if chunk is not None:
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
    took = s.pulls.took
    if took and not chunk.items:
        # Cut between the reader's hand-out of a range and its store.
        chunk.set_items(took[0])
    s.pulls.took = []
    stamps = chunk.stamps
    try:
        if stamps is not None and len(stamps) < len(chunk.items):
            stamps.append(s.stamp_now())
    finally:
        with s.lock:
            n = len(chunk.items)
            if stamps is not None and len(stamps) > n:
                # Cut between a resumed item's stamp and its append.
                del stamps[n:]
            # Cut between a resumed item's append and its popleft: it is in
            # the chunk (its seq is in the chunk's range), so it leaves resume.
            resume = s.pulls.resume
            while resume and chunk.first_seq <= resume[0][0] < chunk.first_seq + n:
                resume.popleft()
            _count(s, chunk, counted)
            if chunk.closed:
                pass
            elif chunk.items:
                chunk.close()
                s.stats.dispatched += len(chunk.items)
            elif chunk in s.pending:
                s.pending.remove(chunk)
                del s.by_cid[chunk.cid]


def _fill_resumed_range(s: Stream, chunk: Chunk, target: int, counted: list[int]) -> Chunk | None:
    """The chunk as the resumed range at the head of ``s.pulls.resume`` (in-flight
    lines of a checkpoint, kept as a range: ``Capture``), whole: its lines
    are read by the worker, as when it was first sent."""
    with s.lock:  # a checkpoint reads pulls.resume under this lock too
        seq, lines, _ = s.pulls.resume[0]
        n = len(lines)
        poison = s.pulls.skip
        skip = {i for i in range(n) if seq + i in poison} if poison else set()
        first = s.pulls.skip_first
        # From the chunk's update (an interrupt lands at its entry, before
        # its writes) to the popleft, no call: in the chunk or still to resume.
        skip_first = first[1] if seq == first[0] else None
        chunk.take_resumed(lines, skip, skip_first)
        s.pulls.resume.popleft()
        _count(s, chunk, counted)
        chunk.close()
        s.stats.dispatched += n
        s.stats.range_lines += n
    return chunk


def _fill_range(s: Stream, chunk: Chunk, target: int, counted: list[int]) -> Chunk | None:
    """The chunk as one range of the reader ``s.ranges``: up to ``target``
    lines that a worker reads (``ReadLines.take_range``), in one call of the
    central chain. The range is handed out into ``s.pulls.took`` and stored as the
    chunk's items with no call in between; :func:`_keep` finishes a store
    that an interrupt cut short."""
    reader = s.ranges
    chain_lock = s.chain_lock
    while True:
        if s.waiting_readers:
            time.sleep(0)  # let a waiting state_dict()/query() take the lock first
        try:
            acquired = chain_lock.acquire(timeout=timeouts.POLL_S)
            s.in_chain = acquired
            if not acquired:
                if s.stopping:
                    break
                continue
            if s.stopping:
                break
            t0 = time.perf_counter()
            exhausted = False
            error: Exception | None = None
            took: list[Any] = []
            s.pulls.took = took
            try:
                reader.take_range(took, target)
            except StopIteration:
                exhausted = True
            except Exception as exc:  # the reader failed (an unreadable file)
                error = exc
                exhausted = True
            if took:
                chunk.set_items(took[0])
            s.pulls.took = []
            now = time.perf_counter()
            with s.lock:
                if exhausted:
                    s.exhausted = True
                    s.central_error = error
                _count(s, chunk, counted)
                s.stats.wait_central_s += now - t0
                if not chunk.items:
                    s.pending.remove(chunk)
                    del s.by_cid[chunk.cid]
                    return None
                chunk.close()
                n = len(chunk.items)
                s.stats.dispatched += n
                if not isinstance(chunk.items, list):  # a range, not lines of a remote file
                    s.stats.range_lines += n
                return chunk
        finally:
            s.in_chain = False
            try:
                chain_lock.release()
            except RuntimeError:  # not taken (timed out, or interrupted in the wait)
                pass
    return None  # stopping: the chunk stays in pending (the run is abandoned)


def _fill(s: Stream, chunk: Chunk, target: int, counted: list[int]) -> Chunk | None:
    started = time.perf_counter()
    one = s.tip.pull_into
    items, stamps = chunk.items, chunk.stamps
    # Without stamps, items come in bulk (``pull_into``): a source or a
    # parallel stage hands out a slice at a time instead of one per call.
    pull = s.tip.pull_into if stamps is None else None
    most = PULL_BURST if pull is None else MAX_CHUNK
    chain_lock = s.chain_lock
    resume = s.pulls.resume
    while True:
        if s.waiting_readers:
            # Lock hand-off is not fair: drop the GIL so a waiting
            # state_dict()/query() gets the lock before we take it again.
            time.sleep(0)
        # Taken inside the try, and released in the finally by this thread
        # if it has it (an RLock's release() checks the owner): an interrupt
        # (Ctrl-C) can land as the acquire returns, before any flag could
        # record it, and a lock kept then would time out every state_dict().
        try:
            acquired = chain_lock.acquire(timeout=timeouts.POLL_S)
            s.in_chain = acquired
            if not acquired:
                if s.stopping:
                    break
                continue  # a reader, or a stopped run's thread still in next()
            if s.stopping:
                break
            t0 = time.perf_counter()
            slice_end = t0 + timeouts.LOCK_SLICE_S
            while resume and len(items) < target:
                seq, item, stamp = resume[0]
                if isinstance(item, LineRange):
                    break  # a chunk of its own, next
                if stamps is not None and stamp is None:
                    stamp = s.stamp_now()
                poison = seq in s.pulls.skip
                first = s.pulls.skip_first
                skip_first = first[1] if seq == first[0] else None
                # From the chunk's update (an interrupt lands at its entry,
                # before its writes) to the popleft no Python function runs:
                # an item is in the chunk or still to resume (``_keep``).
                chunk.add_resumed(item, stamp, poison, skip_first)
                resume.popleft()
            before = len(items)
            exhausted = False
            error: Exception | None = None
            try:
                # Nothing new while a resumed range is next (seqs are in order).
                while len(items) < target and not resume:
                    # Pull in short bursts; look at the clock between them.
                    burst = min(s.pulls.burst, target - len(items))
                    if pull is not None:
                        pull(items, burst)
                    else:
                        for _ in range(burst):
                            if s.stopping:  # a next() that blocked may have outlived the run
                                break
                            # Appended before it is stamped: an interrupt at
                            # the stamp's call would otherwise drop the item
                            # the chain has just produced (a whole batch).
                            # One at a time through pull_into, not next():
                            # next()'s timing call after the item is made is
                            # where a Ctrl-C could drop it.
                            one(items, 1)
                            if stamps is not None:
                                stamps.append(s.stamp_now())
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
                    stamps.append(s.stamp_now())
            added = len(items) - before
            now = time.perf_counter()
            if added:
                # Slow central stages get a look at the clock after every
                # item, so the lock is never held much past timeouts.LOCK_SLICE_S.
                per_item = max(1e-9, (now - t0) / added)
                s.pulls.burst = max(1, min(most, int(timeouts.LOCK_SLICE_S / per_item / 4)))
            with s.lock:
                if exhausted:
                    s.exhausted = True
                    s.central_error = error
                _count(s, chunk, counted)
                s.stats.wait_central_s += now - t0
                done = s.exhausted or len(items) >= target or bool(resume)
                if done or now - started > timeouts.FLUSH_S:
                    if not items:
                        s.pending.remove(chunk)
                        del s.by_cid[chunk.cid]
                        return None
                    chunk.close()
                    s.stats.dispatched += len(items)
                    return chunk
        finally:
            s.in_chain = False
            try:
                chain_lock.release()
            except RuntimeError:  # not taken (timed out, or interrupted in the wait)
                pass
    # stopping: leave the chunk in pending (the run is abandoned anyway)
    return None

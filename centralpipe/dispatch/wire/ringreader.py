"""Shared-memory rings: large result buffers cross without the pipe.

Each worker process has one *ring*: a block of anonymous shared memory
(``os.memfd_create``: it has no name, so nothing ever appears in
``/dev/shm`` and nothing is left behind however a process dies) that the
main process creates for that worker and hands over on the worker's pipe
(``socket.send_fds``) before anything else, plus a *release pipe* the other
way. The worker writes the large out-of-band buffers of a message (tensor
and array memory, see :mod:`centralpipe.dispatch.wire.transport`) into free
space of the ring, then sends the message with each buffer's ring offset in
its header in place of the bytes. The main process either *lends* the
buffer, which then becomes the memory of the received tensor or array with
no copy at all, or copies it out once; either way it tells the worker, on
the release pipe, which space may be written again once nothing in the main
process uses it: at once for a copy, when the last tensor or array on a lent
buffer is freed (a weak reference's callback on the array they all keep
alive). Freed space is written back in batches (``RELEASE_BATCH_BYTES``, at
most an eighth of the ring) and at every flush of the supervisor, which
flushes whenever it waits or reads: one write per batch, not per result.

Why it is safe:

- A buffer is written completely before the message naming it is sent, and
  the pipe write/read orders the two processes: the main process never reads
  a buffer that is being written. A worker that dies mid-write never sends
  the message, so that buffer is never read; its chunk is sent again to the
  replacement worker.
- The worker only writes into space the main process has released (it
  keeps a list of free extents, fed by the release pipe, a kernel object, so
  its writes are ordered after the main process's last use on any CPU), and
  the main process refuses a message naming space it has not released (the
  worker is then treated as dead): a lent buffer is never overwritten while
  the user holds a tensor on it.
- Lending is bounded: at most ``LEND_SHARE`` of a ring is lent at a time;
  past that the main process copies (and releases at once), so a user who
  keeps results never leaves a worker without room. Space is released in any
  order, so one result kept for long pins only its own bytes.
- Each worker generation gets a fresh ring: the one of a dead worker is
  closed when it is replaced (what is not lent is given back to the system
  at once; lent buffers last as long as their tensors), so a late write by a
  dying worker can never land in a live ring.
- Neither side ever blocks on the ring: with no room the worker waits at
  most ``ROOM_WAIT_S`` and then sends the buffer on the pipe; with a full
  release pipe the main process keeps the releases and writes them later.

The worker's side (:class:`~centralpipe.dispatch.wire.ringwriter.RingWriter`) is in
:mod:`centralpipe.dispatch.wire.ringwriter`. Only public APIs: ``os.memfd_create``,
``mmap`` (``madvise``), ``socket.send_fds`` / ``recv_fds``, ``os.pipe``,
``weakref`` and numpy. Where
``memfd_create`` does not exist (not Linux), workers have no ring and every
buffer goes on the pipe.
"""

from __future__ import annotations

import bisect
import collections
import mmap
import os
import socket
import struct
import threading
import weakref
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

__all__ = [
    "EXTENT",
    "HANDOVER",
    "LEND_SHARE",
    "MAGIC",
    "MIN_RING_BUFFER_BYTES",
    "RELEASE_BATCH_BYTES",
    "RELEASE_EVERY_BYTES",
    "RING_ALIGN",
    "Ring",
    "aligned",
    "available",
    "dup_socket",
]

#: Buffers smaller than this go on the pipe: they cost less to send than a
#: ring offset, and it bounds the release records a worker has not read.
MIN_RING_BUFFER_BYTES = 16 * 1024
#: Buffers start on this boundary in the ring.
RING_ALIGN = 64
#: Copied-out space is released at least every this many bytes (and at each
#: message's end).
RELEASE_EVERY_BYTES = 2**20
#: Space of freed lent buffers is written back to the worker in batches of
#: this many bytes (at most an eighth of the ring), or at the supervisor's
#: next flush: one write per batch, not per result.
RELEASE_BATCH_BYTES = 4 * 2**20
#: At most this share of a ring is lent to received tensors and arrays at once.
LEND_SHARE = 0.75
# The hand-over message (its fds ride along): magic, ring capacity.
HANDOVER = struct.Struct("<QQ")
MAGIC = 0x63705F72696E6732  # "cp_ring2"
# A release record: offset, bytes (aligned).
EXTENT = struct.Struct("<QQ")
# Records per write: at most PIPE_BUF bytes, so a write is whole or refused.
_RECORDS_PER_WRITE = 4096 // EXTENT.size


def available() -> bool:
    """Whether this platform has anonymous shared memory to pass to workers."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def aligned(n: int) -> int:
    """``n`` bytes rounded up to ``RING_ALIGN``: the ring space a buffer takes."""
    return n + (-n % RING_ALIGN)


def dup_socket(conn: Connection) -> socket.socket:
    return socket.socket(fileno=os.dup(conn.fileno()))


class _Lent(weakref.ref[Any]):
    """Watches the array a lent buffer was handed out as: its callback runs
    when that array (the base of everything built on the buffer) is freed."""

    __slots__ = ("off", "size")
    off: int
    size: int

    def __new__(cls, obj: Any, callback: Any, off: int, size: int) -> _Lent:
        self = super().__new__(cls, obj, callback)
        self.off = off
        self.size = size
        return self

    def __init__(self, obj: Any, callback: Any, off: int, size: int) -> None:
        super().__init__(obj, callback)  # type: ignore[call-arg]


class Ring:
    """The main process's side of one worker's ring: it creates the memory,
    hands it to the worker, lends or copies buffers out and releases them.

    ``take`` and ``flush`` are called by the supervisor thread, ``hand_over``
    and ``close`` by whoever starts or replaces the worker; a lent buffer is
    given back by whichever thread frees its last tensor (or by the garbage
    collector, inside any call). The state below is changed under ``_lock``
    only; a give-back that finds the lock taken (by another thread, or by
    this one when the collector ran inside a locked section) is queued in
    ``_returned``, which every holder of the lock drains after releasing it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        fd = os.memfd_create("centralpipe-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            self._map: mmap.mmap | None = mmap.mmap(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd  # closed once handed over
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._release_r: int | None = r  # the worker's end, closed once handed over
        self._release_w: int | None = w
        self._lock = threading.Lock()
        self._returned: collections.deque[int] = collections.deque()  # freed, not queued
        self._returned_bytes = 0
        #: Freed lent space is written to the worker once this much is freed.
        self.release_batch = min(RELEASE_BATCH_BYTES, capacity // 8)
        #: Lent buffers' watchers, by offset (a watcher must outlive its callback).
        self._watch: dict[int, _Lent] = {}
        #: Space the worker may not write: offset -> end, for lent buffers.
        self._lent: dict[int, int] = {}
        self._lent_starts: list[int] = []  # sorted keys of _lent
        #: Bytes lent now.
        self.lent = 0
        self._unsent = bytearray()  # release records not written yet
        self._unsent_bytes = 0  # ring bytes they release
        self.closed = False
        #: Bytes of large buffers received through the ring (lent: without a
        #: copy), and through the pipe (they did not fit at the time).
        self.ring_bytes = 0
        self.lent_bytes = 0
        self.pipe_bytes = 0

    def fds(self) -> list[int]:
        """Our open descriptors (a forked worker closes its inherited copies)."""
        return [fd for fd in (self._fd, self._release_r, self._release_w) if fd is not None]

    def hand_over(self, conn: Connection) -> bool:
        """Send the ring and the release pipe's read end to the worker at the
        other end of ``conn``: the first thing on that pipe, before any chunk.
        Our copies of those two descriptors are closed. False if the worker
        is already gone (it is then replaced like any dead worker)."""
        assert self._fd is not None and self._release_r is not None
        sock = dup_socket(conn)
        try:
            socket.send_fds(
                sock, [HANDOVER.pack(MAGIC, self.capacity)], [self._fd, self._release_r]
            )
            return True
        except OSError:
            return False
        finally:
            sock.close()
            # Each descriptor is forgotten before it is closed: a Ctrl-C
            # handled as a close returns leaves none to close twice (a second
            # close could hit a number the process has reused since).
            fd, self._fd = self._fd, None
            os.close(fd)
            release_r, self._release_r = self._release_r, None
            os.close(release_r)

    def take(self, off: int, size: int) -> Any:
        """The buffer of ``size`` bytes the worker wrote at ring offset
        ``off``, as a writable uint8 array: lent (the ring's own memory,
        released when the array and everything built on it are freed) while
        less than ``LEND_SHARE`` of the ring is lent, else a copy.

        Raises ``EOFError`` for space the worker may not have written (lent,
        outside the ring: a damaged or foreign message): the pipe is then out
        of step and the worker is treated as dead."""
        return self.take_many([(off, size)])[0]

    def take_many(self, spans: list[tuple[int, int]]) -> list[Any]:
        """:meth:`take` for each ``(offset, size)`` of one message, under one
        lock. On ``EOFError`` the buffers already taken are released with
        their arrays, as always."""
        out: list[Any] = []
        lent: list[tuple[Any, int, int]] = []
        self._drain_returned()  # what was freed may be named again
        try:
            with self._lock:  # also keeps close() from freeing pages being copied
                m = self._map
                if self.closed or m is None:
                    raise EOFError("the ring is closed")
                share = self.capacity * LEND_SHARE
                for off, size in spans:
                    end = off + aligned(size)
                    if size <= 0 or off < 0 or off % RING_ALIGN or end > self.capacity:
                        msg = (
                            f"ring offset {off} (+{size} bytes) is outside the ring "
                            f"({self.capacity})"
                        )
                        raise EOFError(msg)
                    self._check_free(off, end)
                    view = np.frombuffer(m, dtype=np.uint8, count=size, offset=off)
                    self.ring_bytes += size
                    if self.lent + (end - off) > share:
                        copied = np.empty(size, dtype=np.uint8)
                        np.copyto(copied, view)  # without the GIL
                        del view
                        self._queue(off, end)
                        if self._unsent_bytes >= RELEASE_EVERY_BYTES:
                            self._write_unsent()
                        out.append(copied)
                        continue
                    # Lent: the worker may not write [off, end) until the
                    # array (and all built on it) is freed.
                    self._lent[off] = end
                    bisect.insort(self._lent_starts, off)
                    self.lent += end - off
                    self.lent_bytes += size
                    lent.append((view, off, end))
                    out.append(view)
        finally:
            # Watched outside the lock: a weakref callback may run at once.
            for view, off, end in lent:
                self._watch[off] = _Lent(view, self._give_back, off, end - off)
            self._drain_returned()
        return out

    def _check_free(self, off: int, end: int) -> None:
        starts = self._lent_starts
        i = bisect.bisect_left(starts, end)  # lent buffers starting before ``end``
        if i and self._lent[starts[i - 1]] > off:
            lo = starts[i - 1]
            msg = (
                f"ring offset {off} (+{end - off} bytes) overlaps space still lent "
                f"[{lo}, {self._lent[lo]})"
            )
            raise EOFError(msg)

    def flush(self) -> None:
        """Write the releases not written yet, freed arrays' included (never blocks)."""
        self._drain_returned()
        with self._lock:
            self._write_unsent()
        self._drain_returned(write=True)

    def _give_back(self, ref: _Lent) -> None:
        """The last array on the lent buffer ``ref`` watched was freed (any
        thread, maybe inside the garbage collector). Releases are written
        in batches of ``release_batch`` bytes, and at the latest by the next
        :meth:`flush` (the supervisor flushes whenever it waits or reads)."""
        self._returned.append(ref.off)
        self._returned_bytes += ref.size  # (a lost update only delays a write)
        if self._returned_bytes >= self.release_batch:
            self._drain_returned(write=True)

    def _drain_returned(self, write: bool = False) -> None:
        while self._returned:
            if not self._lock.acquire(blocking=False):
                return  # the holder drains the queue once it has released the lock
            try:
                self._returned_bytes = 0
                while self._returned:
                    off = self._returned.popleft()
                    self._watch.pop(off, None)
                    end = self._lent.pop(off)
                    del self._lent_starts[bisect.bisect_left(self._lent_starts, off)]
                    self.lent -= end - off
                    self._queue(off, end)
                if write:
                    self._write_unsent()
            finally:
                self._lock.release()

    def _queue(self, off: int, end: int) -> None:
        if not self.closed:
            self._unsent += EXTENT.pack(off, end - off)
            self._unsent_bytes += end - off

    def _write_unsent(self) -> None:
        """Under the lock."""
        if self._release_w is None:
            self._unsent.clear()
        while self._unsent:
            chunk = bytes(self._unsent[: _RECORDS_PER_WRITE * EXTENT.size])
            try:
                os.write(self._release_w, chunk)  # type: ignore[arg-type]
            except BlockingIOError:
                return  # the worker drains it before its next write; we write again
            except OSError:  # the worker is gone
                self._unsent.clear()
                break
            del self._unsent[: len(chunk)]
        self._unsent_bytes = 0

    def close(self) -> None:
        """Close our descriptors and unmap our view; idempotent, and a close
        cut short (Ctrl-C) is finished by the next call: ``closed`` (no more
        reads or lending) is set first, but each descriptor and the map are
        forgotten only as they are closed, with no function call in between.
        Space that is not lent is given back to the system at once; the rest
        goes with the last lent array (and the worker's mapping)."""
        with self._lock:
            self.closed = True
            self._unsent.clear()
            lent = sorted(self._lent.items())
        fd = self._fd
        if fd is not None:
            self._fd = None
            os.close(fd)
        fd = self._release_r
        if fd is not None:
            self._release_r = None
            os.close(fd)
        fd = self._release_w
        if fd is not None:
            self._release_w = None
            os.close(fd)
        m = self._map
        if m is None:
            return
        try:
            m.close()
        except BufferError:  # lent arrays remain: free every page they do not use
            page = mmap.PAGESIZE
            pos = 0
            for lo, hi in [*lent, (self.capacity, self.capacity)]:
                start, stop = -(-pos // page) * page, lo - lo % page
                if stop > start and hasattr(mmap, "MADV_REMOVE"):
                    m.madvise(mmap.MADV_REMOVE, start, stop - start)
                pos = hi
        # The lent arrays hold the map (their base): it is unmapped with the last.
        self._map = None

    def released_all(self) -> bool:
        """Closed, every descriptor included."""
        return self.closed and not self.fds()

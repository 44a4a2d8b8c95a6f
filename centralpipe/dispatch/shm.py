"""Shared-memory rings: large result buffers cross without the pipe.

Each worker process has one *ring*: a block of anonymous shared memory
(``os.memfd_create``: it has no name, so nothing ever appears in
``/dev/shm`` and nothing is left behind however a process dies) that the
main process creates for that worker and hands over on the worker's pipe
(``socket.send_fds``) before anything else, plus a *release pipe* the other
way. The worker writes the large out-of-band buffers of a message (tensor
and array memory, see :mod:`centralpipe.dispatch.transport`) into the ring,
then sends the message with each buffer's ring position in its header in
place of the bytes; the main process copies each buffer out once, into the
memory of the new tensor or array, and then tells the worker, on the release
pipe, how far the ring may be reused.

Why it is safe:

- A buffer is written completely before the message naming it is sent, and
  the pipe write/read orders the two processes: the main process never reads
  a buffer that is being written. A worker that dies mid-write never sends
  the message, so that buffer is never read; its chunk is sent again to the
  replacement worker.
- The ring is used in order (results of one worker arrive in order): the
  worker writes at ``head``, the main process releases up to the end of each
  message's last buffer once it has copied the message out, and the worker
  only writes where the main process has released (``head - released <=
  capacity``). A released position travels through the release pipe, a
  kernel object, so the worker never overwrites bytes still being read.
- Each worker generation gets a fresh ring: the one of a dead worker is
  closed when it is replaced (its memory is freed when the last mapping
  goes), so a late write by a dying worker can never land in a live ring and
  the rings in use stay one per worker however many restarts.
- Neither side ever blocks on the ring: with no room the worker sends the
  buffer on the pipe as before; with a full release pipe the main process
  keeps the position and writes it again on its next pass.

Only public APIs: ``os.memfd_create``, ``mmap``, ``socket.send_fds`` /
``recv_fds`` and ``os.pipe``. Where ``memfd_create`` does not exist (not
Linux), workers have no ring and every buffer goes on the pipe.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

__all__ = [
    "MIN_RING_BUFFER_BYTES",
    "RELEASE_EVERY_BYTES",
    "RING_ALIGN",
    "ROOM_WAIT_S",
    "Ring",
    "RingWriter",
    "available",
    "receive_ring",
]

#: Buffers smaller than this go on the pipe: they cost less to send than a
#: ring position, and it bounds the release records a worker has not read.
MIN_RING_BUFFER_BYTES = 16 * 1024
#: Buffers start on this boundary in the ring.
RING_ALIGN = 64
#: Within a message, the main process releases what it has copied out at
#: least every this many bytes (and at the message's end).
RELEASE_EVERY_BYTES = 2**20
#: How long a worker waits for room in its ring while the main process is
#: copying out earlier results, before it sends a buffer on the pipe instead.
ROOM_WAIT_S = 0.05
# The hand-over message (its fds ride along): magic, ring capacity.
_HANDOVER = struct.Struct("<QQ")
_MAGIC = 0x63705F72696E6731  # "cp_ring1"
_POS = struct.Struct("<Q")
# At most this much of the release pipe is read at once (a multiple of 8).
_DRAIN_BYTES = 64 * 1024


def available() -> bool:
    """Whether this platform has anonymous shared memory to pass to workers."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def _dup_socket(conn: Connection) -> socket.socket:
    return socket.socket(fileno=os.dup(conn.fileno()))


class Ring:
    """The main process's side of one worker's ring: it creates the memory,
    hands it to the worker, copies buffers out and releases them.

    Used by the supervisor thread alone (``take``, ``release``, ``flush``)
    and by whoever starts or replaces the worker (``hand_over``, ``close``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        fd = os.memfd_create("centralpipe-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            self._map = mmap.mmap(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd  # closed once handed over
        self._view = memoryview(self._map)
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._release_r: int | None = r  # the worker's end, closed once handed over
        self._release_w: int | None = w
        #: Where the next message's first buffer may start (all before is released).
        self.released = 0
        self._unsent: int | None = None  # a release the full pipe did not take
        self.closed = False
        #: Bytes of large buffers received through the ring, and through the
        #: pipe (they did not fit at the time), by the supervisor thread.
        self.ring_bytes = 0
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
        sock = _dup_socket(conn)
        try:
            socket.send_fds(
                sock, [_HANDOVER.pack(_MAGIC, self.capacity)], [self._fd, self._release_r]
            )
            return True
        except OSError:
            return False
        finally:
            sock.close()
            os.close(self._fd)
            os.close(self._release_r)
            self._fd = self._release_r = None

    def take(self, pos: int, size: int) -> Any:
        """A copy of the buffer the worker wrote at ring position ``pos``: a
        fresh writable uint8 array (copied without holding the GIL).

        Raises ``EOFError`` for a position outside the part of the ring the
        worker may have written (a damaged or foreign message): the pipe is
        then out of step and the worker is treated as dead."""
        if self.closed:
            raise EOFError("the ring is closed")
        off = pos % self.capacity
        if (
            size < 0
            or pos < self.released
            or pos + size > self.released + self.capacity
            or off + size > self.capacity
        ):
            msg = (
                f"ring position {pos} (+{size} bytes) is outside the writable part "
                f"[{self.released}, {self.released + self.capacity})"
            )
            raise EOFError(msg)
        self.ring_bytes += size
        out = np.empty(size, dtype=np.uint8)
        try:
            np.copyto(out, np.frombuffer(self._map, dtype=np.uint8, count=size, offset=off))
        except ValueError as exc:  # closed meanwhile (the pool is closing)
            raise EOFError(str(exc)) from None
        return out

    def release(self, end: int) -> None:
        """The worker may write again below ring position ``end`` (never blocks)."""
        if end > self.released:
            self.released = end
            self._send_release(end)

    def flush(self) -> None:
        """Write a release that found the release pipe full."""
        if self._unsent is not None:
            self._send_release(self._unsent)

    def _send_release(self, end: int) -> None:
        if self._release_w is None:
            return
        try:
            os.write(self._release_w, _POS.pack(end))
            self._unsent = None
        except BlockingIOError:
            self._unsent = end  # the worker drains it before its next write
        except OSError:
            self._unsent = None  # the worker is gone

    def close(self) -> None:
        """Unmap our view and close our descriptors; idempotent, and a close
        cut short (Ctrl-C) is finished by the next call: ``closed`` (no more
        reads) is set first, but each descriptor is forgotten only as it is
        closed, with no function call in between. The memory goes when the
        worker's mapping goes too."""
        self.closed = True
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # pragma: no cover - a copy still running: unmapped when it ends
            pass
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

    def released_all(self) -> bool:
        """Closed, every descriptor included."""
        return self.closed and not self.fds()


class RingWriter:
    """A worker's side of its ring: where the next buffer goes."""

    def __init__(self, mem_fd: int, release_fd: int, capacity: int) -> None:
        try:
            self._map = mmap.mmap(mem_fd, capacity)
        finally:
            os.close(mem_fd)
        self._view = memoryview(self._map)
        self.capacity = capacity
        self._release = release_fd
        os.set_blocking(release_fd, False)
        self.head = 0  # ring position of the next free byte
        self.released = 0  # what the main process has copied out, as last heard
        # A wait for room timed out and nothing was released since: the main
        # process is not reading us (it holds enough results); do not wait again.
        self._stalled = False

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._release, _DRAIN_BYTES)
            except BlockingIOError:
                return
            except OSError:  # pragma: no cover - the main process is gone
                return
            if len(data) < _POS.size:
                return  # b"": the main process closed it (gone, or replaced us)
            end = _POS.unpack_from(data, len(data) - _POS.size)[0]
            if end > self.released:
                self.released = end
                self._stalled = False
            if len(data) < _DRAIN_BYTES:
                return

    def place(self, buf: memoryview) -> int:
        """Copy ``buf`` (bytes, format ``B``) into the ring and return its ring
        position, or -1 when it does not fit now (it then goes on the pipe)."""
        n = buf.nbytes
        if n < MIN_RING_BUFFER_BYTES or n > self.capacity:
            return -1
        start = self._fit(n)
        if start < 0:
            start = self._wait_room(n)
            if start < 0:
                return -1
        off = start % self.capacity
        self._view[off : off + n] = buf
        self.head = start + n + (-n % RING_ALIGN)
        return start

    def _wait_room(self, n: int) -> int:
        """Where ``n`` bytes fit once the main process has released enough,
        waiting at most ``ROOM_WAIT_S`` while earlier results are being
        copied out; -1 if they do not fit by then. After a wait that found no
        room, the next ones do not wait until something is released."""
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            self._drain()
            start = self._fit(n)
            left = deadline - time.monotonic()
            if start >= 0 or self._stalled or self.released >= self.head:
                return start  # (nothing in flight: waiting cannot make room)
            if left <= 0:
                self._stalled = True
                return -1
            try:
                select.select([self._release], [], [], left)
            except (OSError, ValueError):  # pragma: no cover - closed meanwhile
                return -1

    def _fit(self, n: int) -> int:
        start = self.head
        off = start % self.capacity
        if off + n > self.capacity:  # no wrapping: skip to the ring's start
            start += self.capacity - off
        return start if start + n - self.released <= self.capacity else -1


def receive_ring(conn: Connection) -> RingWriter:
    """The worker's first read: the ring and release pipe sent by
    :meth:`Ring.hand_over`. Raises ``EOFError`` if the pipe closes first."""
    sock = _dup_socket(conn)
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, _HANDOVER.size, 2)
        while fds and len(data) < _HANDOVER.size:  # a split read: the rest follows
            more = sock.recv(_HANDOVER.size - len(data))
            if not more:
                break
            data += more
    finally:
        sock.close()
    if len(fds) != 2 or len(data) != _HANDOVER.size:
        for fd in fds:
            os.close(fd)
        raise EOFError("the main process did not hand over a ring")
    magic, capacity = _HANDOVER.unpack(data)
    if magic != _MAGIC:
        for fd in fds:
            os.close(fd)
        raise EOFError("the first message on the worker's pipe is not a ring hand-over")
    return RingWriter(fds[0], fds[1], capacity)

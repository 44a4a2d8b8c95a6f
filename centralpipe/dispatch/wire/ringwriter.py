"""The worker's side of its shared-memory ring; large outputs moved there as they are made.

A worker runs a chunk's items one after another and sends the chunk's
outputs in one message. Kept until then, every large output would sit in
memory of its own (a chunk holds up to 16 MiB of them): each new tensor is
written into cache-cold memory by the stage, and read cold again when the
message is written into the ring. Instead :func:`stash`, called on each
output as the worker stages return it, copies a plain tensor or array of
``MIN_RING_BUFFER_BYTES`` and more into the ring at once, while its bytes are
still in the CPU cache, and returns a :class:`RingRef` in its place: the
output's own memory is freed, and the allocator hands the same warm memory
to the next output. The transport sends a ``RingRef`` like the tensor or
array it stands for (its ring offset in the header, no second copy); the
main process rebuilds exactly what the output would have become.

:class:`RingWriter` keeps the ring's free space (see :mod:`centralpipe.dispatch.wire.ringreader`
for the protocol and why it is safe).

Only outputs whose observable form this keeps whole are moved: a CPU tensor
that is the only user of all of its storage (contiguous, offset 0, no
autograd, not conjugate or negative), or a C-contiguous numpy array that owns
its memory (no objects); a read-only array stays read-only. Anything else,
and an output that does not fit in the ring now, stays as it is and is sent
the usual way. Placed space that is never sent (the result failed to pickle)
is freed by :meth:`RingWriter.forget` after each send.
"""

from __future__ import annotations

import bisect
import mmap
import os
import select
import socket
import sys
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.wire.ringreader import (
    EXTENT,
    HANDOVER,
    MAGIC,
    MIN_RING_BUFFER_BYTES,
    aligned,
    dup_socket,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Placed", "RingRef", "RingWriter", "receive_ring", "stash"]

# At most this much of the release pipe is read at once.
_DRAIN_BYTES = 64 * 1024


class RingWriter:
    """A worker's side of its ring: where the next buffer goes.

    Free space is a sorted list of extents ``[start, end)``, filled first-fit
    (see :meth:`_alloc`) and fed by the releases."""

    def __init__(self, mem_fd: int, release_fd: int, capacity: int) -> None:
        try:
            self._map = mmap.mmap(mem_fd, capacity)
        finally:
            os.close(mem_fd)
        self._view = memoryview(self._map)
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.capacity = capacity
        self._release = release_fd
        self._placed: dict[int, int] = {}  # reserved, not sent yet: offset -> bytes
        os.set_blocking(release_fd, False)
        self._starts = [0]  # free extents: sorted starts ...
        self._ends = {0: capacity}  # ... and their ends
        self.used = 0  # bytes written and not yet released
        # A wait for room timed out and nothing was released since: the main
        # process is not reading us (it holds enough results); do not wait again.
        self._stalled = False
        self._partial = b""  # a record split across two reads

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self._release, _DRAIN_BYTES)
            except BlockingIOError:
                return
            except OSError:  # pragma: no cover - the main process is gone
                return
            if not data:
                return  # the main process closed it (gone, or replaced us)
            data = self._partial + data
            whole = len(data) - len(data) % EXTENT.size
            self._partial = data[whole:]
            for off, size in EXTENT.iter_unpack(data[:whole]):
                self._free(off, off + size)
            if whole:
                self._stalled = False
            if len(data) < _DRAIN_BYTES:
                return

    def _free(self, start: int, end: int) -> None:
        starts, ends = self._starts, self._ends
        self.used -= end - start
        i = bisect.bisect_left(starts, start)
        if i and ends[starts[i - 1]] == start:  # joins the extent before
            i -= 1
            start = starts.pop(i)
            del ends[start]
        if i < len(starts) and starts[i] == end:  # and the one after
            end = ends.pop(starts.pop(i))
        starts.insert(i, start)
        ends[start] = end

    def _alloc(self, n: int) -> int:
        """The offset of ``n`` free bytes (taken), or -1: the lowest that
        fits (first fit). Space is mostly released in the order it was
        taken, so this keeps reusing the same few MiB at the ring's start,
        still in the CPU caches, rather than walking all of it: a copy into
        cold memory costs about twice as much."""
        starts, ends = self._starts, self._ends
        for i in range(len(starts)):
            s = starts[i]
            e = ends[s]
            if e - s >= n:
                break
        else:
            return -1
        del starts[i]
        del ends[s]
        if e > s + n:
            starts.insert(i, s + n)
            ends[s + n] = e
        self.used += n
        return s

    def reserve(self, size: int) -> int:
        """The offset of ``size`` bytes of ring space, taken now for a buffer
        of a message not built yet (see ``dispatch.stash``), or -1 when there
        is no room now (never waits). Sent by :meth:`sent`; :meth:`forget`
        frees what was not."""
        n = aligned(size)
        if size < MIN_RING_BUFFER_BYTES or n > self.capacity:
            return -1
        at = self._alloc(n)
        if at < 0:
            self._drain()
            at = self._alloc(n)
        if at >= 0:
            self._placed[at] = n
        return at

    def array(self, at: int, size: int) -> Any:
        """The ring's ``size`` bytes at offset ``at``, as a uint8 array."""
        return self._array[at : at + size]

    def sent(self, at: int) -> None:
        """The reserved space at ``at`` is named by a message being sent."""
        self._placed.pop(at, None)

    def forget(self) -> None:
        """Free the reserved space no message named (its result was dropped)."""
        for at, n in self._placed.items():
            self._free(at, at + n)
        self._placed.clear()

    def place(self, buf: memoryview) -> int:
        """Copy ``buf`` (bytes, format ``B``) into the ring and return its ring
        offset, or -1 when it does not fit now (it then goes on the pipe)."""
        size = buf.nbytes
        n = aligned(size)
        if size < MIN_RING_BUFFER_BYTES or n > self.capacity:
            return -1
        at = self._alloc(n)
        if at < 0:  # only now read the releases: fewer system calls
            self._drain()
            at = self._wait_room(n)
            if at < 0:
                return -1
        self._view[at : at + size] = buf
        return at

    def _wait_room(self, n: int) -> int:
        """Where ``n`` bytes fit once the main process has released enough,
        waiting at most ``ROOM_WAIT_S`` while earlier results are in use; -1
        if they do not fit by then. After a wait that found no room, the next
        ones do not wait until something is released."""
        deadline = time.monotonic() + timeouts.ROOM_WAIT_S
        while True:
            at = self._alloc(n)
            left = deadline - time.monotonic()
            if at >= 0 or self._stalled or not self.used:
                return at  # (nothing in use: waiting cannot make room)
            if left <= 0:
                self._stalled = True
                return -1
            try:
                select.select([self._release], [], [], left)
            except (OSError, ValueError):  # pragma: no cover - closed meanwhile
                return -1
            self._drain()


def receive_ring(conn: Connection) -> RingWriter:
    """The worker's first read: the ring and release pipe sent by
    :meth:`Ring.hand_over`. Raises ``EOFError`` if the pipe closes first."""
    sock = dup_socket(conn)
    try:
        data, fds, _flags, _addr = socket.recv_fds(sock, HANDOVER.size, 2)
        while fds and len(data) < HANDOVER.size:  # a split read: the rest follows
            more = sock.recv(HANDOVER.size - len(data))
            if not more:
                break
            data += more
    finally:
        sock.close()
    if len(fds) != 2 or len(data) != HANDOVER.size:
        for fd in fds:
            os.close(fd)
        raise EOFError("the main process did not hand over a ring")
    magic, capacity = HANDOVER.unpack(data)
    if magic != MAGIC:
        for fd in fds:
            os.close(fd)
        raise EOFError("the first message on the worker's pipe is not a ring hand-over")
    return RingWriter(fds[0], fds[1], capacity)


class Placed:
    """A buffer already in the sender's ring: its offset and size."""

    __slots__ = ("nbytes", "offset")

    def __init__(self, offset: int, nbytes: int) -> None:
        self.offset = offset
        self.nbytes = nbytes


class RingRef:
    """A tensor (``kind`` ``"t"``) or numpy array (``"n"``) whose bytes are
    in the ring at ``placed``: C-contiguous, of ``dtype`` and ``shape``."""

    __slots__ = ("dtype", "kind", "placed", "shape", "writeable")

    def __init__(
        self, kind: str, placed: Placed, dtype: Any, shape: tuple[int, ...], writeable: bool
    ) -> None:
        self.kind = kind
        self.placed = placed
        self.dtype = dtype
        self.shape = shape
        self.writeable = writeable

    def strides(self, itemsize: int) -> tuple[int, ...]:
        """C-contiguous strides, in units of ``itemsize`` bytes."""
        out = []
        step = itemsize
        for n in reversed(self.shape):
            out.append(step)
            step *= max(n, 1)
        return tuple(reversed(out))


def stash(obj: Any, ring: RingWriter) -> Any:
    """``obj``, or a :class:`RingRef` to a copy of it in ``ring`` (see the
    module docstring); never raises."""
    cls = type(obj)
    try:
        if cls is np.ndarray:
            # Small arrays (a line's tokens) are the common case: size first.
            return obj if obj.nbytes < MIN_RING_BUFFER_BYTES else _stash_array(obj, ring)
        # torch.Tensor from sys.modules: a worker whose functions need no torch
        # never imports it (see dispatch.preload); without torch, no tensor.
        torch = sys.modules.get("torch")
        if torch is not None and cls is torch.Tensor:
            return _stash_tensor(obj, ring)
    except Exception:  # an odd tensor or array: sent the usual way
        return obj
    return obj


def plain_cpu_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor whose bytes the transport writes itself: a
    strided CPU tensor without autograd, quantization or a lazy conjugate or
    negation bit (anything else goes through torch's own reduction)."""
    import torch

    return not (
        not t.is_cpu
        or t.layout != torch.strided
        or t.requires_grad
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
    )


def _stash_tensor(t: torch.Tensor, ring: RingWriter) -> Any:
    import torch

    if not plain_cpu_tensor(t) or t.storage_offset() or not t.is_contiguous():
        return t
    nbytes = t.nbytes
    if nbytes < MIN_RING_BUFFER_BYTES or t.untyped_storage().nbytes() != nbytes:
        return t
    at = ring.reserve(nbytes)
    if at < 0:
        return t
    # No autograd (checked above), contiguous: a uint8 view of its bytes.
    ring.array(at, nbytes)[:] = t.view(torch.uint8).numpy().reshape(-1)
    return RingRef("t", Placed(at, nbytes), t.dtype, tuple(t.shape), True)


def _stash_array(a: Any, ring: RingWriter) -> Any:
    if a.dtype.hasobject or not a.flags.c_contiguous or a.base is not None:
        return a
    nbytes = a.nbytes
    if nbytes < MIN_RING_BUFFER_BYTES:
        return a
    at = ring.reserve(nbytes)
    if at < 0:
        return a
    ring.array(at, nbytes)[:] = a.reshape(-1).view(np.uint8)
    return RingRef("n", Placed(at, nbytes), a.dtype, a.shape, bool(a.flags.writeable))

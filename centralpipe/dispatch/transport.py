"""Messages over ``multiprocessing`` connections, tensors as raw bytes.

``Connection.send`` builds a pickler and copies torch's reducers on every
message (~9 µs once torch is imported) and torch's shared-memory tensor
reductions are among the slowest transports on a small machine. Instead a
message is one ``pickle`` (protocol 5) whose CPU tensors are reduced to
out-of-band buffers: the header carries the buffer sizes, then each tensor's
bytes follow as one ``send_bytes`` of its memory (no copy on the way out) and
are read from the socket straight into the memory of a new tensor, which
becomes the received tensor's storage. Small tensors travel in-band.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
import os
import pickle
import struct
from multiprocessing.connection import Connection
from typing import Any

import torch

__all__ = ["dumps", "loads", "recv", "send"]

#: Tensors smaller than this go inside the pickle (one copy beats a message).
INBAND_MAX_BYTES = 16 * 1024
_COUNT = struct.Struct("<I")
_SIZE = struct.Struct("<Q")
_NO_BUFFERS = _COUNT.pack(0)
_FRAME = struct.Struct("!i")
_FRAME_BIG = struct.Struct("!Q")


def _rebuild_tensor(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if isinstance(data, torch.Tensor):  # an out-of-band buffer read by recv()
        return data.view(dtype).view(shape)
    view = memoryview(data)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly:
        data = bytearray(view)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def _reduce_tensor(t: torch.Tensor) -> Any:
    if (
        t.device.type != "cpu"
        or t.layout != torch.strided
        or t.requires_grad
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
    ):
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    shape = tuple(t.shape)
    if nbytes == 0:
        return (_rebuild_tensor, (b"", t.dtype, shape))
    array = (ctypes.c_char * nbytes).from_address(t.data_ptr())
    array.owner = t  # type: ignore[attr-defined]  # the view must keep the memory alive
    raw = memoryview(array).cast("B")
    if nbytes < INBAND_MAX_BYTES:
        return (_rebuild_tensor, (raw.tobytes(), t.dtype, shape))
    return (_rebuild_tensor, (pickle.PickleBuffer(raw), t.dtype, shape))


class _Pickler(pickle.Pickler):
    dispatch_table = copyreg.dispatch_table.copy()
    dispatch_table[torch.Tensor] = _reduce_tensor


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; large tensors come back as separate raw buffers.

    The header is: buffer count (u32), each buffer's size (u64), the pickle.
    """
    buffers: list[memoryview] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=lambda b: buffers.append(b.raw())).dump(obj)
    if not buffers:
        return _NO_BUFFERS + out.getvalue(), buffers
    prefix = _COUNT.pack(len(buffers)) + b"".join(_SIZE.pack(b.nbytes) for b in buffers)
    return prefix + out.getvalue(), buffers


def send(conn: Connection, obj: Any) -> None:
    """Send one message: the header, then each out-of-band buffer."""
    head, buffers = dumps(obj)
    conn.send_bytes(head)
    for buf in buffers:
        conn.send_bytes(buf)


def recv(conn: Connection) -> Any:
    """Receive one message sent by :func:`send`."""
    view = memoryview(conn.recv_bytes())
    (count,) = _COUNT.unpack_from(view, 0)
    if not count:
        return pickle.loads(view[_COUNT.size :])
    buffers = []
    for i in range(count):
        (size,) = _SIZE.unpack_from(view, _COUNT.size + i * _SIZE.size)
        buffers.append(_recv_tensor(conn, size))
    return pickle.loads(view[_COUNT.size + count * _SIZE.size :], buffers=buffers)


def _read_exact(fd: int, view: memoryview) -> None:
    pos, n = 0, view.nbytes
    while pos < n:
        got = os.readv(fd, [view[pos:]])
        if got == 0:
            raise EOFError("connection closed in the middle of a message")
        pos += got


def _recv_tensor(conn: Connection, size: int) -> torch.Tensor:
    """One ``send_bytes`` message read straight into a new uint8 tensor.

    ``Connection.recv_bytes_into`` reads into a growing ``BytesIO`` and then
    copies; reading the socket into the tensor's own memory writes each byte
    once. The framing is ``send_bytes``': a signed 32-bit big-endian length,
    or -1 and a 64-bit length for messages over 2 GiB.
    """
    if size == 0 or not hasattr(os, "readv"):
        array = bytearray(size)
        conn.recv_bytes_into(array)
        return (
            torch.frombuffer(array, dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
    fd = conn.fileno()
    head = bytearray(4)
    _read_exact(fd, memoryview(head))
    (length,) = _FRAME.unpack(head)
    if length == -1:
        big = bytearray(8)
        _read_exact(fd, memoryview(big))
        (length,) = _FRAME_BIG.unpack(big)
    if length != size:
        raise EOFError(f"expected a {size}-byte buffer, got a {length}-byte message")
    out = torch.empty(size, dtype=torch.uint8)
    memory = (ctypes.c_char * size).from_address(out.data_ptr())
    _read_exact(fd, memoryview(memory).cast("B"))
    return out


def loads(head: bytes, buffers: list[Any]) -> Any:
    """Inverse of :func:`dumps` for buffers already at hand."""
    view = memoryview(head)
    (count,) = _COUNT.unpack_from(view, 0)
    return pickle.loads(view[_COUNT.size + count * _SIZE.size :], buffers=buffers)

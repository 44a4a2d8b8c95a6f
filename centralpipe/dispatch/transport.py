"""Messages over ``multiprocessing`` connections, tensors as raw bytes.

``Connection.send`` builds a pickler and copies torch's reducers on every
message (~9 µs once torch is imported) and torch's shared-memory tensor
reductions are among the slowest transports on a small machine. Instead a
message is one ``pickle`` (protocol 5) whose CPU tensors are reduced to
out-of-band buffers: the header carries the buffer sizes, then each tensor's
bytes follow as one ``send_bytes`` of its memory (no copy on the way out) and
are read straight into a pre-allocated ``bytearray`` that becomes the received
tensor's storage (``torch.frombuffer``). Small tensors travel in-band.
"""

from __future__ import annotations

import copyreg
import ctypes
import io
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


def _rebuild_tensor(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
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
        buf = bytearray(size)
        conn.recv_bytes_into(buf)
        buffers.append(buf)
    return pickle.loads(view[_COUNT.size + count * _SIZE.size :], buffers=buffers)


def loads(head: bytes, buffers: list[Any]) -> Any:
    """Inverse of :func:`dumps` for buffers already at hand."""
    view = memoryview(head)
    (count,) = _COUNT.unpack_from(view, 0)
    return pickle.loads(view[_COUNT.size + count * _SIZE.size :], buffers=buffers)

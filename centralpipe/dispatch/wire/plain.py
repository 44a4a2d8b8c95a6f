"""Results that are plain tensors and arrays in the ring: described, not pickled.

Most results of a data-loading pipeline are one tensor or array per item. A
worker has already moved each of them into its shared-memory ring as it was
made (:func:`centralpipe.dispatch.wire.ringwriter.stash`), so all that is left to send
is, per item, where it is and what it looks like. When *every* output of a
chunk is such a :class:`~centralpipe.dispatch.wire.ringwriter.RingRef` (a C-contiguous
CPU tensor or numpy array of a dtype listed below, sole owner of its
memory), :func:`describe` turns them into a flat table of integers (kind,
dtype code, writability, shape) and the list of their ring places; the main
process's :func:`rebuild` makes each output straight on its ring buffer
(``torch.frombuffer`` / ``ndarray.view``), with no pickle, no region table
and no per-item Python object beyond the output itself.

What comes out is what the pickled path would give: same type, dtype, shape,
C-contiguous strides, writability, each output on memory of its own. Any
other result (a container, a view, a byte-swapped, structured or object
dtype, a failure, an output that did not fit in the ring) takes the pickled
path unchanged; see :mod:`centralpipe.dispatch.wire.transport`, which frames both.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from centralpipe.dispatch.wire.ringwriter import Placed, RingRef

__all__ = ["NUMPY_CHARS", "TORCH_DTYPES", "describe", "rebuild"]

#: torch dtypes described by their index here (others are pickled).
TORCH_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
)
#: numpy dtypes (native byte order, no metadata) described by their index here.
NUMPY_CHARS = "?bBhHiIlLqQefdgFDG"
_NUMPY_DTYPES = tuple(np.dtype(c) for c in NUMPY_CHARS)
# Per output: kind, dtype code, writeable, ndim, then ndim dimensions.
_TENSOR, _ARRAY = 0, 1

_torch_codes: dict[Any, int] | None = None


def _torch_code(dtype: Any) -> int:
    global _torch_codes
    if _torch_codes is None:
        torch = sys.modules["torch"]
        _torch_codes = {
            getattr(torch, name): i for i, name in enumerate(TORCH_DTYPES) if hasattr(torch, name)
        }
    return _torch_codes.get(dtype, -1)


def _numpy_code(dtype: Any) -> int:
    code = NUMPY_CHARS.find(dtype.char)
    if code < 0 or dtype != _NUMPY_DTYPES[code] or dtype.metadata is not None:
        return -1
    return code


def describe(outputs: Any) -> tuple[list[int], list[Placed]] | None:
    """The table and ring places of ``outputs`` when it is a non-empty list
    of ring references of listed dtypes, else ``None`` (pickle it)."""
    if type(outputs) is not list or not outputs:
        return None
    table: list[int] = []
    places: list[Placed] = []
    for ref in outputs:
        if type(ref) is not RingRef:
            return None
        if ref.kind == "t":
            kind, code = _TENSOR, _torch_code(ref.dtype)
        else:
            kind, code = _ARRAY, _numpy_code(ref.dtype)
        if code < 0:
            return None
        table += (kind, code, int(ref.writeable), len(ref.shape), *ref.shape)
        places.append(ref.placed)
    return table, places


def rebuild(table: list[int], buffers: list[Any]) -> list[Any]:
    """The outputs described by ``table``, each made on its buffer (a
    writable uint8 array or ``bytearray`` of exactly its bytes). Raises
    ``EOFError`` for a table that does not match its buffers (a damaged
    message: the pipe is out of step)."""
    out: list[Any] = []
    pos, end, k = 0, len(table), 0
    try:
        while pos < end:
            kind, code, writeable, ndim = table[pos : pos + 4]
            shape = tuple(table[pos + 4 : pos + 4 + ndim])
            pos += 4 + ndim
            buf = buffers[k]
            k += 1
            if kind == _TENSOR:
                import torch

                dtype = getattr(torch, TORCH_DTYPES[code])
                if len(buf) != math.prod(shape) * dtype.itemsize or ndim != len(shape):
                    raise ValueError("a tensor's shape does not match its bytes")
                t = torch.frombuffer(buf, dtype=dtype)
                out.append(t if ndim == 1 else t.view(shape))
            elif kind == _ARRAY:
                dtype = _NUMPY_DTYPES[code]
                if len(buf) != math.prod(shape) * dtype.itemsize or ndim != len(shape):
                    raise ValueError("an array's shape does not match its bytes")
                a = np.frombuffer(buf, dtype=np.uint8) if type(buf) is bytearray else buf
                a = a.view(dtype).reshape(shape)
                if not writeable:
                    a.flags.writeable = False
                out.append(a)
            else:
                raise ValueError(f"unknown output kind {kind}")
    except (ValueError, IndexError, TypeError) as exc:
        raise EOFError(f"a damaged result table: {exc}") from None
    if k != len(buffers):
        raise EOFError("a result table names fewer buffers than the message has")
    return out

"""Token data in checkpoints: a list of 1-D arrays saved as one flat tensor plus offsets.

In-flight items (a chunk's) and the buffers of regrouping stages (a bucket's
heap, a pack's bins) are often lists of 1-D numpy arrays or tensors, or lists
of such lists (buckets). Saved item by item they cost a pickle each and
megabytes for a large buffer; :func:`encode_items` saves such a list as one
*part*::

    {"kind": "numpy" | "torch", "dtype": str, "writeable": bool,
     "values": Tensor (1-D, the items concatenated),
     "lengths": Tensor (each array's length),
     "groups": Tensor (each group's number of arrays) | None}

Integer tensors are saved in the narrowest integer dtype that holds their
values (token ids of a 50k vocabulary take 2 bytes, not 4 or 8), and cast
back to ``dtype`` when read.

and :func:`decode_items` gives back the same list: the same types (numpy
arrays stay numpy, tensors tensors), dtypes, values and writability, each
array a view of one buffer. The encoded value is the tuple ``("compact", 2,
[part or list, ...])`` (a list that does not qualify is kept as it is, so a
part may be a plain list); any plain list, including every checkpoint written
before this encoding, decodes to itself, and so does the dict ``{"compact": 1,
"parts": [...]}`` of the first compact format. Only builtins and tensors:
``torch.load(weights_only=True)`` reads it. A damaged value raises
``ValueError`` naming what is wrong.

Why a tuple: ``torch.distributed.checkpoint`` walks dicts and lists down to
their leaves and loads a tensor leaf in place into the template's tensor of
the same shape, so a state whose structure depends on what a buffer holds
cannot load into a fresh loader's ``state_dict()`` ("Missing key"). A tuple
is one leaf to it, saved and loaded whole (as a fresh loader's empty list
is), so the template needs no pre-sized tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from itertools import chain
from typing import Any

import numpy as np
import torch

from centralpipe.dispatch.wire.tokens import Flat, flatten, unflatten
from centralpipe.validators import FieldError

__all__ = [
    "COMPACT_KEY",
    "FORMAT",
    "PART_KEYS",
    "Encoded",
    "copy_items",
    "count_items",
    "decode_items",
    "decode_keyed",
    "decode_part",
    "decoded_items",
    "encode_items",
    "encode_parts",
    "encoded_body",
    "is_compact",
    "join_parts",
    "pack_part",
    "part_of_flats",
]

#: The first element of an encoded value (the key of the first format's dict).
COMPACT_KEY = "compact"
#: The format written: ``(COMPACT_KEY, FORMAT, body)``.
FORMAT = 2
_FORMAT_DICT = 1
_PARTS = "parts"
PART_KEYS = frozenset(("kind", "dtype", "writeable", "values", "lengths", "groups"))
_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        *(torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64),
        *(torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16),
        *(torch.float32, torch.float64),
    )
}


_NARROW = (torch.uint8, torch.int8, torch.uint16, torch.int16, torch.int32, torch.int64)
_INTS = frozenset((*_NARROW, torch.uint32, torch.uint64))
_NUMPY_OF = {
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.uint16: np.uint16,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}


def narrow(t: torch.Tensor) -> torch.Tensor:
    """An integer tensor in the narrowest integer dtype that holds its values
    (``t`` itself when none is narrower, or when it is not of integers).
    Worked out with numpy: one thread, no torch intra-op pool to wake."""
    if t.dtype not in _INTS or not len(t) or t.dtype == torch.uint64:
        return t
    a = t.numpy()
    low, high = int(a.min()), int(a.max())
    for dtype in _NARROW:
        if dtype.itemsize >= t.dtype.itemsize:
            return t
        info = torch.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return torch.from_numpy(a.astype(_NUMPY_OF[dtype]))
    return t  # pragma: no cover - int64 is in _NARROW


def _ints(values: Any, n: int) -> torch.Tensor:
    return narrow(torch.from_numpy(np.fromiter(values, dtype=np.int64, count=n)))


def _lengths(ends: Any) -> torch.Tensor:
    """Lengths (narrowed) of the items whose ``ends`` (int64 numpy) are given."""
    return narrow(torch.from_numpy(np.diff(ends, prepend=0)))


def _array_type(cls: type) -> bool:
    return cls is np.ndarray or cls is torch.Tensor


def pack_part(items: list[Any]) -> dict[str, Any] | list[Any]:
    """One list as a part: packed when it qualifies, else a copy of it."""
    if not items:
        return []
    groups = None
    leaves = items
    if type(items[0]) is list:
        if not items[0] or not _array_type(type(items[0][0])):
            return list(items)
        if set(map(type, items)) != {list} or not all(items):
            return list(items)
        leaves = list(chain.from_iterable(items))
        groups = _ints(map(len, items), len(items))
    if not _array_type(type(leaves[0])):
        return list(items)
    flat = flatten(leaves, min_items=1)
    if flat is None:
        return list(items)
    if flat.kind == "numpy":
        values = torch.from_numpy(flat.flat)
        dtype = str(flat.flat.dtype)
    else:
        values = flat.flat
        dtype = str(values.dtype).removeprefix("torch.")
    return {
        "kind": flat.kind,
        "dtype": dtype,
        "writeable": flat.writeable,
        "values": narrow(values),
        "lengths": _lengths(flat.ends),
        "groups": groups,
    }


def part_of_flats(flats: Sequence[Flat]) -> dict[str, Any] | None:
    """The part of a list of groups already flattened for sending (one
    :class:`~centralpipe.dispatch.wire.tokens.Flat` each), or ``None`` when
    they differ in kind, dtype or writability."""
    first = flats[0]
    # (no generators in what state_dict() runs: see protocol.chunk_message)
    same = {(f.kind, f.writeable, f.flat.dtype) for f in flats}
    if len(same) != 1 or 0 in set(map(len, flats)):
        return None
    # Every flat's lengths in three numpy calls, not two per flat: the
    # differences of all ends, each flat's first length being its first end.
    ends = np.concatenate([f.ends for f in flats])
    lengths = np.diff(ends, prepend=0)
    firsts = np.cumsum(np.fromiter(map(len, flats), dtype=np.int64, count=len(flats)))[:-1]
    lengths[firsts] = ends[firsts]
    if first.kind == "numpy":
        values = torch.from_numpy(np.concatenate([f.flat for f in flats]))
        dtype = str(first.flat.dtype)
    else:
        values = torch.cat([f.flat for f in flats])
        dtype = str(values.dtype).removeprefix("torch.")
    return {
        "kind": first.kind,
        "dtype": dtype,
        "writeable": first.writeable,
        "values": narrow(values),
        "lengths": narrow(torch.from_numpy(lengths)),
        "groups": _ints(map(len, flats), len(flats)),
    }


#: An encoded list: ``(COMPACT_KEY, FORMAT, parts)``, or a plain list.
Encoded = tuple[str, int, list[Any]] | list[Any]


def encode_parts(parts: Sequence[list[Any]]) -> Encoded:
    """The concatenation of ``parts`` (lists), each packed on its own when it
    qualifies; a plain list when none does (what older checkpoints hold)."""
    return join_parts([pack_part(p) for p in parts if p])


def join_parts(encoded: Sequence[dict[str, Any] | list[Any]]) -> Encoded:
    """The value of parts made by :func:`pack_part` (in order)."""
    if dict not in set(map(type, encoded)):  # no generator: see protocol.chunk_message
        return list(chain.from_iterable(encoded))
    return (COMPACT_KEY, FORMAT, list(encoded))


def encode_items(items: list[Any]) -> Encoded:
    """``items`` as a checkpoint value: one packed part when it qualifies,
    else the list itself (a copy)."""
    return encode_parts([items])


def _is_encoded(value: Any) -> bool:
    if type(value) is tuple:
        return len(value) == 3 and value[0] == COMPACT_KEY
    return isinstance(value, dict) and COMPACT_KEY in value


def encoded_body(value: Any, body: type) -> Any:
    """The body of an encoded value of the current format (a ``body``, a
    list of parts or a table's dict); ``ValueError`` when it is not one."""
    if type(value) is not tuple or len(value) != 3 or value[0] != COMPACT_KEY:
        raise ValueError(f"expected a compact value, got {type(value).__name__}")
    if value[1] != FORMAT:
        raise ValueError(f"a compact value of format {value[1]!r} is not known")
    if not isinstance(value[2], body):
        raise ValueError(f"a compact body must be a {body.__name__}, got {type(value[2]).__name__}")
    return value[2]


def _check_part(part: Any) -> None:
    if not isinstance(part, dict) or set(part) != PART_KEYS:
        keys = sorted(part) if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"a compact part must have the keys {sorted(PART_KEYS)}, got {keys}")
    kind, dtype, values = part["kind"], part["dtype"], part["values"]
    if kind not in ("numpy", "torch") or dtype not in _TORCH_DTYPES:
        raise ValueError(f"a compact part of kind {kind!r} and dtype {dtype!r} is not known")
    if kind == "numpy" and dtype == "bfloat16":
        raise ValueError("a compact numpy part cannot be bfloat16")
    if not isinstance(values, torch.Tensor) or values.dim() != 1:
        raise ValueError(f"compact values must be a 1-D tensor, got {type(values).__name__}")
    want = _TORCH_DTYPES[dtype]
    if values.dtype != want and not (values.dtype in _INTS and want in _INTS):
        raise ValueError(f"compact values of dtype {values.dtype} for items of dtype {dtype}")
    for key in ("lengths", "groups"):
        column = part[key]
        if column is None and key == "groups":
            continue
        if not isinstance(column, torch.Tensor) or column.dtype not in _INTS or column.dim() != 1:
            raise ValueError(f"compact {key} must be a 1-D integer tensor, got {column!r}")
    if not isinstance(part["writeable"], bool):
        raise ValueError(f"compact writeable must be a bool, got {part['writeable']!r}")


def decode_part(part: Any) -> list[Any]:
    """The items of one part (a list as it is); ``ValueError`` when damaged."""
    if isinstance(part, list):
        return list(part)
    _check_part(part)
    values = part["values"]
    want = _TORCH_DTYPES[part["dtype"]]
    if values.dtype != want:
        values = values.to(want)
    if part["kind"] == "numpy":
        values = values.numpy()
    lengths = part["lengths"].to(torch.int64)
    if len(lengths) and int(lengths.min()) < 0:
        raise ValueError("compact lengths must be >= 0")
    ends = torch.cumsum(lengths, 0).numpy()
    leaves = unflatten(part["kind"], values, ends, part["writeable"])
    groups = part["groups"]
    if groups is None:
        return leaves
    sizes = groups.to(torch.int64)
    if len(sizes) and int(sizes.min()) < 1:
        raise ValueError("compact groups must hold one array or more each")
    bounds = torch.cumsum(sizes, 0).tolist()
    if bounds[-1:] != [len(leaves)]:
        raise ValueError(f"compact groups hold {bounds[-1:]} arrays, the part has {len(leaves)}")
    return [leaves[a:b] for a, b in zip([0, *bounds[:-1]], bounds)]


def decoded_items(field: str, value: Any) -> Any:
    """A checkpoint model field's converter: the list a compact value stands
    for (a ``FieldError`` naming ``field`` when it is damaged); any other
    value as it is, for the field's validator to judge."""
    if not _is_encoded(value):
        return value
    try:
        return decode_items(value)
    except ValueError as exc:
        raise FieldError(field, f"a list or a readable compact list ({exc})", value) from None


def decode_items(value: Any) -> list[Any]:
    """The list an encoded value stands for; a plain list as it is (a copy)."""
    if isinstance(value, (list, tuple)) and not _is_encoded(value):
        return list(value)
    if not _is_encoded(value):
        raise ValueError(f"expected a list or a compact list, got {type(value).__name__}")
    if isinstance(value, dict):  # the first format
        if value[COMPACT_KEY] != _FORMAT_DICT or set(value) != {COMPACT_KEY, _PARTS}:
            raise ValueError(f"a compact list of format {value[COMPACT_KEY]!r} is not known")
        parts = value[_PARTS]
        if not isinstance(parts, list):
            raise ValueError(f"compact parts must be a list, got {type(parts).__name__}")
    else:
        parts = encoded_body(value, list)
    return [x for part in parts for x in decode_part(part)]


def count_items(value: Any) -> int:
    """How many items an encoded value (or a plain list) holds."""
    if isinstance(value, (list, tuple)) and not _is_encoded(value):
        return len(value)
    return len(decode_items(value))


def copy_items(value: Any) -> Any:
    """A copy of an encoded value's containers (its tensors are shared)."""
    if type(value) is tuple and len(value) == 3:
        return (value[0], value[1], copy.copy(value[2]))
    if isinstance(value, dict):
        return {**value, _PARTS: list(value.get(_PARTS, ()))}
    return list(value)


def decode_keyed(value: Any, keys: Sequence[str]) -> Any:
    """A table of the first compact format, ``{key: int tensor per int column,
    "items": encoded}`` (a bucket's heap: ``checkpoint.table`` writes it
    now), as a list of ``[int, ..., item]`` entries (a plain list as it
    is). ``ValueError`` for a damaged one."""
    if not isinstance(value, dict):
        return value
    if set(value) != {"items", *keys}:
        raise ValueError(f"a compact table must have the keys {sorted(['items', *keys])}")
    items = decode_items(value["items"])
    columns = []
    for key in keys:
        column = value[key]
        if not isinstance(column, torch.Tensor) or column.dtype not in _INTS:
            raise ValueError(f"compact {key} must be an integer tensor, got {column!r}")
        if column.dim() != 1 or len(column) != len(items):
            raise ValueError(f"compact {key} must hold one int per item ({len(items)})")
        columns.append(column.tolist())
    return [[*row, item] for *row, item in zip(*columns, items)]


def is_compact(value: Any) -> bool:
    """Whether ``value`` is an encoded list (not a plain one)."""
    return _is_encoded(value)

"""Lists of 1-D arrays (token data) sent as one flat buffer plus offsets.

A tokenizer returns one short 1-D array per line; a bucket or batch is a list
of them. Pickled one by one, each costs the main process a reduction on the
way out and a rebuild on the way in (a few µs a line, the main cost of the
motivating pipeline). :func:`flatten` turns such a list into a :class:`Flat`:
the arrays concatenated into one buffer and their ends, which pickles as two
arrays (the transport sends a large buffer out of band, through the sender's
shared-memory ring) and unpickles straight into the list again
(:func:`unflatten`): each item a view of one fresh buffer of the receiver's.

What comes out is what went in, item by item: the same type (``np.ndarray``
stays an exact ``np.ndarray``, a ``torch.Tensor`` a tensor), dtype, length,
values and writability; only memory is shared (each item is a view of the
receiver's buffer, not a block of its own). A list qualifies when it is a
``list`` of at least :data:`MIN_ITEMS` items that are all 1-D numpy arrays
(exact type, native byte order, a dtype in :data:`NUMPY_DTYPES`, all writable
or all read-only) or all 1-D CPU strided tensors (exact type, no autograd, not
conjugate or negative views, a dtype in :data:`TORCH_DTYPES`), all of one
dtype; anything else is left to the transport (:func:`flatten` returns
``None``). Torch-free: torch is reached only through the tensors given.
"""

from __future__ import annotations

import sys
from operator import attrgetter, methodcaller
from typing import Any

import numpy as np

__all__ = ["MIN_ITEMS", "NUMPY_DTYPES", "TORCH_DTYPES", "Flat", "flatten", "unflatten"]

#: Lists shorter than this are pickled as they are (nothing to gain).
MIN_ITEMS = 2
#: numpy dtype characters (native byte order) that qualify.
NUMPY_DTYPES = frozenset("?bBhHiIlLqQefd")
#: torch dtype names that qualify.
TORCH_DTYPES = frozenset(
    [
        *("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"),
        *("float16", "bfloat16", "float32", "float64"),
    ]
)
_dtype = attrgetter("dtype")
_ndim = attrgetter("ndim")
_writeable = attrgetter("flags.writeable")
_needs_grad = attrgetter("requires_grad")
_layout = attrgetter("layout")
_device = attrgetter("device.type")
_conj = methodcaller("is_conj")
_neg = methodcaller("is_neg")
_NUMPY, _TORCH = "numpy", "torch"


class Flat:
    """A qualifying list as one ``flat`` array and the ``ends`` (int64) of its
    items in it; pickles as :func:`unflatten` of them."""

    __slots__ = ("ends", "flat", "kind", "writeable")

    def __init__(self, kind: str, flat: Any, ends: Any, writeable: bool) -> None:
        self.kind = kind
        self.flat = flat
        self.ends = ends
        self.writeable = writeable

    def __len__(self) -> int:
        return len(self.ends)

    def __reduce__(self) -> Any:
        return (unflatten, (self.kind, self.flat, self.ends, self.writeable))


def _ends(items: list[Any]) -> Any:
    ends = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
    return np.cumsum(ends, out=ends)


def flatten(items: Any, min_items: int = MIN_ITEMS) -> Flat | None:
    """``items`` as a :class:`Flat` when it qualifies (see the module; at
    least ``min_items`` items), else ``None``."""
    if type(items) is not list or len(items) < max(1, min_items):
        return None
    types = set(map(type, items))
    if len(types) != 1:
        return None
    cls = types.pop()
    if cls is np.ndarray:
        return _flatten_numpy(items)
    torch = sys.modules.get("torch")
    if torch is not None and cls is torch.Tensor:
        return _flatten_torch(items, torch)
    return None


def _flatten_numpy(items: list[Any]) -> Flat | None:
    dtype = items[0].dtype
    if dtype.char not in NUMPY_DTYPES or not dtype.isnative or dtype.metadata is not None:
        return None
    try:  # casting="no": an item of another dtype or byte order raises
        flat = np.concatenate(items, dtype=dtype, casting="no")
    except (TypeError, ValueError):  # other dtypes, 0-d or mixed dimensions
        return None
    if flat.ndim != 1:
        return None
    writeable = bool(items[0].flags.writeable)
    if not all(map(_writeable, items)) if writeable else any(map(_writeable, items)):
        return None
    return Flat(_NUMPY, flat, _ends(items), writeable)


def _flatten_torch(items: list[Any], torch: Any) -> Flat | None:
    dtypes = set(map(_dtype, items))
    if len(dtypes) != 1 or set(map(_ndim, items)) != {1}:
        return None
    dtype = dtypes.pop()
    if str(dtype).removeprefix("torch.") not in TORCH_DTYPES:
        return None
    if any(map(_needs_grad, items)) or set(map(_layout, items)) != {torch.strided}:
        return None
    if set(map(_device, items)) != {"cpu"}:
        return None
    if any(map(_conj, items)) or any(map(_neg, items)):
        return None
    flat = torch.cat(items)
    return Flat(_TORCH, flat, _ends(items), True)


def unflatten(kind: str, flat: Any, ends: Any, writeable: bool) -> list[Any]:
    """The list a :class:`Flat` stands for: views of a private copy of
    ``flat`` (so no item keeps a transport buffer, such as ring memory,
    alive). Raises ``ValueError`` for a damaged one."""
    ends = np.asarray(ends)
    if ends.ndim != 1 or ends.dtype != np.int64:
        raise ValueError(f"damaged flat items: ends must be 1-D int64, got {ends.dtype}")
    if len(ends) and (ends[-1] != len(flat) or ends[0] < 0 or (ends[1:] < ends[:-1]).any()):
        raise ValueError(f"damaged flat items: ends do not split a buffer of {len(flat)}")
    bounds = ends.tolist()
    starts = [0, *bounds[:-1]]
    if kind == _NUMPY:
        own = np.array(flat, copy=True)
        if not writeable:
            own.flags.writeable = False
        return [own[a:b] for a, b in zip(starts, bounds)]
    if kind == _TORCH:
        own = flat.clone()
        return list(own.split([b - a for a, b in zip(starts, bounds)]))
    raise ValueError(f"damaged flat items: unknown kind {kind!r}")

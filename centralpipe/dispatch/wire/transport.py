"""What crosses the worker boundary: pickled messages with raw array memory.

A message is one ``pickle`` (protocol 5) in which the memory of CPU tensors
and numpy arrays is not copied into the pickle. Instead every tensor and array
refers to a *region* of a table: one region per underlying memory block
(a torch storage, or a numpy base array), covering the bytes that the
message's tensors and arrays use of it. So

- views and tensors that share memory arrive sharing memory (the region is
  sent once and each view is rebuilt on it, with its own offset, shape and
  strides), which ``pickle`` itself does not do for torch or numpy; this
  holds across kinds too: regions whose bytes overlap in memory (a tensor
  and ``tensor.numpy()``, an array and ``torch.from_numpy(array)``) are sent
  as one, so an item made in a worker arrives as it would with
  ``num_workers=0``;
- a small view of a large tensor sends only the bytes it spans;
- every dtype crosses as bytes (``bool``, ``bfloat16``, complex, structured
  numpy dtypes), 0-d and non-contiguous arrays keep their shape and strides,
  read-only numpy arrays stay read-only;
- an ndarray subclass that keeps numpy's own reduction (``np.memmap``,
  ``np.recarray``, a user's class) crosses as a plain array, memory and
  sharing included, and is viewed as its class on arrival (what numpy's
  pickle makes of it: a memmap arrives as a ``np.memmap`` over memory of its
  own); one with a reduction of its own (``np.ma.MaskedArray``) uses it, and
  arrives read-only when it was (numpy's pickles forget the flag);
- large regions (and protocol-5 ``PickleBuffer``\\ s of other libraries) travel
  out of band: :func:`dumps` returns them as separate buffers (memoryviews of
  the original memory, no copy). :func:`write` given the sender's
  shared-memory ring (:mod:`centralpipe.dispatch.wire.ringreader`: a worker's results)
  copies those of 16 KiB and more into it, unless the worker already moved
  them there as it made them (a :class:`~centralpipe.dispatch.wire.ringwriter.RingRef`
  stands for such an output), and puts only their ring offsets in the
  header; the others it writes with ``Connection.send_bytes``. :func:`recv`
  takes ring buffers as the ring lends them (no copy) or copies them out,
  and reads the others into fresh ``bytearray``\\ s; either becomes the
  memory of the received tensors and arrays.

Anything else pickles as ``pickle`` does; ``memoryview`` (which ``pickle``
refuses) arrives as a ``memoryview`` of the same format, shape and
writability. Tensors that are not plain CPU strided tensors (CUDA, sparse,
quantized, conjugate/negative views, ``requires_grad``) fall back to
torch's own reduction.

Only public APIs: ``pickle``, ``multiprocessing.connection``, torch
(``untyped_storage``, ``Tensor.set_``, ``torch.frombuffer``) and numpy.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from centralpipe.dispatch.wire import plain
from centralpipe.dispatch.wire.ringreader import Ring
from centralpipe.dispatch.wire.ringwriter import Placed, RingRef, RingWriter, plain_cpu_tensor

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is optional
    np = None  # type: ignore[assignment]

if TYPE_CHECKING:
    import torch

__all__ = [
    "Message",
    "Plain",
    "Sealed",
    "Undecodable",
    "copy",
    "dumps",
    "dumps_plain",
    "loads",
    "recv",
    "recv_counted",
    "send",
    "write",
]

#: Regions smaller than this travel inside the header (one copy beats a message).
INBAND_MAX_BYTES = 16 * 1024
#: Regions start on this boundary, so every dtype's offsets stay whole elements.
_ALIGN = 64
# header: meta length (u32), out-of-band buffer count (u32); then per buffer
# its size (u64), read-only flag (u8) and ring offset (i64; -1: the bytes
# follow on the pipe); then the meta pickle, then the body.
_HEAD = struct.Struct("<II")
_BUF = struct.Struct("<QBq")
_POS_AT = 9  # offset of the ring position in a _BUF entry
_I64 = struct.Struct("<q")
_THIS = __name__
#: In place of the meta length: a message of plain outputs (see ``dispatch.plain``),
#: whose body is a prefix length (u32), the prefix, then the table (i64 each).
_PLAIN = 0xFFFFFFFF
_U32 = struct.Struct("<I")


class Message:
    """A pickled message: ``head`` (bytes) and out-of-band ``buffers``."""

    __slots__ = ("buffers", "head")

    def __init__(self, head: bytes, buffers: list[memoryview]) -> None:
        self.head = head
        self.buffers = buffers

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(b.nbytes for b in self.buffers)


class Plain:
    """What a message made by :func:`dumps_plain` is received as: its prefix
    (bytes of the sender's own) and the outputs rebuilt on their buffers."""

    __slots__ = ("outputs", "prefix")

    def __init__(self, prefix: bytes, outputs: list[Any]) -> None:
        self.prefix = prefix
        self.outputs = outputs


class Sealed:
    """Wraps an object that is pickled as a message of its own inside the
    message: if it cannot be unpickled on the other side it arrives as an
    :class:`Undecodable`, and the rest of the message is intact."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


class Undecodable:
    """What a :class:`Sealed` object became when it could not be unpickled."""

    __slots__ = ("exc_type", "message")

    def __init__(self, exc_type: str, message: str) -> None:
        self.exc_type = exc_type
        self.message = message

    def __reduce__(self) -> Any:
        return (Undecodable, (self.exc_type, self.message))

    def __repr__(self) -> str:
        return f"Undecodable({self.exc_type}: {self.message})"


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when the exception's ``__str__`` raises."""
    try:
        return str(exc)
    except Exception as inner:
        return f"<{type(exc).__name__} whose str() raised {type(inner).__name__}>"


# -- regions -------------------------------------------------------------------


class _Region:
    """One memory block referenced by the message: the bytes ``[lo, hi)`` of
    ``source`` (a flat uint8 tensor or array over the block, starting at
    memory address ``addr``; ``None`` for a buffer already in the ring) are
    sent. ``align``: the largest element size of the tensors rebuilt on it
    (their offsets are whole elements)."""

    __slots__ = ("addr", "align", "hi", "index", "lo", "source")

    def __init__(self, index: int, source: Any, addr: int | None) -> None:
        self.index = index
        self.source = source
        self.addr = addr
        self.align = 1
        self.lo = -1
        self.hi = -1

    def cover(self, lo: int, hi: int) -> None:
        self.lo = lo if self.lo < 0 else min(self.lo, lo)
        self.hi = max(self.hi, hi)

    def __reduce__(self) -> Any:
        # Resolved by _Unpickler.find_class: the table is per message.
        return (_region, (self.index,))


def _region(index: int) -> Any:  # pragma: no cover - replaced at load time
    raise pickle.UnpicklingError("a region reference outside a centralpipe message")


def _sealed(index: int) -> Any:  # pragma: no cover - replaced at load time
    raise pickle.UnpicklingError("a sealed object outside a centralpipe message")


def _span(offset: int, shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple:
    """Byte range ``[lo, hi)`` used by an array at byte ``offset`` (non-empty)."""
    lo = hi = offset
    for n, st in zip(shape, strides):
        reach = (n - 1) * st
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + itemsize


class _Pickler(pickle.Pickler):
    # No dispatch_table of its own: copyreg's, live, with the reducers that
    # torch registers when it is imported (maybe after this module).

    def __init__(self, file: Any, buffers: list[memoryview]) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._oob)
        self.buffers = buffers
        self.regions: dict[tuple[Any, ...], _Region] = {}
        self.sealed: list[Message] = []

    def _oob(self, buf: pickle.PickleBuffer) -> None:
        self.buffers.append(buf.raw())

    def region(self, key: tuple[Any, ...], source: Any, addr: int | None) -> _Region:
        reg = self.regions.get(key)
        if reg is None:
            reg = self.regions[key] = _Region(len(self.regions), source, addr)
        return reg

    def reducer_override(self, obj: Any) -> Any:
        # Called only for objects the C pickler does not handle natively
        # (not for ints, strs, lists, ...), so plain data pays nothing.
        cls = type(obj)
        if cls is _tensor_class():
            return self._reduce_tensor(obj)
        if np is not None and cls is np.ndarray:
            return self._reduce_array(obj)
        if cls is RingRef:
            return self._reduce_ring_ref(obj)
        if cls is memoryview:
            return _reduce_memoryview(obj)
        if cls is Sealed:
            self.sealed.append(dumps(obj.obj))
            return (_sealed, (len(self.sealed) - 1,))
        if np is not None and isinstance(obj, np.ndarray):
            return self._reduce_array_subclass(obj)
        return NotImplemented

    def _reduce_tensor(self, t: torch.Tensor) -> Any:
        import torch

        if not plain_cpu_tensor(t):
            return NotImplemented  # torch's own reduction
        shape, stride = tuple(t.shape), t.stride()
        if t.numel() == 0:
            return (_empty_tensor, (t.dtype, shape, stride))
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = ("t", storage.data_ptr(), nbytes)
        reg = self.regions.get(key)
        if reg is None:
            flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
            reg = self.region(key, flat, key[1])
        size = t.element_size()
        reg.align = max(reg.align, size)
        offset = int(t.storage_offset()) * size
        reg.cover(*_span(offset, shape, [s * size for s in stride], size))
        return (_rebuild_tensor, (reg, offset, t.dtype, shape, stride))

    def _reduce_ring_ref(self, ref: RingRef) -> Any:
        reg = self.region(("r", ref.placed.offset), ref.placed, None)
        reg.cover(0, ref.placed.nbytes)
        if ref.kind == "t":
            return (_rebuild_tensor, (reg, 0, ref.dtype, ref.shape, ref.strides(1)))
        strides = ref.strides(ref.dtype.itemsize)
        return (_rebuild_array, (reg, 0, ref.dtype, ref.shape, strides, ref.writeable))

    def _reduce_array(self, a: Any) -> Any:
        if a.dtype.hasobject:
            return NotImplemented  # numpy's own reduction pickles the objects
        if a.size == 0:
            return (_empty_array, (a.dtype, a.shape, a.flags.writeable))
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        writeable = a.flags.writeable
        offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
        span = _span(offset, a.shape, a.strides, a.itemsize)
        if (root.flags.c_contiguous or root.flags.f_contiguous) and (
            span[0] >= 0 and span[1] <= root.nbytes
        ):
            key = ("n", root.__array_interface__["data"][0], root.nbytes)
            reg = self.regions.get(key)
            if reg is None:
                # As a plain ndarray: a subclass (chararray) may refuse a uint8 view.
                flat = root.view(np.ndarray).reshape(-1, order="A").view(np.uint8)
                reg = self.region(key, flat, key[1])
        else:  # memory of another layout (e.g. broadcast): this array alone, compact
            a = a if a.flags.c_contiguous or a.flags.f_contiguous else np.ascontiguousarray(a)
            addr = a.__array_interface__["data"][0]
            reg = self.region(("n", id(a)), a.reshape(-1, order="A").view(np.uint8), addr)
            offset = 0
            span = (0, a.nbytes)
        reg.cover(*span)
        return (_rebuild_array, (reg, offset, a.dtype, a.shape, a.strides, writeable))

    def _reduce_array_subclass(self, a: Any) -> Any:
        """An ndarray subclass (``np.memmap``, ``np.matrix``, a user's class).

        One that keeps numpy's own reduction (which carries only the class,
        dtype, shape and bytes) crosses as a plain array does, memory shared
        and read-only kept, and is viewed as its class on arrival. One with a
        reduction of its own uses it; then a read-only array is made
        read-only again on arrival, which numpy's pickles do not do."""
        cls = type(a)
        if (
            cls.__reduce_ex__ is np.ndarray.__reduce_ex__
            and cls.__reduce__ is np.ndarray.__reduce__
            and cls.__setstate__ is np.ndarray.__setstate__
        ):
            rv = self._reduce_array(a.view(np.ndarray))
            if rv is not NotImplemented:
                return (_as_subclass, (cls, *rv))
        if a.flags.writeable:
            return NotImplemented
        rv = a.__reduce_ex__(5)
        if not isinstance(rv, tuple) or not 2 <= len(rv) <= 3:
            return NotImplemented  # pragma: no cover - no numpy class reduces so
        return (_read_only, (rv[0], rv[1], rv[2] if len(rv) == 3 else None))


def _reduce_memoryview(m: memoryview) -> Any:
    args = (bytearray(m.tobytes()), m.format, tuple(m.shape or ()), m.readonly)
    try:
        _rebuild_memoryview(*args)
    except (TypeError, ValueError) as exc:
        msg = f"a memoryview of format {m.format!r} cannot be rebuilt on the other side: {exc}"
        raise pickle.PicklingError(msg) from None
    return (_rebuild_memoryview, args)


def _tensor_class() -> Any:
    """``torch.Tensor``, or ``None`` while torch is not imported: then no
    object can be a tensor, and a worker whose functions and items use no
    torch never imports it (see :mod:`centralpipe.dispatch.executors.preload`)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


# -- rebuilding ------------------------------------------------------------------


def _empty_tensor(dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]) -> Any:
    import torch

    return torch.empty_strided(shape, stride, dtype=dtype)


def _empty_array(dtype: Any, shape: tuple[int, ...], writeable: bool) -> Any:
    a = np.empty(shape, dtype)
    a.flags.writeable = writeable
    return a


class _Loaded:
    """A received region: its memory and the byte offset it starts at.

    Tensors rebuilt on it share one storage and arrays one base array, so
    sending them on again keeps their sharing too."""

    __slots__ = ("array", "base", "buffer", "owner", "storage_base", "tensor")

    def __init__(self, base: int, buffer: Any, owner: _Loaded | None = None) -> None:
        self.base = base
        self.buffer = buffer  # a writable bytes-like object
        self.owner = owner  # the region whose memory this one's lies in (see _merge)
        self.tensor: torch.Tensor | None = None
        self.array: Any = None
        self.storage_base = base  # the block's byte at which storage() starts

    def root(self) -> Any:
        if self.owner is not None:
            return self.owner.root()
        if self.array is None:
            self.array = np.frombuffer(self.buffer, dtype=np.uint8)
        return self.array

    def storage(self) -> Any:
        import torch

        if self.owner is not None and self.tensor is None:
            # A storage of its own where its block starts (it was one, apart
            # from the owner's), on the owner's memory; else the owner's.
            if 0 <= -self.base < len(self.buffer):
                self.tensor = torch.frombuffer(self.buffer, dtype=torch.uint8, offset=-self.base)
                self.storage_base = 0
            else:
                self.tensor = self.owner.storage_tensor()
                self.storage_base = self.base - self.owner.base + self.owner.storage_base
        if self.tensor is None:
            if len(self.buffer):
                self.tensor = torch.frombuffer(self.buffer, dtype=torch.uint8)
            else:
                self.tensor = torch.empty(0, dtype=torch.uint8)
        return self.tensor.untyped_storage()

    def storage_tensor(self) -> Any:
        self.storage()
        return self.tensor


def _rebuild_tensor(
    reg: _Loaded, offset: int, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    import torch

    storage = reg.storage()
    start = (offset - reg.storage_base) // dtype.itemsize
    return torch.empty(0, dtype=dtype).set_(storage, start, shape, stride)


def _rebuild_array(
    reg: _Loaded,
    offset: int,
    dtype: Any,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    writeable: bool,
) -> Any:
    a = np.ndarray(shape, dtype, buffer=reg.root(), offset=offset - reg.base, strides=strides)
    if not writeable:
        a.flags.writeable = False
    return a


def _as_subclass(cls: type, rebuild: Any, args: tuple[Any, ...]) -> Any:
    """The array that ``rebuild(*args)`` makes, viewed as ``cls``."""
    return rebuild(*args).view(cls)


def _read_only(rebuild: Any, args: tuple[Any, ...], state: Any) -> Any:
    """What ``pickle`` makes of the reduction ``(rebuild, args, state)``, read-only."""
    a = rebuild(*args)
    if state is not None:
        a.__setstate__(state)
    a.flags.writeable = False
    return a


def _rebuild_memoryview(data: bytearray, fmt: str, shape: tuple[int, ...], readonly: bool) -> Any:
    m: memoryview = memoryview(data)
    if fmt != "B" or len(shape) != 1:
        m = m.cast("B").cast(fmt, shape)  # type: ignore[call-overload]
    return m.toreadonly() if readonly else m


class _Unpickler(pickle.Unpickler):
    def __init__(
        self, file: Any, buffers: Sequence[Any], regions: list[_Loaded], sealed: list[Any]
    ) -> None:
        super().__init__(file, buffers=buffers)
        self.regions = regions
        self.sealed = sealed

    def find_class(self, module: str, name: str) -> Any:
        if module == _THIS and name == "_region":
            return self.regions.__getitem__
        if module == _THIS and name == "_sealed":
            return self._unseal
        return super().find_class(module, name)

    def _unseal(self, index: int) -> Any:
        head, buffers = self.sealed[index]
        try:
            return loads(head, buffers)
        except Exception as exc:
            return Undecodable(type(exc).__name__, exception_text(exc))


# -- messages --------------------------------------------------------------------


def dumps(obj: Any) -> Message:
    """Pickle ``obj``; large array memory comes back as separate buffers.

    Out-of-band buffers are, in order: ``PickleBuffer``\\ s of the body, then
    the large regions, then the buffers of each sealed object."""
    buffers: list[memoryview] = []
    out = io.BytesIO()
    pickler = _Pickler(out, buffers)
    pickler.dump(obj)
    body = out.getbuffer()
    flags = [b.readonly for b in buffers]
    if not pickler.regions and not pickler.sealed:
        meta = b""
    else:
        aliases = _merge(list(pickler.regions.values())) if len(pickler.regions) > 1 else {}
        # (base, size, in-band bytes), or (owner's index, delta) for a region
        # that lies in another's memory
        table: list[tuple[Any, ...]] = []
        for reg in pickler.regions.values():
            if reg.index in aliases:
                table.append(aliases[reg.index])
                continue
            if type(reg.source) is Placed:  # already in the ring (dispatch.stash)
                table.append((0, reg.source.nbytes, None))
                buffers.append(reg.source)  # type: ignore[arg-type]
                flags.append(False)
                continue
            base = reg.lo - reg.lo % _ALIGN
            data = reg.source[base : reg.hi]
            size = reg.hi - base
            if size < INBAND_MAX_BYTES:
                table.append((base, size, _bytes(data)))
            else:
                table.append((base, size, None))
                buffers.append(_view(data))
                flags.append(False)
        sealed = []
        for inner in pickler.sealed:
            sealed.append((inner.head, len(inner.buffers)))
            buffers.extend(inner.buffers)
            flags.extend([False] * len(inner.buffers))
        meta = pickle.dumps((table, sealed), protocol=5)
    sizes = b"".join(_BUF.pack(b.nbytes, ro, -1) for b, ro in zip(buffers, flags))
    head = _HEAD.pack(len(meta), len(buffers)) + sizes + meta + body
    return Message(head, buffers)


def dumps_plain(prefix: bytes, outputs: Any) -> Message | None:
    """A message of ``outputs`` with no pickle when they are all plain
    tensors or arrays already in the sender's ring (see
    :mod:`centralpipe.dispatch.wire.plain`), else ``None``. Sent by :func:`write`
    like any message; received as a :class:`Plain`."""
    described = plain.describe(outputs)
    if described is None:
        return None
    table, places = described
    sizes = b"".join([_BUF.pack(p.nbytes, 0, -1) for p in places])
    body = struct.pack(f"<I{len(prefix)}s{len(table)}q", len(prefix), prefix, *table)
    head = _HEAD.pack(_PLAIN, len(places)) + sizes + body
    return Message(head, places)  # type: ignore[arg-type]


def _loads_plain(body: memoryview, buffers: Sequence[Any]) -> Plain:
    try:
        (n,) = _U32.unpack_from(body, 0)
        prefix = bytes(body[4 : 4 + n])
        table = memoryview(body[4 + n :]).cast("q").tolist()
    except (struct.error, TypeError, ValueError) as exc:
        raise EOFError(f"a damaged plain message: {exc}") from None
    return Plain(prefix, plain.rebuild(table, list(buffers)))


def _merge(regions: list[_Region]) -> dict[int, tuple[int, int]]:
    """Regions whose sent bytes overlap in memory, as ``{index: (owner's
    index, delta)}``: each is sent as part of its owner, a region of the
    group whose block holds all of the group's bytes (``delta``: where the
    region's block starts in the owner's). The owner's span grows to cover
    them. A group with no such owner, or where a tensor's offset would not
    be whole elements of the owner's memory, stays as it is (copies)."""
    spans = sorted(
        ((reg.addr + reg.lo, reg.addr + reg.hi, reg) for reg in regions if reg.addr is not None),
        key=lambda span: span[0],
    )
    aliases: dict[int, tuple[int, int]] = {}
    group: list[_Region] = []
    end = -1
    for lo, hi, reg in [*spans, (-1, -1, None)]:
        if reg is not None and lo < end:
            group.append(reg)
            end = max(end, hi)
            continue
        if len(group) > 1:
            _merge_group(group, aliases)
        group, end = ([reg], hi) if reg is not None else ([], -1)
    return aliases


def _merge_group(group: list[_Region], aliases: dict[int, tuple[int, int]]) -> None:
    first = min(r.addr + r.lo for r in group)  # type: ignore[operator]
    last = max(r.addr + r.hi for r in group)  # type: ignore[operator]
    for owner in group:
        start = owner.addr
        assert start is not None
        if not (start <= first and last <= start + len(owner.source)):
            continue
        if any((r.addr - start) % r.align for r in group):  # type: ignore[operator]
            continue
        owner.cover(first - start, last - start)
        for r in group:
            if r is not owner:
                aliases[r.index] = (owner.index, r.addr - start)  # type: ignore[operator]
        return


def _view(data: Any) -> memoryview:
    tensor = _tensor_class()
    if tensor is not None and isinstance(data, tensor):
        data = data.numpy()
    return memoryview(data).cast("B")


def _bytes(data: Any) -> bytes:
    return _view(data).tobytes()


def _parse(head: Any) -> tuple[memoryview, list[tuple[int, bool, int]], int]:
    view = memoryview(head)
    _, count = _HEAD.unpack_from(view, 0)
    pos = _HEAD.size + count * _BUF.size
    try:
        sizes = [
            (size, bool(ro), where) for size, ro, where in _BUF.iter_unpack(view[_HEAD.size : pos])
        ]
    except struct.error as exc:
        raise EOFError(f"a damaged message header: {exc}") from None
    return view, sizes, pos


def buffer_sizes(head: Any) -> list[int]:
    """Sizes of the out-of-band buffers that follow ``head``."""
    return [size for size, _, _ in _parse(head)[1]]


def loads(head: Any, buffers: Sequence[Any]) -> Any:
    """Inverse of :func:`dumps`; ``buffers`` are writable (e.g. ``bytearray``)
    and become the memory of the objects rebuilt on them."""
    view, sizes, pos = _parse(head)
    meta_len = _HEAD.unpack_from(view, 0)[0]
    if meta_len == _PLAIN:
        return _loads_plain(view[pos:], buffers)
    regions: list[_Loaded] = []
    sealed: list[tuple[bytes, list[Any]]] = []
    n_pickle = len(sizes)
    if meta_len:
        table, sealed_table = pickle.loads(view[pos : pos + meta_len])
        n_pickle -= sum(1 for entry in table if len(entry) == 3 and entry[2] is None)
        n_pickle -= sum(n for _, n in sealed_table)
        k = n_pickle
        for entry in table:
            if len(entry) == 2:  # in another region's memory: filled in below
                regions.append(None)  # type: ignore[arg-type]
            elif entry[2] is None:
                regions.append(_Loaded(entry[0], buffers[k]))
                k += 1
            else:
                regions.append(_Loaded(entry[0], bytearray(entry[2])))
        for i, entry in enumerate(table):
            if len(entry) == 2:
                owner = regions[entry[0]]
                regions[i] = _Loaded(owner.base - entry[1], owner.buffer, owner)
        for inner_head, n in sealed_table:
            sealed.append((inner_head, list(buffers[k : k + n])))
            k += n
    oob = [
        memoryview(b).toreadonly() if ro else b
        for b, (_, ro, _) in zip(buffers[:n_pickle], sizes[:n_pickle])
    ]
    body = io.BytesIO(view[pos + meta_len :])
    return _Unpickler(body, oob, regions, sealed).load()


def copy(obj: Any) -> Any:
    """``obj`` as the other side of the boundary would receive it."""
    msg = dumps(obj)
    return loads(msg.head, [bytearray(b) for b in msg.buffers])


def write(conn: Connection, msg: Message, ring: RingWriter | None = None) -> None:
    """Send a message built by :func:`dumps`; with a ``ring``, large buffers
    are written into it and only their ring offsets go on the pipe."""
    head: Any = msg.head
    on_pipe = msg.buffers
    if ring is not None and msg.buffers:
        on_pipe = []
        patched = None
        at = _HEAD.size + _POS_AT
        for buf in msg.buffers:
            if type(buf) is Placed:
                where = buf.offset
                ring.sent(where)
            else:
                where = ring.place(buf)
            if where < 0:
                on_pipe.append(buf)
            else:
                if patched is None:
                    patched = bytearray(head)
                _I64.pack_into(patched, at, where)
            at += _BUF.size
        if patched is not None:
            head = patched
    conn.send_bytes(head)
    for buf in on_pipe:
        conn.send_bytes(buf)


def send(conn: Connection, obj: Any, ring: RingWriter | None = None) -> None:
    """Send one message: the header, then each out-of-band buffer."""
    write(conn, dumps(obj), ring)


def recv(conn: Connection, ring: Ring | None = None) -> Any:
    """Receive one message sent by :func:`send` (with ``ring``: the main
    process's side of the sender's ring).

    Every byte of the message is read (and taken from the ring) before
    anything is unpickled, so an object that fails to unpickle (raised as
    is) leaves the pipe in step; its lent ring buffers are released when it
    is dropped."""
    return recv_counted(conn, ring)[0]


def recv_counted(conn: Connection, ring: Ring | None = None) -> tuple[Any, int]:
    """:func:`recv`, and the bytes the message takes in this process (header
    and buffers, from the ring or the pipe)."""
    head = conn.recv_bytes()
    buffers: list[Any] = []
    nbytes = len(head)
    at: list[int] = []  # indexes of the buffers in the ring, taken together
    spans: list[tuple[int, int]] = []
    for size, _, where in _parse(head)[1]:
        nbytes += size
        if where >= 0:
            at.append(len(buffers))
            spans.append((where, size))
            buffers.append(None)
            continue
        buf = bytearray(size)
        if size:
            conn.recv_bytes_into(buf)
        else:
            conn.recv_bytes()
        buffers.append(buf)
        if ring is not None:
            ring.pipe_bytes += size
    if spans:
        if ring is None:
            raise EOFError("a message refers to a shared-memory ring this pipe does not have")
        for k, buf in zip(at, ring.take_many(spans)):  # lent, or copied and released
            buffers[k] = buf
    if ring is not None:
        ring.flush()  # the releases of buffers copied out
    return loads(head, buffers), nbytes

"""Every picklable item crosses the worker boundary unchanged, both ways.

``describe`` turns an item into a plain structure that states everything a
user can observe: types, values (as bytes, so NaNs compare), dtypes, shapes,
strides, writability, object identity, which tensors share a storage and
which arrays and tensors overlap in memory (with their relative addresses).
The property: ``describe`` of the original, of what a worker stage received,
and of what the consumer got back are equal, for 0 and 2 workers.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import centralpipe as cp
from centralpipe.dispatch.wire import protocol, transport
from tests.support.configs import loader_config

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Record:
    name: str
    payload: Any


class Reduced:
    """An object with its own ``__reduce__`` holding array data."""

    def __init__(self, tag: str, data: Any) -> None:
        self.tag = tag
        self.data = data

    def __reduce__(self) -> Any:
        return (Reduced, (self.tag, self.data))


# -- describe --------------------------------------------------------------------


def _bytes_of_tensor(t: torch.Tensor) -> bytes:
    """The bytes of ``t``'s elements in C order, read through its strides (no
    torch op: some dtypes, e.g. float8 and bits, have no ``copy_``)."""
    size = t.element_size()
    if not t.numel():
        return b""
    memory = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
    elements = np.lib.stride_tricks.as_strided(
        memory[t.storage_offset() * size :],
        shape=(*t.shape, size),
        strides=(*(s * size for s in t.stride()), 1),
    )
    return elements.tobytes()


def _span(addr: int, shape: Any, strides: Any, itemsize: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` an array spans (empty for no elements)."""
    lo = hi = addr
    for n, s in zip(shape, strides):
        if n == 0:
            return addr, addr
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + itemsize


def describe(obj: Any) -> Any:
    """The observable structure of ``obj`` (see the module docstring)."""
    seen: dict[int, int] = {}
    memory: list[tuple[str, int, int, int, int]] = []  # kind, index, lo, hi, storage

    def walk(x: Any) -> Any:
        if isinstance(x, (int, float, str, type(None), bool, bytes)):
            return (type(x).__name__, x)
        key = id(x)
        if key in seen:
            return ("same-as", seen[key])
        seen[key] = len(seen)
        ident = seen[key]
        if isinstance(x, torch.Tensor):
            size = x.element_size()
            lo, hi = _span(x.data_ptr(), x.shape, [s * size for s in x.stride()], size)
            storage = x.untyped_storage().data_ptr() if x.numel() else -1
            memory.append(("t", ident, lo, hi, storage))
            return ("tensor", ident, str(x.dtype), tuple(x.shape), x.stride(), _bytes_of_tensor(x))
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                return ("ndarray-obj", ident, x.shape, [walk(v) for v in x.ravel().tolist()])
            addr = x.__array_interface__["data"][0]
            lo, hi = _span(addr, x.shape, x.strides, x.itemsize)
            if x.size:
                memory.append(("n", ident, lo, hi, -1))
            return (
                "ndarray",
                ident,
                x.dtype.str,
                str(x.dtype),
                x.shape,
                x.strides if x.size else None,  # an empty array's strides do not matter
                x.flags.writeable,
                np.ascontiguousarray(x).tobytes(),
            )
        if isinstance(x, np.generic):
            return ("npscalar", str(x.dtype), x.tobytes())
        if isinstance(x, bytearray):
            return ("bytearray", ident, bytes(x))
        if isinstance(x, memoryview):
            return ("memoryview", ident, x.format, x.shape, x.readonly, x.tobytes())
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return (type(x).__name__, ident, [walk(v) for v in x])
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, ident, [walk(v) for v in x])
        if isinstance(x, dict):
            return ("dict", ident, [(walk(k), walk(v)) for k, v in x.items()])
        if dataclasses.is_dataclass(x):
            fields = [(f.name, walk(getattr(x, f.name))) for f in dataclasses.fields(x)]
            return (type(x).__name__, ident, fields)
        if isinstance(x, Reduced):
            return ("Reduced", ident, x.tag, walk(x.data))
        raise TypeError(f"describe() does not know {type(x).__name__}")

    tree = walk(obj)
    # Observable sharing: tensors on one storage, and overlapping memory
    # (written through one, seen through the other) with relative addresses.
    shared = []
    for i, (ka, ia, loa, hia, sa) in enumerate(memory):
        for kb, ib, lob, hib, sb in memory[i + 1 :]:
            same_storage = ka == kb == "t" and sa == sb and sa != -1
            overlap = loa < hib and lob < hia
            if same_storage or overlap:
                shared.append((ia, ib, same_storage, overlap, loa - lob))
    return tree, sorted(shared)


# -- strategies ------------------------------------------------------------------

TENSOR_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.complex32,
    # Dtypes that plain ``pickle`` refuses in torch 2.13 (no typed storage):
    # their bytes still cross.
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
    torch.bits8,
    torch.bits16,
]
ARRAY_DTYPES = [
    np.dtype(np.bool_),
    np.dtype(np.int8),
    np.dtype(np.uint8),
    np.dtype(np.int16),
    np.dtype(np.uint16),
    np.dtype(">i4"),
    np.dtype(np.uint32),
    np.dtype(np.int64),
    np.dtype(np.uint64),
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(">f8"),
    np.dtype(np.longdouble),
    np.dtype(np.complex64),
    np.dtype(np.complex128),
    np.dtype("M8[ns]"),
    np.dtype("m8[s]"),
    np.dtype("S3"),
    np.dtype("U2"),
    np.dtype("V3"),
    np.dtype([("a", "<i4"), ("b", "f8"), ("c", "S2")]),
    np.dtype([("a", "<i4", (2,)), ("b", [("c", "u1"), ("d", ">f4")])]),
]


def _random_bytes(seed: int, n: int) -> bytearray:
    g = torch.Generator().manual_seed(seed)
    return bytearray(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes())


def _as_numpy(t: torch.Tensor) -> Any:
    """``t.numpy()`` (the same memory), or ``None`` for dtypes numpy lacks."""
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        return None


def _as_tensor(a: Any) -> Any:
    """``torch.from_numpy(a)`` (the same memory), or ``None`` where torch
    cannot take it (dtype, byte order, negative strides)."""
    try:
        return torch.from_numpy(a)
    except (TypeError, ValueError, RuntimeError):
        return None


@st.composite
def tensor_family(draw: st.DrawFn) -> list[Any]:
    """A base tensor and some views of it (sharing its storage)."""
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    rows = draw(st.integers(0, 6))
    cols = draw(st.sampled_from([0, 1, 3, 8, 3000]))  # 3000 columns: out of band
    raw = _random_bytes(draw(st.integers(0, 2**31)), rows * cols * dtype.itemsize)
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if dtype is torch.bool:
        flat = flat % 2
    base = flat.view(dtype).reshape(rows, cols)
    views = [base]
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["slice", "t", "row", "scalar", "col", "clone", "numpy"]))
        if kind == "slice" and rows:
            a = draw(st.integers(0, rows - 1))
            views.append(base[a : draw(st.integers(a, rows)) : draw(st.integers(1, 3))])
        elif kind == "t":
            views.append(base.t())
        elif kind == "row" and rows:
            views.append(base[draw(st.integers(0, rows - 1))])
        elif kind == "scalar" and rows and cols:
            views.append(base[rows - 1, cols - 1])
        elif kind == "col" and cols:
            views.append(base[:, draw(st.integers(0, cols - 1))])
        elif kind == "clone":
            views.append(base.clone())
        elif kind == "numpy" and _as_numpy(base) is not None:
            views.append(_as_numpy(base))
    if draw(st.booleans()) and len(views) > 1:
        views = views[1:]  # views without their base: only their bytes travel
    return views


@st.composite
def array_family(draw: st.DrawFn) -> list[Any]:
    """A base numpy array and some views of it."""
    dtype = draw(st.sampled_from(ARRAY_DTYPES))
    # (64, 300): out of band, and into the ring for any dtype
    shape = draw(st.sampled_from([(), (0,), (5,), (3, 4), (2, 3, 2), (40, 100), (64, 300)]))
    n = int(np.prod(shape)) * dtype.itemsize
    raw = _random_bytes(draw(st.integers(0, 2**31)), n)
    if dtype == np.bool_:
        raw = bytearray(b % 2 for b in raw)
    if dtype.kind == "U":
        raw = bytearray(np.array(["ab"] * (n // dtype.itemsize), dtype=dtype).tobytes())
    if dtype.kind == "f" or dtype.kind == "c" or dtype.fields:
        raw = bytearray(np.ones(int(np.prod(shape)), dtype=dtype).tobytes()) if n else raw
    base = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if draw(st.booleans()):
        base = base.copy()  # owns its memory
    views = [base]
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(
            st.sampled_from(["step", "T", "first", "readonly", "fortran", "frozen", "torch"])
        )
        if kind == "step" and base.ndim:
            views.append(base[:: draw(st.sampled_from([-1, 2, 3]))])
        elif kind == "T":
            views.append(base.T)
        elif kind == "first" and base.ndim and base.shape[0]:
            views.append(base[0])
        elif kind == "readonly":
            ro = base.view()
            ro.flags.writeable = False
            views.append(ro)
        elif kind == "fortran":
            views.append(np.asfortranarray(base))
        elif kind == "torch" and _as_tensor(base) is not None:
            views.append(_as_tensor(base))
        elif kind == "frozen":  # read-only memory of its own
            frozen = base.copy()
            frozen.flags.writeable = False
            views.append(frozen)
    return views


leaves = st.one_of(
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=5),
    st.none(),
    st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray),
    st.binary(max_size=8).map(memoryview),
    st.binary(min_size=8, max_size=8).map(lambda b: memoryview(bytearray(b)).cast("i")),
    st.builds(np.float32, st.floats(width=32, allow_nan=False)),
    st.builds(lambda xs: np.array(xs, dtype=object), st.lists(st.integers(), max_size=3)),
    tensor_family().map(tuple),
    array_family().map(tuple),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), children, max_size=3),
        st.builds(Point, children, children),
        st.builds(Record, st.text(max_size=3), children),
        st.builds(Reduced, st.text(max_size=3), children),
    )


@st.composite
def items(draw: st.DrawFn) -> Any:
    """An item: a bare tensor or array (what stages most often return), or a
    nested structure, sometimes holding the same object twice."""
    if draw(st.integers(0, 3)) == 0:
        family = draw(st.one_of(tensor_family(), array_family()))
        return family[draw(st.integers(0, len(family) - 1))]
    item = draw(st.recursive(leaves, _containers, max_leaves=6))
    if draw(st.booleans()):
        item = [item, item]
    return item


# -- the property ----------------------------------------------------------------


def _fresh(x: Any) -> Any:
    """A new tensor or array with ``x``'s values (``None`` for anything else),
    as a stage computes one: memory of its own in the same layout, with the
    same writability."""
    if isinstance(x, torch.Tensor):
        try:
            return x.clone()
        except NotImplementedError:  # no copy_ for a strided view of some dtypes
            return None
    if isinstance(x, np.ndarray):
        out = x.copy(order="K")  # the same layout: C, Fortran or transposed
        out.flags.writeable = x.flags.writeable
        return out
    return None


def _seen_item_fresh(item: Any) -> list[Any]:
    """Worker stage: what the worker received (described), the item itself
    and a fresh copy of it, as three outputs. A bare tensor or array output
    that owns its memory is moved into the worker's ring as it is made
    (``dispatch.stash``); anything else is sent with the chunk's message."""
    return [describe(item), item, _fresh(item)]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@given(st.lists(items(), min_size=1, max_size=3))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_copy_keeps_everything_observable(batch: list[Any]) -> None:
    """transport.copy rebuilds values, dtypes, shapes, strides, identity and sharing,
    also for what it rebuilt (an item sent to a worker and back)."""
    once = transport.copy(batch)
    assert describe(once) == describe(batch)
    assert describe(transport.copy(once)) == describe(batch)


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@given(batch=st.lists(items(), min_size=1, max_size=4))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_items_cross_unchanged_for_any_num_workers(batch: list[Any]) -> None:
    """Items reach the worker stages and come back unchanged with 0 and 2
    workers: as received, as returned, and fresh results made from them."""
    expected = [describe(item) for item in batch]
    fresh = [describe(_fresh(item)) for item in batch]
    pipe = cp.Pipeline.from_iterable(batch).dispatch().flat_map(_seen_item_fresh)
    for num_workers in (0, 2):
        with cp.Loader(pipe, loader_config(num_workers=num_workers, chunk_size=2)) as loader:
            got = list(loader)
        assert len(got) == 3 * len(batch)
        assert got[0::3] == expected, "as received by the worker stage"
        assert [describe(back) for back in got[1::3]] == expected, "as delivered"
        assert [describe(new) for new in got[2::3]] == fresh, "made by the worker stage"


# -- cases worth naming ------------------------------------------------------------


def _every_kind() -> list[Any]:
    """One item per listed kind, each large enough for the rings: for every
    tensor dtype a base with its views (sharing its storage), a transpose, a
    clone and a bare base; for every array dtype a base that owns its memory,
    a strided view, a transpose, a read-only view, an array read-only in
    memory of its own, a Fortran-ordered copy and a 0-d array; and tensors
    and arrays over the same memory (``numpy()``, ``from_numpy``)."""
    out: list[Any] = []
    for k, dtype in enumerate(TENSOR_DTYPES):
        flat = torch.frombuffer(_random_bytes(k, 6 * 3000 * dtype.itemsize), dtype=torch.uint8)
        base = (flat % 2 if dtype is torch.bool else flat).view(dtype).reshape(6, 3000)
        out += [base, (base, base[1], base[::2], base[:, 7]), base.t(), base.clone()]
        if _as_numpy(base) is not None:  # the same memory as a tensor and an array
            out.append({"t": base, "a": _as_numpy(base[2:]), "row": _as_numpy(base[1])})
    for k, dt in enumerate(ARRAY_DTYPES):
        base = np.zeros((64, 300), dtype=dt)
        base.reshape(-1).view(np.uint8)[:] = np.frombuffer(_random_bytes(k, base.nbytes), np.uint8)
        if dt.kind in "bfc" or dt.fields:  # no NaN payloads or invalid bools
            base[...] = np.ones((), dtype=dt)
        frozen = base.copy()
        frozen.flags.writeable = False
        readonly = base.view()
        readonly.flags.writeable = False
        out += [base, (base, base[::-2], base[3]), base.T, readonly, frozen]
        out += [np.asfortranarray(base), base[0, 0].copy(), np.array(base[0, 0])]
        if _as_tensor(base) is not None:
            out.append([_as_tensor(base[5:]), base, _as_tensor(base.T)])
    return out


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_every_dtype_and_layout_crosses_both_ways(num_workers: int) -> None:
    """Every listed tensor and array dtype and layout, bare or with views of
    its memory: what the worker received, what it returned and a fresh copy
    it made are the originals as ``describe`` sees them (the copies through
    the worker's ring)."""
    batch = _every_kind()
    pipe = cp.Pipeline.from_iterable(batch).dispatch().flat_map(_seen_item_fresh)
    with cp.Loader(pipe, loader_config(num_workers=num_workers, chunk_size=3)) as loader:
        got = list(loader)
        moved = loader.metrics()["dispatch"].get("transport", {})
    assert len(got) == 3 * len(batch)
    for i, item in enumerate(batch):
        assert got[3 * i] == describe(item), f"item {i} as received by the worker stage"
        assert describe(got[3 * i + 1]) == describe(item), f"item {i} as delivered"
        assert describe(got[3 * i + 2]) == describe(_fresh(item)), f"item {i} made by the stage"
    if num_workers:
        assert moved["shared_memory_bytes"] > 0  # the large buffers took the rings


def _numpy_full(x: int) -> Any:
    return np.full(4, x, dtype=np.float32)


def _add_one(a: Any) -> Any:
    return a + 1


@pytest.mark.parametrize("num_workers", [0, 1], ids=["inline", "1-worker"])
def test_numpy_results_and_inputs_cross(num_workers: int) -> None:
    """A numpy result comes back and a numpy input reaches the worker (issue: TypeError)."""
    to_worker = cp.Pipeline.from_iterable([np.arange(3) * i for i in range(5)])
    from_worker = cp.Pipeline.from_iterable(range(5)).dispatch().map(_numpy_full)
    config = loader_config(num_workers=num_workers)
    with cp.Loader(from_worker, config) as loader:
        out = list(loader)
    assert all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in out)
    assert [a.tolist() for a in out] == [[float(i)] * 4 for i in range(5)]
    with cp.Loader(to_worker.dispatch().map(_add_one), config) as loader:
        assert [a.tolist() for a in loader] == [(np.arange(3) * i + 1).tolist() for i in range(5)]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("chunk_size", [1, 4], ids=["chunk-1", "chunk-4"])
@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_fresh_tensors_and_arrays_cross_as_plain_results(num_workers: int, chunk_size: int) -> None:
    """Chunks whose every output is a fresh tensor or array (moved into the
    ring as made, and sent as a table of integers when its dtype allows,
    else pickled): each arrives as the stage made it, for every dtype and
    layout, read-only arrays included."""
    batch = [x for x in _every_kind() if isinstance(x, (torch.Tensor, np.ndarray))]
    pipe = cp.Pipeline.from_iterable(batch).dispatch().map(_fresh)
    with cp.Loader(pipe, loader_config(num_workers=num_workers, chunk_size=chunk_size)) as loader:
        got = list(loader)
    assert len(got) == len(batch)
    for i, (item, out) in enumerate(zip(batch, got)):
        assert describe(out) == describe(_fresh(item)), f"item {i}"


def test_issue_lambda_numpy_full_with_one_worker() -> None:
    """The report's pipeline, ``.map(lambda x: np.full(4, x))`` with
    ``num_workers=1``, delivers what ``num_workers=0`` does (it raised
    ``TypeError: a bytes-like object is required, not 'Tensor'``)."""
    pipe = cp.Pipeline.from_iterable(range(6)).dispatch().map(lambda x: np.full(4, x))
    runs = []
    for num_workers in (0, 1):
        with cp.Loader(pipe, loader_config(num_workers=num_workers)) as loader:
            runs.append(list(loader))
            assert loader.metrics()["dispatch"]["restarts"] == 0
    inline, one = runs
    assert [describe(a) for a in one] == [describe(a) for a in inline]
    assert [a.tolist() for a in one] == [[i] * 4 for i in range(6)]
    assert all(type(a) is np.ndarray and a.dtype == np.full(4, 0).dtype for a in one)


def test_issue_numpy_array_sent_to_a_worker() -> None:
    """Numpy arrays sent to a worker reach its stage (they killed the worker,
    reported as a poison item): no restart, nothing skipped, exact values."""
    arrays = [np.arange(12, dtype=dt).reshape(3, 4) for dt in ("i8", "f4", "u1", ">f8")]
    arrays += [np.zeros(0), np.array(7.5), np.arange(10)[::3], np.ones((300, 300))]
    pipe = cp.Pipeline.from_iterable(arrays).dispatch().map(lambda a: (a.dtype.str, a * 2))
    with cp.Loader(pipe, loader_config(num_workers=1)) as loader:
        out = list(loader)
        dispatch = loader.metrics()["dispatch"]
    assert dispatch["restarts"] == 0 and dispatch["skipped"] == 0
    assert [dt for dt, _ in out] == [a.dtype.str for a in arrays]
    for (_, got), a in zip(out, arrays):
        assert got.dtype == (a * 2).dtype and np.array_equal(got, a * 2)


def _tensor_and_its_arrays(i: int) -> dict[str, Any]:
    """A result made in the worker: an array, a tensor on its memory, and an
    array on part of that tensor's memory."""
    a = np.full((100, 100), float(i), dtype=np.float32)
    t = torch.from_numpy(a)
    return {"a": a, "t": t, "row": t[1].numpy()}


@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "2-workers"])
def test_tensor_and_array_on_one_memory_stay_one_memory(num_workers: int) -> None:
    """A result holding a tensor and an array over the same memory arrives
    so, as with ``num_workers=0``: a write through one is seen through the
    others (with workers they came back as independent copies)."""
    pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map(_tensor_and_its_arrays)
    with cp.Loader(pipe, loader_config(num_workers=num_workers)) as loader:
        out = list(loader)
    for i, d in enumerate(out):
        assert describe(d) == describe(_tensor_and_its_arrays(i))
        d["t"][1, 3] = -1.0
        assert d["a"][1, 3] == -1.0 and d["row"][3] == -1.0


def test_view_of_large_tensor_sends_only_its_bytes() -> None:
    """A small view of a large tensor costs its own bytes, not the whole storage."""
    big = torch.zeros(1_000_000)
    msg = transport.dumps(big[10:20])
    assert msg.nbytes < 1024
    assert torch.equal(transport.copy(big[10:20]), big[10:20])


def test_large_tensor_memory_is_out_of_band_and_writable() -> None:
    """256 KiB of tensor memory is one out-of-band buffer; the copy is writable."""
    t = torch.arange(65536, dtype=torch.float32)
    msg = transport.dumps({"x": t})
    assert [b.nbytes for b in msg.buffers] == [t.numel() * 4]
    assert len(msg.head) < 512
    back = transport.copy({"x": t})["x"]
    back += 1
    assert torch.equal(back, t + 1)


def test_tensors_torch_reduces_itself_still_cross() -> None:
    """requires_grad, conjugate and sparse tensors take torch's own reduction."""
    grad = torch.ones(3, requires_grad=True)
    conj = torch.tensor([1 + 2j]).conj()
    sparse = torch.eye(3).to_sparse()
    g, c, s = transport.copy([grad, conj, sparse])
    assert g.requires_grad and torch.equal(g.detach(), grad.detach())
    assert c.is_conj() and torch.equal(c, conj)
    assert torch.equal(s.to_dense(), torch.eye(3))


def test_broadcast_array_keeps_values() -> None:
    """An array with zero strides arrives with the same values and shape (compact)."""
    a = np.broadcast_to(np.arange(3), (4, 3))
    back = transport.copy(a)
    assert back.shape == (4, 3) and (back == a).all()


def test_memoryview_of_unsupported_format_is_a_pickling_error() -> None:
    """A memoryview that cannot be rebuilt is refused when sent, not when received."""
    arr = np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])
    with pytest.raises(pickle.PicklingError, match="memoryview"):
        transport.dumps(memoryview(arr))


def test_unpicklable_object_raises_on_dumps() -> None:
    """Objects pickle refuses are refused the same way."""
    with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
        transport.dumps(lambda: 0)


# -- ndarray subclasses and read-only memory --------------------------------------


class Tagged(np.ndarray):
    """A user's ndarray subclass that keeps numpy's own reduction."""


def _array_kind(path: str, kind: str) -> Any:
    """A worker-made array of ``kind``, over the float32 file at ``path`` where it maps one."""
    if kind in ("memmap-r", "memmap-r+", "memmap-c"):
        return np.memmap(path, dtype=np.float32, mode=kind.split("-", 1)[1])
    if kind == "memmap-slice":
        return np.memmap(path, dtype=np.float32, mode="r")[100:110]
    if kind == "asarray-of-memmap":  # a plain ndarray over read-only mapped memory
        return np.asarray(np.memmap(path, dtype=np.float32, mode="r"))
    if kind == "memmap-in-dict":
        m = np.memmap(path, dtype=np.float32, mode="r")
        return {"head": m[:8], "all": m}
    if kind in ("chararray", "asarray-of-chararray"):  # refuses a view of another dtype
        chars = np.char.array(["ab", "cd", "ef"])
        chars.flags.writeable = False
        return chars if kind == "chararray" else np.asarray(chars)[1:]
    made = np.arange(8192, dtype=np.float32)  # 32 KiB of memory of its own: the plain path
    if kind == "subclass":
        made = made.view(Tagged)
    elif kind == "masked":  # a subclass with a reduction of its own
        made = np.ma.masked_less(made, 3.0)
    elif kind == "view":
        made = made[::2]
    if kind.startswith("ro-") or kind in ("subclass", "masked", "view"):
        made.flags.writeable = False
    return made


def _observed(x: Any) -> Any:
    """What a user sees of an array result: class, writability, dtype, shape, values."""
    if isinstance(x, dict):
        return {k: _observed(v) for k, v in x.items()}
    return (type(x).__name__, x.flags.writeable, x.dtype.str, x.shape, np.asarray(x).tobytes())


ARRAY_KINDS = [
    "memmap-r",
    "memmap-r+",
    "memmap-c",
    "memmap-slice",
    "asarray-of-memmap",
    "memmap-in-dict",
    "ro-own",
    "subclass",
    "chararray",
    "asarray-of-chararray",
    "masked",
    "view",
]


@pytest.mark.parametrize("kind", ARRAY_KINDS, ids=ARRAY_KINDS)
def test_array_results_keep_class_and_writability_through_workers(
    kind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only ``np.memmap`` (whole, sliced, or under a plain view), a
    read-only subclass (numpy's reduction or its own) and a read-only view made
    in a worker arrive as with ``num_workers=0``: same class, read-only, same
    values; writable memmaps stay writable. A read-only array owning its memory
    takes the plain table path, the others the pickled one."""
    path = str(tmp_path / "x.f32")
    np.arange(50_000, dtype=np.float32).tofile(path)  # 200 KiB: through the ring
    tables = []
    rebuild = transport.plain.rebuild

    def spy(table: list[int], buffers: list[Any]) -> list[Any]:
        tables.append(table)
        return rebuild(table, buffers)

    monkeypatch.setattr(transport.plain, "rebuild", spy)
    pipe = cp.Pipeline.from_iterable(range(3)).dispatch().map(lambda _: _array_kind(path, kind))
    got = {}
    for n in (0, 2):
        with cp.Loader(pipe, loader_config(num_workers=n, chunk_size=1)) as loader:
            items = list(loader)
        got[n] = [_observed(x) for x in items]
        if kind == "memmap-in-dict":  # a view and its base arrive on one memory
            assert all(np.shares_memory(x["head"], x["all"]) for x in items)
    assert got[2] == got[0] == [_observed(_array_kind(path, kind))] * 3
    assert bool(tables) == (kind == "ro-own")


_INT_LISTS = [
    [[1, 2, 3], [4], []],
    [[[1, 2], [3]], [[4, 5, 6]], []],
    [[], []],
]


@pytest.mark.parametrize("items", _INT_LISTS, ids=["token-lists", "buckets", "empty"])
def test_copy_items_of_int_lists_is_a_structural_copy(items: list[Any]) -> None:
    """Token lists and buckets of them are copied without pickling: equal
    to the pickle round trip, and no list is shared with the input."""
    copied = protocol.copy_items(items)
    assert copied == transport.copy(items) == items
    originals = {id(x) for x in items} | {id(y) for x in items for y in x if type(y) is list}
    made = {id(x) for x in copied} | {id(y) for x in copied for y in x if type(y) is list}
    assert not originals & made


def test_copy_items_keeps_what_only_pickle_keeps() -> None:
    """A list met twice stays one list, and bools and numpy ints keep their
    type: those go through the pickle round trip."""
    shared = [1, 2]
    copied = protocol.copy_items([[shared, shared]])
    assert copied == [[[1, 2], [1, 2]]] and copied[0][0] is copied[0][1]
    flags = protocol.copy_items([[True, False]])
    assert type(flags[0][0]) is bool
    ids = protocol.copy_items([[np.int64(3)]])
    assert type(ids[0][0]) is np.int64

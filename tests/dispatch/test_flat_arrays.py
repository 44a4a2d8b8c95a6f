"""Token data crosses as one flat buffer plus offsets: same items, same types, same resume."""

from __future__ import annotations

import pickle
import zlib
from typing import Any

import numpy as np
import pytest
import torch

import centralpipe as cp
from centralpipe.dispatch.wire import protocol, tokens, transport
from centralpipe.testing import assert_resumes_exactly

VOCAB = 1000


def _np_tok(line: str) -> np.ndarray:
    return np.array([zlib.crc32(w.encode()) % VOCAB for w in line.split()], dtype=np.int32)


def _torch_tok(line: str) -> torch.Tensor:
    return torch.tensor([zlib.crc32(w.encode()) % VOCAB for w in line.split()], dtype=torch.int16)


def _list_tok(line: str) -> list[int]:
    return [zlib.crc32(w.encode()) % VOCAB for w in line.split()]


def _describe(group: list[Any]) -> tuple[Any, ...]:
    """What a worker stage saw: each item's type, dtype, writability and values."""
    out = []
    for x in group:
        writeable = x.flags.writeable if isinstance(x, np.ndarray) else None
        out.append((type(x).__name__, str(getattr(x, "dtype", "")), writeable, list(x)))
    return tuple(out)


def _lines(n: int) -> list[str]:
    return [" ".join(f"w{i * j % 97}" for j in range(i % 9)) for i in range(n)]


def _pipe(tok: Any, n: int = 60) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(_lines(n))
        .map(tok, parallel=True, name="tok")
        .bucket_by_max_tokens(12, buffer_size=10, name="bucket")
        .count("pre_shard", weight_fn=len)
        .dispatch()
        .map(_describe)
    )


def _cfg(workers: int, executor: str = "process", flat: bool = True) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers,
            executor=executor,
            start_method="fork",
            chunk_size=4,
            buffer_size=16,
            flat_arrays=flat,
        ),
    )


def _run(pipe: cp.Pipeline, cfg: cp.LoaderConfig) -> list[Any]:
    with cp.Loader(pipe, cfg) as loader:
        return list(loader)


def _expected(tok: Any, n: int = 60) -> list[Any]:
    """The batches computed without centralpipe's boundary at all."""
    toks = [tok(x) for x in _lines(n)]
    pipe = cp.Pipeline.from_iterable(range(len(toks))).map(toks.__getitem__)
    pipe = pipe.bucket_by_max_tokens(12, buffer_size=10).map(_describe)
    return _run(pipe, cp.LoaderConfig())


TOKS = [
    pytest.param(_np_tok, id="numpy-int32"),
    pytest.param(_torch_tok, id="torch-int16"),
    pytest.param(_list_tok, id="lists"),
]
CONFIGS = [
    pytest.param(w, ex, flat, id=f"{w}w-{ex}-{'flat' if flat else 'pickled'}")
    for w, ex in [(0, "process"), (1, "process"), (2, "process"), (3, "process"), (2, "thread")]
    for flat in (True, False)
]


@pytest.mark.parametrize("tok", TOKS)
@pytest.mark.parametrize(("workers", "executor", "flat"), CONFIGS)
def test_same_items_and_types_everywhere(tok: Any, workers: int, executor: str, flat: bool) -> None:
    """Every worker count, executor and flat on/off give the batches of a plain loop, types kept."""
    assert _run(_pipe(tok), _cfg(workers, executor, flat)) == _expected(tok)


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param((2, "process", True), (0, "process", True), id="2w-flat-to-inline"),
        pytest.param((0, "process", True), (3, "process", False), id="inline-to-3w-pickled"),
        pytest.param((2, "thread", False), (2, "process", True), id="thread-to-process"),
    ],
)
def test_resumes_exactly_at_every_k(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    """A checkpoint at every k resumes exactly, whichever path each side took."""
    full = assert_resumes_exactly(_pipe(_np_tok, 30), _cfg(*before), resume_config=_cfg(*after))
    assert full == _expected(_np_tok, 30)


def _crossed(outputs: list[Any]) -> list[Any]:
    """``outputs`` as a worker's result message delivers them to the main process."""
    result = protocol.ChunkResult(outputs, None, None, 0.0)
    sealed = protocol.seal_outputs(result, per_item=False)
    return transport.copy(sealed).outputs  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n: np.arange(n, dtype=np.int32), id="numpy-int32"),
        pytest.param(lambda n: np.arange(n, dtype=np.uint16), id="numpy-uint16"),
        pytest.param(lambda n: np.full(n, 0.5, dtype=np.float32), id="numpy-float32"),
        pytest.param(lambda n: torch.arange(n, dtype=torch.int64), id="torch-int64"),
        pytest.param(lambda n: torch.arange(n).to(torch.bfloat16), id="torch-bfloat16"),
    ],
)
def test_a_chunk_of_arrays_arrives_as_views_of_one_buffer(make: Any) -> None:
    """Outputs of one dtype come back as views of one buffer, each equal to what was sent."""
    outputs = [make(n) for n in (3, 0, 5, 1)]
    got = _crossed(outputs)
    assert [type(x) for x in got] == [type(x) for x in outputs]
    assert [x.dtype for x in got] == [x.dtype for x in outputs]
    assert [x.tolist() for x in got] == [x.tolist() for x in outputs]
    if isinstance(got[0], np.ndarray):
        assert len({id(x.base) for x in got}) == 1
        assert all(x.flags.writeable for x in got)
    else:
        assert len({x.untyped_storage().data_ptr() for x in got}) == 1


def test_read_only_arrays_stay_read_only() -> None:
    """Read-only arrays cross flat and arrive read-only."""
    outputs = [np.arange(4, dtype=np.int32), np.arange(2, dtype=np.int32)]
    for a in outputs:
        a.flags.writeable = False
    got = _crossed(outputs)
    assert [x.flags.writeable for x in got] == [False, False]
    assert [x.tolist() for x in got] == [[0, 1, 2, 3], [0, 1]]


def test_a_group_goes_to_the_worker_stages_as_one_buffer() -> None:
    """A dispatched list of arrays is one flat buffer in the chunk message, a list after it."""
    group = [np.arange(n, dtype=np.int32) for n in (2, 3)]
    message, flats = protocol.chunk_message(
        0, 0, 0, 0, 0, [group, "other"], frozenset(), False, (0, 1)
    )
    assert flats is None  # "other" is no list of arrays
    sealed = message[6]
    assert type(sealed.obj[0]) is tokens.Flat and sealed.obj[1] == "other"
    items = transport.copy(message)[6]
    assert [type(x) for x in items[0]] == [np.ndarray, np.ndarray]
    assert [x.tolist() for x in items[0]] == [[0, 1], [0, 1, 2]] and items[1] == "other"


@pytest.mark.parametrize(
    "items",
    [
        pytest.param([], id="empty"),
        pytest.param([np.arange(3)], id="one-item"),
        pytest.param([np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int64)], id="two-dtypes"),
        pytest.param([np.zeros((2, 2), np.int32), np.zeros((2, 2), np.int32)], id="2-d"),
        pytest.param([np.array(["a"], object), np.array(["b"], object)], id="object-dtype"),
        pytest.param([np.arange(2, dtype=">i4"), np.arange(2, dtype=">i4")], id="byte-swapped"),
        pytest.param([np.arange(2), torch.arange(2)], id="numpy-and-torch"),
        pytest.param([np.ma.arange(2), np.ma.arange(2)], id="subclass"),
        pytest.param([torch.ones(2, requires_grad=True), torch.ones(2)], id="autograd"),
        pytest.param([[1, 2], [3]], id="lists"),
        pytest.param("not a list", id="str"),
        pytest.param((np.arange(2), np.arange(2)), id="tuple"),
    ],
)
def test_what_does_not_qualify_is_left_alone(items: Any) -> None:
    """Lists that are not all plain 1-D arrays of one dtype are not flattened."""
    assert tokens.flatten(items) is None


def test_mixed_writability_is_left_alone() -> None:
    """A list mixing writable and read-only arrays is pickled array by array."""
    a, b = np.arange(2), np.arange(2)
    b.flags.writeable = False
    assert tokens.flatten([a, b]) is None


@pytest.mark.parametrize(
    ("ends", "kind"),
    [
        pytest.param(np.array([2, 9], np.int64), "numpy", id="past-the-end"),
        pytest.param(np.array([3, 1, 5], np.int64), "numpy", id="descending"),
        pytest.param(np.array([2.0, 5.0]), "numpy", id="float-ends"),
        pytest.param(np.array([2, 5], np.int64), "jax", id="unknown-kind"),
    ],
)
def test_damaged_flat_items_are_refused(ends: Any, kind: str) -> None:
    """A damaged flat message raises ValueError, never a wrong split."""
    with pytest.raises(ValueError, match="damaged flat items"):
        tokens.unflatten(kind, np.arange(5, dtype=np.int32), ends, True)


def test_flat_pickles_to_the_list_it_stands_for() -> None:
    """A Flat unpickled by plain pickle is the list of arrays it was made from."""
    flat = tokens.flatten([np.arange(2, dtype=np.int8), np.arange(1, dtype=np.int8)])
    got = pickle.loads(pickle.dumps(flat))
    assert [x.tolist() for x in got] == [[0, 1], [0]] and got[0].dtype == np.int8


def _bases(group: list[np.ndarray]) -> int:
    return len({id(x.base) for x in group})


@pytest.mark.parametrize(
    ("workers", "flat", "bases"),
    [
        pytest.param(0, True, 1, id="inline-flat"),
        pytest.param(2, True, 1, id="2w-flat"),
        pytest.param(0, False, 3, id="inline-pickled"),
    ],
)
def test_a_dispatched_group_arrives_on_one_buffer(workers: int, flat: bool, bases: int) -> None:
    """A batch of arrays reaches the worker stage as views of one buffer (flat on), inline too."""
    pipe = cp.Pipeline.from_iterable(range(6)).map(lambda i: np.arange(i + 1, dtype=np.int32))
    pipe = pipe.batch(3).dispatch().map(_bases)
    assert _run(pipe, _cfg(workers, flat=flat)) == [bases, bases]

"""Token data in checkpoints: compact (one flat tensor plus lengths), readable with weights_only."""

from __future__ import annotations

import io
import zlib
from typing import Any

import numpy as np
import pytest
import torch

import centralpipe as cp
from centralpipe.checkpoint import compact, table
from centralpipe.testing import assert_resumes_exactly

BUCKET = "bucket"


def _tok(line: str) -> np.ndarray:
    return np.array([zlib.crc32(w.encode()) % 5000 for w in line.split()], dtype=np.int32)


def _lines(n: int) -> list[str]:
    return [" ".join(f"w{i * j % 89}" for j in range(1 + i % 7)) for i in range(n)]


def _as_lists(batch: list[Any]) -> list[list[int]]:
    return [x.tolist() for x in batch]


def _pipe(n: int = 80, buffer: int = 20, parallel: bool = True) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(_lines(n))
        .map(_tok, parallel=parallel)
        .bucket_by_max_tokens(16, buffer_size=buffer, name=BUCKET)
        .dispatch()
        .map(_as_lists)
    )


def _cfg(workers: int = 2, flat: bool = True) -> cp.LoaderConfig:
    w = cp.WorkerConfig(
        num_workers=workers, start_method="fork", chunk_size=3, buffer_size=12, flat_arrays=flat
    )
    return cp.LoaderConfig(workers=w)


def _saved(sd: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    return buffer.getvalue()


def _weights_only(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _mid_epoch_state(pipe: cp.Pipeline, cfg: cp.LoaderConfig, k: int) -> tuple[list[Any], Any]:
    with cp.Loader(pipe, cfg) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        return head, loader.state_dict()


def _rest(pipe: cp.Pipeline, cfg: cp.LoaderConfig, sd: Any) -> list[Any]:
    with cp.Loader(pipe, cfg) as loader:
        loader.load_state_dict(sd)
        return list(loader)


ITEMS = [
    pytest.param([np.arange(3, dtype=np.int32), np.arange(0, dtype=np.int32)], id="numpy-int32"),
    pytest.param([np.array([70000, 1], dtype=np.int64)] * 2, id="numpy-int64-wide"),
    pytest.param([np.array([0.5, 1.5], dtype=np.float32)], id="numpy-float32"),
    pytest.param([np.array([True, False])], id="numpy-bool"),
    pytest.param([torch.arange(4), torch.arange(1)], id="torch-int64"),
    pytest.param([torch.ones(2, dtype=torch.bfloat16)], id="torch-bfloat16"),
    pytest.param([[np.arange(2, dtype=np.int16)], [np.arange(3, dtype=np.int16)] * 2], id="groups"),
    pytest.param([[1, 2], [3]], id="lists-of-ints"),
    pytest.param(["a", 1, None], id="other-items"),
    pytest.param([], id="empty"),
]


def _same(a: list[Any], b: list[Any]) -> bool:
    if type(a) is not type(b) or len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, list):
            if not _same(x, y):
                return False
        elif isinstance(x, (np.ndarray, torch.Tensor)):
            if type(x) is not type(y) or x.dtype != y.dtype or x.tolist() != y.tolist():
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("items", ITEMS)
def test_items_round_trip_exactly_through_weights_only(items: list[Any]) -> None:
    """Encoded items read back with weights_only=True are the same items: type, dtype, values."""
    got = compact.decode_items(_weights_only(_saved({"x": compact.encode_items(items)}))["x"])
    assert _same(got, items)


def test_read_only_arrays_stay_read_only() -> None:
    """Read-only arrays come back read-only."""
    a = np.arange(3, dtype=np.int32)
    a.flags.writeable = False
    (got,) = compact.decode_items(compact.encode_items([a]))
    assert not got.flags.writeable and got.tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("values", "stored"),
    [
        pytest.param([0, 200], torch.uint8, id="uint8"),
        pytest.param([-5, 100], torch.int8, id="int8"),
        pytest.param([0, 60000], torch.uint16, id="uint16"),
        pytest.param([-1, 40000], torch.int32, id="int32"),
        pytest.param([0, 2**40], torch.int64, id="int64"),
    ],
)
def test_integers_are_stored_narrow(values: list[int], stored: torch.dtype) -> None:
    """Token ids are saved in the narrowest integer dtype that holds them."""
    encoded = compact.encode_items([np.array(values, dtype=np.int64)])
    assert compact.encoded_body(encoded, list)[0]["values"].dtype == stored


def test_plain_lists_stay_plain() -> None:
    """A list that does not qualify is saved as the same plain list (older checkpoints' form)."""
    items = [[1, 2], "x"]
    assert compact.encode_items(items) == items
    assert compact.decode_items(items) == items


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bucket_buffer_and_in_flight_groups_are_compact(workers: int) -> None:
    """Mid-epoch, the heap and the in-flight buckets are flat tensors; weights_only reads them."""
    pipe, cfg = _pipe(400), _cfg(workers)
    with cp.Loader(pipe, cfg) as loader:
        full = list(loader)
    with cp.Loader(pipe, cfg) as loader:
        it = iter(loader)
        head = [next(it)]
        sd = loader.state_dict()
        # the first state with buckets in flight (with workers: the feeder runs ahead)
        while workers and not sd["in_flight"]["dispatch"]["items"] and len(head) < len(full):
            head.append(next(it))
            sd = loader.state_dict()
    heap = sd["central"][BUCKET]["heap"]
    assert compact.is_compact(heap) and isinstance(table.decode_heap(heap), list)
    if workers:
        assert compact.is_compact(sd["in_flight"]["dispatch"]["items"])
    assert head + _rest(pipe, cfg, _weights_only(_saved(sd))) == full


@pytest.mark.parametrize("workers", [0, 2])
def test_resumes_exactly_at_every_k(workers: int) -> None:
    """Compact checkpoints resume exactly at every k, into another worker count."""
    assert_resumes_exactly(_pipe(30, 8), _cfg(workers), resume_config=_cfg(3 - workers, False))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_shard_round_of_arrays_is_compact(rank: int) -> None:
    """The round a drop_last shard dropped at the end of the epoch (kept in its
    state) is saved compact when it holds arrays: weights_only reads the
    state, and the next epoch runs from it as before."""
    lines = _lines(41)
    pipe = (
        cp.Pipeline.from_iterable(lines)
        .map(_tok)
        .shard(equalize="drop_last", name="sh")
        .dispatch()
        .map(np.ndarray.tolist)
    )
    dist = cp.DistributedConfig(rank=rank, world_size=2)
    cfg = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=0), distributed=dist)
    with cp.Loader(pipe, cfg) as loader:
        full = list(loader)
        sd = loader.state_dict()
    assert full == [_tok(x).tolist() for x in lines[rank:40:2]]
    dropped = sd["central"]["sh"]["round"]
    assert compact.is_compact(dropped)
    assert _same(compact.decode_items(dropped), [_tok(lines[40])])
    with cp.Loader(pipe, cfg) as loader:
        loader.load_state_dict(_weights_only(_saved(sd)))
        assert list(loader) == full


def test_old_list_states_still_load() -> None:
    """A state holding the heap and in-flight items as lists (the older form) resumes exactly."""
    pipe, cfg = _pipe(), _cfg(2)
    head, sd = _mid_epoch_state(pipe, cfg, 3)
    state = sd["central"][BUCKET]
    state["heap"] = table.decode_heap(state["heap"])
    state["batch"] = compact.decode_items(state["batch"])
    for flight in sd["in_flight"].values():
        flight["items"] = compact.decode_items(flight["items"])
    assert isinstance(state["heap"], list) and isinstance(
        sd["in_flight"]["dispatch"]["items"], list
    )
    with cp.Loader(pipe, cfg) as loader:
        full = list(loader)
    assert head + _rest(pipe, cfg, sd) == full


def test_the_compact_checkpoint_is_smaller_than_lists() -> None:
    """A 2,000-line bucket buffer saves in well under two thirds of the bytes of token lists."""
    lines = _lines(2100)
    sizes = {}
    for name, tok in (("arrays", _tok), ("lists", lambda s: _tok(s).tolist())):
        pipe = cp.Pipeline.from_iterable(lines).map(tok).bucket_by_max_tokens(64, buffer_size=2000)
        _, sd = _mid_epoch_state(pipe, cp.LoaderConfig(), 2)
        sizes[name] = len(_saved(sd))
    assert sizes["arrays"] < 0.6 * sizes["lists"], sizes


def _damage(sd: Any, how: str) -> None:
    heap = sd["central"][BUCKET]["heap"]
    part = compact.encoded_body(heap, dict)["segments"][0]
    if how == "lengths-past-values":
        part["lengths"] = part["lengths"].to(torch.int64) + 1000
    elif how == "negative-length":
        part["lengths"] = part["lengths"].to(torch.int64) - 1000
    elif how == "float-values":
        part["values"] = part["values"].to(torch.float32)
    elif how == "missing-key":
        del part["lengths"]
    elif how == "unknown-format":
        sd["central"][BUCKET]["heap"] = (heap[0], 99, heap[2])
    elif how == "column-too-short":
        part["length"] = part["length"][:-1]
    elif how == "unknown-dtype":
        part["dtype"] = "complex64"


@pytest.mark.parametrize(
    "how",
    [
        "lengths-past-values",
        "negative-length",
        "float-values",
        "missing-key",
        "unknown-format",
        "column-too-short",
        "unknown-dtype",
    ],
)
def test_a_damaged_compact_state_is_refused(how: str) -> None:
    """A damaged compact heap is a CheckpointError naming the stage's heap, never a wrong resume."""
    pipe, cfg = _pipe(parallel=False), _cfg(0)
    _, sd = _mid_epoch_state(pipe, cfg, 2)
    _damage(sd, how)
    with cp.Loader(pipe, cfg) as loader, pytest.raises(cp.CheckpointError, match="heap"):
        loader.load_state_dict(sd)


def test_damaged_in_flight_items_are_refused() -> None:
    """Damaged compact in-flight items are a CheckpointError naming in_flight."""
    pipe, cfg = _pipe(), _cfg(2)
    with cp.Loader(pipe, cfg) as loader:
        # A state with groups in flight behind the bucket (how many are in
        # flight at a given step depends on the workers' timing).
        it = iter(loader)
        sd = loader.state_dict()
        while not compact.is_compact(sd["in_flight"]["dispatch"]["items"]):
            next(it)
            sd = loader.state_dict()
    items = sd["in_flight"]["dispatch"]["items"]
    # the first packed part (a chunk whose items do not pack is a plain list)
    part = next(p for p in compact.encoded_body(items, list) if isinstance(p, dict))
    part["groups"] = part["groups"].to(torch.int64) + 5
    with cp.Loader(pipe, cfg) as loader, pytest.raises(cp.CheckpointError, match="in_flight"):
        loader.load_state_dict(sd)

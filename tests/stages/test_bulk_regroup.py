"""Regrouping stages pull in bulk: fewer calls, same batches, exact positions when len_fn raises."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import centralpipe as cp
from centralpipe.checkpoint import compact
from centralpipe.stages import batch as batch_module
from centralpipe.stages.sources import IterableSource
from centralpipe.testing import assert_resumes_exactly, collect
from tests.support.configs import loader_config

BAD = 7


def _length(x: int) -> int:
    return 1 + x % 3


def _length_failing(x: int) -> int:
    if x == BAD:
        raise ValueError(f"no length for {x}")
    return 1 + x % 3


def _times2(x: int) -> int:
    return 2 * x


def _bucket(p: cp.Pipeline, len_fn: Any = _length, buffer: int = 4) -> cp.Pipeline:
    return p.bucket_by_max_tokens(5, len_fn=len_fn, buffer_size=buffer, name="bucket")


@pytest.fixture
def pulls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ``n`` of every bulk pull the source is asked for."""
    asked: list[int] = []
    original = IterableSource.produce_into

    def spy(self: Any, out: list[Any], n: int) -> None:
        asked.append(n)
        original(self, out, n)

    monkeypatch.setattr(IterableSource, "produce_into", spy)
    return asked


def test_the_bucket_pulls_its_inputs_in_bulk(pulls: list[int]) -> None:
    """A bucket asks its source for PULL_BULK inputs at a time, not one by one."""
    pipe = _bucket(cp.Pipeline.from_iterable(range(200)))
    with cp.Loader(pipe) as loader:
        out = collect(loader)
    assert sum(len(b) for b in out) == 200
    assert pulls[:3] == [batch_module.PULL_BULK] * 3
    assert len(pulls) == -(-200 // batch_module.PULL_BULK) + 1  # + the one that ends the epoch


def test_batch_pulls_the_rest_of_its_group_at_once(pulls: list[int]) -> None:
    """batch(n) asks its source for the whole group in one call."""
    with cp.Loader(cp.Pipeline.from_iterable(range(10)).batch(4)) as loader:
        assert collect(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert pulls[:3] == [4, 4, 4]


@pytest.mark.parametrize(
    ("workers", "parallel"),
    [pytest.param(0, False, id="inline"), pytest.param(2, True, id="after-a-parallel-map")],
)
def test_same_batches_as_one_by_one(workers: int, parallel: bool) -> None:
    """Bulk bucketing gives the batches torchdata's one-by-one rule gives."""
    src = cp.Pipeline.from_iterable(range(150)).map(_times2, parallel=parallel)
    with cp.Loader(_bucket(src, buffer=9), loader_config(num_workers=workers)) as loader:
        got = collect(loader)
    # The rule, item by item: a heap of 9, shortest first, batches of <= 5 tokens.
    import heapq

    heap: list[tuple[int, int, int]] = []
    out, cur, tokens = [], [], 0

    def pop() -> None:
        nonlocal cur, tokens
        n, _, x = heapq.heappop(heap)
        if cur and tokens + n > 5:
            out.append(cur)
            cur, tokens = [], 0
        cur.append(x)
        tokens += n

    for k, x in enumerate(2 * i for i in range(150)):
        heapq.heappush(heap, (_length(x), k, x))
        if len(heap) >= 9:
            pop()
    while heap:
        pop()
    out.append(cur)
    assert got == out


@pytest.mark.parametrize(
    ("workers", "parallel", "batch_size"),
    [
        pytest.param(0, False, None, id="bucket-inline"),
        pytest.param(2, True, None, id="bucket-after-parallel"),
        pytest.param(0, False, 3, id="batch-then-bucket"),
    ],
)
def test_a_len_fn_raising_mid_bulk_drops_only_its_input(
    workers: int, parallel: bool, batch_size: int | None
) -> None:
    """The input whose len_fn raises is dropped; a checkpoint there resumes exactly after it."""
    cfg = loader_config(num_workers=workers)

    def build(items: list[int], len_fn: Any) -> cp.Pipeline:
        p = cp.Pipeline.from_iterable(items).map(_times2, parallel=parallel)
        p = p.map(lambda x: x // 2)
        if batch_size is not None:
            p = p.batch(batch_size).flat_map(lambda b: b)
        return _bucket(p, len_fn, buffer=6)

    expected = collect(cp.Loader(build([x for x in range(60) if x != BAD], _length), cfg))
    pipe = build(list(range(60)), _length_failing)
    with cp.Loader(pipe, cfg) as loader:
        it = iter(loader)
        head: list[Any] = []
        with pytest.raises(ValueError, match="no length for 7"):
            while True:
                head.append(next(it))
        sd = loader.state_dict()
    held = sd["central"]["bucket"].get("held", [])
    assert BAD not in held and len(held) <= batch_module.PULL_BULK
    with cp.Loader(pipe, cfg) as resumed:
        resumed.load_state_dict(sd)
        assert head + collect(resumed) == expected


@pytest.mark.parametrize(("workers", "after"), [(0, 3), (3, 0)], ids=["0w-to-3w", "3w-to-0w"])
def test_bulk_bucket_resumes_exactly_at_every_k(workers: int, after: int) -> None:
    """Held bulk inputs are part of the checkpoint: every k resumes exactly, any worker count."""
    pipe = _bucket(cp.Pipeline.from_iterable(range(40)).map(_times2, parallel=True), buffer=5)
    assert_resumes_exactly(
        pipe, loader_config(num_workers=workers), resume_config=loader_config(num_workers=after)
    )


def test_held_arrays_are_saved_compact() -> None:
    """Inputs pulled ahead and held are saved as one flat tensor when they are 1-D arrays."""
    pipe = cp.Pipeline.from_iterable(range(100)).map(lambda i: np.arange(i % 5, dtype=np.int32))
    pipe = pipe.bucket_by_max_tokens(8, buffer_size=4, name="bucket")
    with cp.Loader(pipe) as loader:
        next(iter(loader))
        held = loader.state_dict()["central"]["bucket"]["held"]
    assert compact.is_compact(held)


def test_a_checkpoint_holding_more_than_a_bulk_is_refused() -> None:
    """A bucket state holding more inputs than one bulk pull is a damaged checkpoint."""
    pipe = _bucket(cp.Pipeline.from_iterable(range(300)))
    with cp.Loader(pipe) as loader:
        next(iter(loader))
        sd = loader.state_dict()
    sd["central"]["bucket"]["held"] = list(range(batch_module.PULL_BULK + 1))
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match="held"):
        loader.load_state_dict(sd)

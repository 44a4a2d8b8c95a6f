"""A bucket's heap saved as sealed segments: exact, immutable, bounded, DCP-loadable."""

from __future__ import annotations

import heapq
import io
import math
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import centralpipe as cp
from centralpipe.checkpoint import compact, table
from centralpipe.testing import assert_resumes_exactly

BUCKET = "bucket"


def _tokens(i: int) -> np.ndarray:
    return np.arange(i, i + 1 + i % 9, dtype=np.int32)


def _as_lists(batch: list[Any]) -> list[list[int]]:
    return [x.tolist() for x in batch]


def _pipe(n: int, buffer: int) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(n))
        .map(_tokens)
        .bucket_by_max_tokens(24, buffer_size=buffer, name=BUCKET)
        .dispatch()
        .map(_as_lists)
    )


def _cfg(workers: int) -> cp.LoaderConfig:
    w = cp.WorkerConfig(num_workers=workers, start_method="fork", chunk_size=4, buffer_size=16)
    return cp.LoaderConfig(workers=w)


def _plain(entries: Any) -> list[tuple[int, int, list[int]]]:
    return [(int(n), int(i), x.tolist()) for n, i, x in entries]


class _Bucket:
    """A heap driven as the bucket drives it: the arena learns of each push
    and pop just before the heap call."""

    def __init__(self) -> None:
        self.heap: list[Any] = []
        self.arena = table.HeapArena()
        self.arrivals = 0

    def push(self, item: np.ndarray) -> None:
        entry = (len(item), self.arrivals, item)
        self.arrivals += 1
        if not self.arena.off:
            self.arena.pending.append(entry)
        heapq.heappush(self.heap, entry)

    def pop(self) -> None:
        if not self.arena.off:
            self.arena.removed.append(self.heap[0][1])
        heapq.heappop(self.heap)

    def live(self) -> list[tuple[int, int, list[int]]]:
        return _plain(sorted(self.heap, key=lambda e: e[1]))


def test_every_state_is_the_heap_and_stays_what_it_was() -> None:
    """Each state decodes to the heap's entries at that moment (by arrival),
    and still does after the heap changed and later states were taken."""
    rng = random.Random(7)
    b = _Bucket()
    taken: list[tuple[Any, list[Any]]] = []
    for step in range(3000):
        if b.heap and rng.random() < 0.45:
            b.pop()
        else:
            b.push(_tokens(rng.randrange(1000)))
        if step % rng.choice((1, 7, 60)) == 0:
            state = b.arena.state(b.heap)
            assert _plain(table.decode_heap(state)) == b.live()
            taken.append((state, b.live()))
    for state, live in taken:
        assert _plain(table.decode_heap(state)) == live


def test_segments_stay_few_and_the_saved_tokens_near_the_live_ones() -> None:
    """A steady bucket (one push, one pop of the shortest) checkpointed every
    step keeps O(log n) segments and saves at most about twice its live tokens."""
    rng = random.Random(3)
    b = _Bucket()
    for _ in range(2000):
        b.push(_tokens(rng.randrange(1000)))
    for _ in range(3000):
        b.push(_tokens(rng.randrange(1000)))
        b.pop()
        state = b.arena.state(b.heap)
        segments = compact.encoded_body(state, dict)["segments"]
        assert len(segments) <= 2 * math.log2(len(b.heap)) + 2
        saved = sum(len(s["values"]) for s in segments)
        live = sum(len(e[2]) for e in b.heap)
        assert saved <= 2 * live + 64


def test_items_that_do_not_flatten_are_saved_as_entries() -> None:
    """Items of two dtypes in one heap are saved as the plain list of entries."""
    b = _Bucket()
    b.arena.state(b.heap)
    b.push(np.arange(3, dtype=np.int32))
    b.push(np.arange(2, dtype=np.int64))
    state = b.arena.state(b.heap)
    assert isinstance(state, list) and sorted(_plain(state), key=lambda e: e[1]) == b.live()


def test_a_first_format_heap_still_loads() -> None:
    """A heap saved in the first compact format (a dict of columns) resumes exactly."""
    pipe, cfg = _pipe(120, 20), _cfg(0)
    with cp.Loader[Any](pipe, cfg) as loader:
        full = list(loader)
    with cp.Loader[Any](pipe, cfg) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        sd = loader.state_dict()
    entries = table.decode_heap(sd["central"][BUCKET]["heap"])
    sd["central"][BUCKET]["heap"] = {
        "length": torch.tensor([e[0] for e in entries]),
        "arrival": torch.tensor([e[1] for e in entries]),
        "items": {"compact": 1, "parts": [compact.pack_part([e[2] for e in entries])]},
    }
    with cp.Loader[Any](pipe, cfg) as loader:
        loader.load_state_dict(sd)
        assert head + list(loader) == full


@pytest.mark.parametrize("workers", [0, 2])
def test_a_large_bucket_resumes_exactly_at_every_k(workers: int) -> None:
    """States taken at every step (segments sealed, merged and rewritten as
    they go) resume exactly, into another worker count."""
    assert_resumes_exactly(_pipe(300, 64), _cfg(workers), resume_config=_cfg(2 - workers))


def test_a_damaged_live_mask_is_refused() -> None:
    """A segment whose live mask is not one bool per entry is a CheckpointError naming the heap."""
    pipe, cfg = _pipe(120, 20), _cfg(0)
    with cp.Loader[Any](pipe, cfg) as loader:
        it = iter(loader)
        next(it)
        sd = loader.state_dict()
    segment = compact.encoded_body(sd["central"][BUCKET]["heap"], dict)["segments"][0]
    segment["live"] = segment["live"].to(torch.uint8)
    with cp.Loader[Any](pipe, cfg) as loader, pytest.raises(cp.CheckpointError, match="heap"):
        loader.load_state_dict(sd)


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_distributed_checkpoint_loads_array_items_into_a_fresh_template(
    workers: int, tmp_path: Path
) -> None:
    """dcp.save of a mid-epoch state holding token arrays (heap, batch,
    held, in-flight groups), dcp.load into a fresh loader's state_dict():
    the resumed loader gives exactly the rest (one process, no group)."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    pipe, cfg = _pipe(300, 40), _cfg(workers)
    with cp.Loader[Any](pipe, cfg) as loader:
        full = list(loader)
    with cp.Loader[Any](pipe, cfg) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(4)]
        sd = loader.state_dict()
    assert compact.is_compact(sd["central"][BUCKET]["heap"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save({"loader": sd}, checkpoint_id=tmp_path)
        with cp.Loader[Any](pipe, cfg) as fresh:
            state = {"loader": fresh.state_dict()}
            dcp.load(state, checkpoint_id=tmp_path)
            fresh.load_state_dict(state["loader"])
            assert head + list(fresh) == full
    buffer = io.BytesIO()
    torch.save(state["loader"], buffer)
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

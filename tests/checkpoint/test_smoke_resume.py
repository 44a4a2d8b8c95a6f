"""Exact resume across worker counts for a small mixed pipeline."""

from __future__ import annotations

import pytest

import centralpipe as cp


def _dup(x: int) -> list[int]:
    return [x, x]


def _pipe() -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(300))
        .shuffle(20)
        .count("c")
        .batch(3)
        .dispatch()
        .map(sum)
        .flat_map(_dup)
    )


def _cfg(n: int) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=n, start_method="fork", buffer_size=16)
    )


@pytest.mark.parametrize(("before", "after"), [(0, 0), (2, 2), (2, 0), (0, 2)], ids=str)
def test_resume_is_exact_across_worker_counts(before: int, after: int) -> None:
    """First k items + the resumed rest equal the uninterrupted run."""
    with cp.Loader(_pipe(), _cfg(0)) as loader:
        full = list(loader)
    for k in (0, 1, 7, 100, len(full)):
        with cp.Loader(_pipe(), _cfg(before)) as loader:
            it = iter(loader)
            head = [next(it) for _ in range(k)]
            sd = loader.state_dict()
        with cp.Loader(_pipe(), _cfg(after)) as loader:
            loader.load_state_dict(sd)
            assert head + list(loader) == full

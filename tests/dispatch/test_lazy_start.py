"""Starting an epoch: `iter()` is cheap, and a failed or interrupted start loses nothing."""

from __future__ import annotations

import errno
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.executors.procpool import ProcessPool
from centralpipe.testing import collect
from tests.support.configs import loader_config


def _times2(x: int) -> int:
    return 2 * x


def _pipe() -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(24)).shuffle(24).count("c").dispatch().map(_times2)


def _epochs(n: int, num_workers: int = 0) -> list[list[int]]:
    with cp.Loader(_pipe(), loader_config(num_workers=num_workers)) as loader:
        return [collect(loader) for _ in range(n)]


def _fail_second_worker_start(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> list[int]:
    """Make the second worker of every pool fail to start with ``exc``; returns a
    list that counts the injected failures."""
    real = ProcessPool._start
    failures: list[int] = []

    def start(self: ProcessPool, slot: Any) -> None:
        if slot.index == 1:
            failures.append(1)
            raise exc
        real(self, slot)

    monkeypatch.setattr(ProcessPool, "_start", start)
    return failures


_FAILURES = [
    pytest.param(KeyboardInterrupt(), id="ctrl-c"),
    pytest.param(OSError(errno.EMFILE, "Too many open files"), id="emfile"),
]


def test_iter_alone_starts_nothing() -> None:
    """`iter()` without `next()` starts no worker and no epoch, and shifts no epoch number."""
    expected = _epochs(2)
    with cp.Loader(_pipe(), loader_config(num_workers=2)) as loader:
        before = loader.state_dict()
        for _ in range(3):
            iter(loader)  # a probe, as Lightning does, then thrown away
        assert loader.worker_pids() == []
        assert loader.epoch == 0
        assert loader.state_dict() == before
        assert collect(loader) == expected[0]
        assert loader.epoch == 1
        assert collect(loader) == expected[1]


def test_an_iterator_superseded_before_it_started_raises() -> None:
    """An unstarted iterator superseded by a newer `iter()` raises and starts nothing."""
    with cp.Loader(_pipe()) as loader:
        old = iter(loader)
        new = iter(loader)
        with pytest.raises(RuntimeError, match="superseded"):
            next(old)
        assert loader.epoch == 0
        assert list(new) == _epochs(1)[0]


def test_closing_before_the_first_next_raises() -> None:
    """An iterator whose loader closed before its first item raises that the loader is closed."""
    loader = cp.Loader(_pipe())
    it = iter(loader)
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(it)


@pytest.mark.parametrize("exc", _FAILURES)
def test_failed_start_of_the_first_epoch_loses_nothing(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    """A start that fails while the workers start leaves the epoch unstarted and no worker."""
    expected = _epochs(2)
    failures = _fail_second_worker_start(monkeypatch, exc)
    with cp.Loader(_pipe(), loader_config(num_workers=2)) as loader:
        with pytest.raises(type(exc)):
            next(iter(loader))
        assert failures == [1]
        assert loader.epoch == 0
        assert loader.worker_pids() == []
        state = loader.state_dict()
        monkeypatch.undo()
        assert collect(loader) == expected[0], "retrying starts the same epoch"
    with cp.Loader(_pipe(), loader_config(num_workers=2)) as resumed:
        resumed.load_state_dict(state)
        assert collect(resumed) == expected[0]
        assert collect(resumed) == expected[1]


@pytest.mark.parametrize("exc", _FAILURES)
def test_failed_start_of_a_resume_keeps_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    """A resume whose workers fail to start stays pending: `state_dict()` is the checkpoint."""
    expected = _epochs(2)
    with cp.Loader(_pipe(), loader_config(buffer_size=4)) as loader:
        collect(loader)
        it = iter(loader)
        head = [next(it) for _ in range(5)]
        checkpoint = loader.state_dict()
    assert head == expected[1][:5]
    _fail_second_worker_start(monkeypatch, exc)
    with cp.Loader(_pipe(), loader_config(num_workers=2)) as loader:
        loader.load_state_dict(checkpoint)
        with pytest.raises(type(exc)):
            next(iter(loader))
        assert loader.epoch == 2
        assert loader.state_dict() == checkpoint
        assert loader.query("c", delivered=True) == {"items": 5, "weight": 5}
        monkeypatch.undo()
        assert collect(loader) == expected[1][5:], "retrying resumes the checkpoint"


@pytest.mark.parametrize("exc", _FAILURES)
def test_failed_start_of_a_later_epoch_resumes_that_epoch(
    monkeypatch: pytest.MonkeyPatch, exc: BaseException
) -> None:
    """If replacing a worker fails as epoch 2 starts, a checkpoint resumes epoch 2 whole."""
    expected = _epochs(3)
    with cp.Loader(_pipe(), loader_config(num_workers=2)) as loader:
        assert collect(loader) == expected[0]

        def ensure_alive(self: ProcessPool) -> None:
            raise exc

        monkeypatch.setattr(ProcessPool, "ensure_alive", ensure_alive)
        with pytest.raises(type(exc)):
            next(iter(loader))
        assert loader.epoch == 1
        state = loader.state_dict()
        monkeypatch.undo()
        assert collect(loader) == expected[1], "retrying starts epoch 2"
    with cp.Loader(_pipe(), loader_config(num_workers=2)) as resumed:
        resumed.load_state_dict(state)
        assert collect(resumed) == expected[1]
        assert collect(resumed) == expected[2]


def test_failed_start_in_a_central_stage_keeps_the_epoch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while resetting the central stages for a new epoch leaves the epoch unstarted."""
    expected = _epochs(2)
    with cp.Loader(_pipe()) as loader:
        collect(loader)
        tip = loader._central._nodes[-1]
        real = type(tip).load_flat

        def load_flat(self: Any, flat: Any) -> None:
            if flat is None:
                raise OSError(errno.EMFILE, "Too many open files")
            real(self, flat)

        monkeypatch.setattr(type(tip), "load_flat", load_flat)
        with pytest.raises(OSError, match="Too many open files"):
            next(iter(loader))
        monkeypatch.undo()
        assert loader.epoch == 1
        state = loader.state_dict()
    with cp.Loader(_pipe()) as resumed:
        resumed.load_state_dict(state)
        assert collect(resumed) == expected[1]

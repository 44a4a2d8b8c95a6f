"""A count's live ``query()``: the last ``(items, weight)`` the central chain
published, read without the chain lock (``CentralNode.live_view``), so it
never waits for the central ``next()`` in progress and is never torn."""

from __future__ import annotations

import sys
import threading
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.chainlock import hold
from centralpipe.testing import collect
from tests.support.configs import loader_config

N = 3000


def _times2(x: int) -> int:
    return 2 * x


def _two(x: int) -> int:
    return 2


def _pipe() -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(N)).count("c", weight_fn=_two).dispatch().map(_times2)


def _locked(loader: cp.Loader[Any]) -> dict[str, Any]:
    """The count's state read under the chain lock (what ``query()`` read before)."""
    central: Any = loader._central
    with hold(central._res.chain_lock, "the test", central._nodes):
        state: dict[str, Any] = central._by_name["c"].query_state()
    return state


@pytest.mark.timeout(60)
def test_a_counts_live_query_equals_the_locked_one_at_quiet_points() -> None:
    """Before a pass, between the items of an inline pass (the chain runs in
    the caller's thread), after the epoch and after load_state_dict(), the
    live query is the count's state under the chain lock."""
    with cp.Loader(_pipe(), loader_config(num_workers=0)) as loader:
        assert loader.query("c") == _locked(loader) == {"items": 0, "weight": 0}
        it = iter(loader)
        for k in range(1, 6):
            next(it)
            live = loader.query("c")
            assert live == _locked(loader)
            assert live["items"] >= k
        state = loader.state_dict()
        rest = list(it)
        assert loader.query("c") == _locked(loader) == {"items": N, "weight": 2 * N}
    with cp.Loader(_pipe(), loader_config(num_workers=0)) as fresh:
        fresh.load_state_dict(state)
        assert fresh.query("c") == _locked(fresh)
        assert collect(fresh) == rest


@pytest.fixture
def fast_switching() -> Any:
    """Threads switch every 10 µs (the default is 5 ms): a reader and the
    feeder interleave at many more points."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_workers", [0, 2], ids=["inline", "workers"])
def test_a_reader_thread_never_sees_a_torn_count(fast_switching: Any, num_workers: int) -> None:
    """A thread reading the count's live query while the chain runs in
    another sees items and weight of one moment (weight 2 per item), never
    decreasing within the epoch; the items delivered are unchanged."""
    reads: list[dict[str, Any]] = []
    stop = threading.Event()
    with cp.Loader(_pipe(), loader_config(num_workers=num_workers, chunk_size=4)) as loader:

        def read() -> None:
            while not stop.is_set():
                reads.append(loader.query("c"))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            got = list(loader)
        finally:
            stop.set()
            reader.join(30)
        assert not reader.is_alive()
    assert got == [2 * i for i in range(N)]
    assert reads
    assert all(r["weight"] == 2 * r["items"] for r in reads)
    items = [r["items"] for r in reads]
    assert items == sorted(items)
    assert items[-1] <= N

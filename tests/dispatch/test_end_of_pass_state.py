"""A state taken when the consumer has every item of a pass but has not yet
seen its end is the same whether or not the call that ends it was cut short."""

from __future__ import annotations

from typing import Any

import pytest

import centralpipe as cp
from centralpipe.dispatch.reorder import Stream
from tests.support.configs import loader_config

pytestmark = pytest.mark.timeout(60)

N = 5


def times2(x: int) -> int:
    return 2 * x


def _pipe() -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(N)).dispatch().map(times2)


def _resumed(state: dict[str, Any], workers: int) -> tuple[list[int], list[int]]:
    """The rest of the pass a fresh loader resumes, then its next pass."""
    with cp.Loader[int](_pipe(), loader_config(num_workers=workers)) as fresh:
        fresh.load_state_dict(state)
        return list(fresh), list(fresh)


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2workers"])
def test_a_state_after_an_interrupted_end_resumes_the_same_pass(
    monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """A Ctrl-C landing as the stream starts to end the pass (after it marked
    itself finished): a state taken then resumes the same pass (nothing is
    left of it, then the next pass), as a state taken before that call
    does, not the next pass at once (which read the epoch twice into a
    consumer that had not seen the end)."""
    config = loader_config(num_workers=workers)
    with cp.Loader[int](_pipe(), config) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(N)] == [2 * i for i in range(N)]
        before = loader.state_dict()
        ending = Stream._end
        cut: list[bool] = []

        def cut_at_start(self: Stream) -> Any:
            if self.finished and not cut:
                cut.append(True)
                raise KeyboardInterrupt  # as a SIGINT lands at the function's start
            return ending(self)

        monkeypatch.setattr(Stream, "_end", cut_at_start)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert cut
        after = loader.state_dict()
        with pytest.raises(StopIteration):  # the same iterator then ends
            next(it)
    whole = [2 * i for i in range(N)]
    assert _resumed(before, workers) == ([], whole)
    assert _resumed(after, workers) == ([], whole)

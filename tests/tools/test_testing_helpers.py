"""``centralpipe.testing``'s checkpoint step and interrupt collector."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import Checkpoint, checkpoint_after, items_until_interrupt
from tests.support.configs import loader_config

LOCKSTEP = loader_config(buffer_size=1, chunk_size=1)


@pytest.mark.parametrize(
    ("k", "epochs", "head", "index"),
    [
        (0, 1, [], 0),
        (3, 1, [0, 1, 2], 3),
        (7, 2, [0, 1, 2, 3, 4, 0, 1], 2),
        (9, 1, [0, 1, 2, 3, 4], 5),
    ],
    ids=["k0", "k3", "second-epoch", "past-the-end"],
)
def test_checkpoint_after_gives_the_head_and_the_state_after_it(
    k: int, epochs: int, head: list[int], index: int
) -> None:
    """The first k items (across epochs; fewer at the run's end) and the state right
    after the last, which resumes a fresh Loader at the next item (past the end:
    the next pass)."""
    pipe = cp.Pipeline.from_iterable(range(5))
    got = checkpoint_after(pipe, k, LOCKSTEP, epochs=epochs)
    assert isinstance(got, Checkpoint) and got.items == head
    assert got.state["central"]["source"] == {"index": index}
    with cp.Loader(pipe, LOCKSTEP) as loader:
        loader.load_state_dict(got.state)
        # A finished pass resumes into the next one.
        assert list(loader) == list(range(index, 5) if index < 5 else range(5))


@pytest.mark.parametrize(
    ("k", "epochs", "match"),
    [
        (-1, 1, "`k` must be an int >= 0, got -1"),
        (True, 1, "got True"),
        (1.5, 1, "got 1.5"),
        (1, 0, "`epochs` must be >= 1, got 0"),
    ],
    ids=["negative", "bool", "float", "no-epochs"],
)
def test_checkpoint_after_refuses_bad_arguments(k: Any, epochs: int, match: str) -> None:
    """A k that is not an int >= 0, or epochs < 1, is a ValueError before any Loader starts."""
    with pytest.raises(ValueError, match=match):
        checkpoint_after(cp.Pipeline.from_iterable(range(5)), k, epochs=epochs)


def _interrupted(n: int) -> Iterator[int]:
    yield from range(n)
    raise KeyboardInterrupt


def test_items_until_interrupt_collects_what_came_before() -> None:
    """The items before the KeyboardInterrupt; none when it comes first."""
    assert items_until_interrupt(_interrupted(3)) == [0, 1, 2]
    assert items_until_interrupt(_interrupted(0)) == []


def test_items_until_interrupt_fails_without_one() -> None:
    """An iterator that ends without a KeyboardInterrupt is an AssertionError saying so."""
    with pytest.raises(AssertionError, match="no KeyboardInterrupt: the iterator ended after 2"):
        items_until_interrupt(iter([1, 2]))

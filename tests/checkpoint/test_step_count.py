"""A checkpoint's step count (``position.delivered``) is checked exactly: with
worker stages that make at most one output per input, the outputs delivered
plus the inputs that gave none (``position.skipped``) are the first
undelivered input's seq, at every step, across resumes, and for states from
before ``position.skipped``."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

import centralpipe as cp

N = 30


def fails_on_some(x: int) -> int:
    if x % 7 == 3:
        raise ValueError(f"planned failure on {x}")
    return x


def keep(x: int) -> bool:
    return x % 5 != 0


def no_output(kind: str, x: int) -> bool:
    """Whether input ``x`` gives no output in pipeline ``kind``."""
    return x % 7 == 3 if kind == "skip" else x % 5 == 0


def pipe(kind: str) -> cp.Pipeline:
    p = cp.Pipeline.from_iterable(range(N)).dispatch()
    return p.map(fails_on_some) if kind == "skip" else p.filter(keep)


def config(workers: int) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers, chunk_size=4, buffer_size=8, start_method="fork", on_error="skip"
        )
    )


def expected(kind: str) -> list[int]:
    return [x for x in range(N) if not no_output(kind, x)]


def check_position(sd: dict[str, Any], kind: str, step: int) -> None:
    """The state after ``step`` outputs: delivered is the step, skipped counts
    exactly the inputs before the first undelivered one that gave no output."""
    first = sd["in_flight"]["dispatch"]["first_seq"]
    skipped = sum(no_output(kind, x) for x in range(first))
    assert sd["position"]["delivered"] == step
    assert sd["position"]["skipped"] == skipped
    assert step + skipped == first


KINDS = ["skip", "filter"]
WORKERS = {"inline": 0, "fork-workers": 2}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", WORKERS.values(), ids=WORKERS.keys())
@pytest.mark.parametrize("kind", KINDS, ids=["on-error-skip", "worker-filter"])
def test_delivered_and_skipped_add_up_to_the_first_undelivered_input_at_every_step(
    kind: str, workers: int
) -> None:
    """After every item (and at the end) position.delivered is the step and
    position.skipped the inputs before first_seq that gave no output."""
    want = expected(kind)
    loader: cp.Loader[int]
    with cp.Loader(pipe(kind), config(workers)) as loader:
        check_position(loader.state_dict(), kind, 0)
        got: list[int] = []
        for item in loader:
            got.append(item)
            check_position(loader.state_dict(), kind, len(got))
        end = loader.state_dict()
    assert got == want
    assert end["finished"] and end["position"] == {
        "pre_shard_index": None,
        "delivered": len(want),
        "skipped": N - len(want),
    }


def _resume_twice(kind: str, sd: dict[str, Any], more: int, workers: int) -> list[int]:
    """Load ``sd``, take ``more`` items and checkpoint, then resume that
    checkpoint to the end: every item after ``sd``'s position."""
    loader: cp.Loader[int]
    with cp.Loader(pipe(kind), config(workers)) as loader:
        loader.load_state_dict(sd)
        it: Iterator[int] = iter(loader)
        head = [next(it) for _ in range(more)]
        again = loader.state_dict()
    step = sd["position"]["delivered"] + more
    check_position(again, kind, step)
    with cp.Loader(pipe(kind), config(workers)) as loader:
        loader.load_state_dict(again)
        return head + list(loader)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("old", [False, True], ids=["with-skipped", "state-without-skipped"])
@pytest.mark.parametrize("kind", KINDS, ids=["on-error-skip", "worker-filter"])
def test_resumed_runs_go_on_counting_exactly(kind: str, old: bool) -> None:
    """A run resumed at any step (from a state with position.skipped, or from
    one written before it, which has none) checkpoints the exact count again,
    and that checkpoint resumes exactly."""
    want = expected(kind)
    loader: cp.Loader[int]
    with cp.Loader(pipe(kind), config(0)) as loader:
        states = [loader.state_dict()]
        for _ in loader:
            states.append(loader.state_dict())
    for step, sd in enumerate(states[:-3]):
        sd = copy.deepcopy(sd)
        if old:
            del sd["position"]["skipped"]
        assert _resume_twice(kind, sd, 3, workers=0) == want[step:], step


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("delivered", "skipped"),
    [(4, None), (6, None), (3, 1), (5, 1)],
    ids=["earlier", "later", "earlier-skipped-changed-too", "later-skipped-changed-too"],
)
def test_a_state_relabelled_to_another_step_is_refused(delivered: int, skipped: int | None) -> None:
    """A step count that disagrees with the items delivered and skipped, later
    or earlier, is refused naming both numbers; the loader is left as it was."""
    loader: cp.Loader[int]
    with cp.Loader(pipe("skip"), config(0)) as loader:
        it: Iterator[int] = iter(loader)
        for _ in range(5):
            next(it)
        sd = loader.state_dict()
    # Items 0-5 delivered but 3: five outputs, one input skipped.
    assert (sd["in_flight"]["dispatch"]["first_seq"], sd["position"]["skipped"]) == (6, 1)
    bad = copy.deepcopy(sd)
    bad["position"]["delivered"] = delivered
    if skipped is not None:
        bad["position"]["skipped"] = skipped + 1
    kept = 1 if skipped is None else skipped + 1
    match = (
        rf"damaged checkpoint: position\.delivered must be in_flight\['dispatch'\]\.first_seq - "
        rf"position\.skipped = 6 - {kept} = {6 - kept} \(each item delivered gave one output or "
        rf"was skipped: the worker stages make at most one output per input; a step count that "
        rf"differs is another step's\), got {delivered}\."
    )
    with cp.Loader(pipe("skip"), config(0)) as loader:
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(bad)
        assert list(loader) == expected("skip")

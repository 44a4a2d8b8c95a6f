"""A table of damaged checkpoints: each is refused at `load_state_dict` with a
`CheckpointError` naming the key path, and leaves the loader exactly as it was.

Each value is checked against the pipeline it is loaded into: file indexes and
paths against the file list, offsets against file sizes and line starts, seqs
against what the central stages have yielded, stamps against the stamped stages.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import collect
from tests.support.configs import loader_config

LINES = {"a.txt": "a1\na2\na3\n", "b.txt": "b1\nb2\nb3\n", "c.txt": "c1\nc2\nc3\n"}
#: Items delivered before the checkpoint each mutation damages, and before the
#: good checkpoint already pending when the damaged one is refused.
K_DAMAGED, K_PENDING = 4, 2


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    for name, text in LINES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "outside.txt").write_text("x1\nx2\n")
    return tmp_path


def _files_pipe(root: Path) -> cp.Pipeline:
    return (
        cp.Pipeline.from_files([str(root / name) for name in LINES])
        .read_lines()
        .shuffle(3)
        .count("c", weight_fn=len)
        .shard(equalize="drop_last")
        .dispatch()
        .map(str.upper)
    )


CONFIG = loader_config(buffer_size=6, chunk_size=3)


def _state_at(pipe: cp.Pipeline, k: int) -> tuple[dict[str, Any], list[Any]]:
    """The checkpoint after ``k`` items and the whole epoch's items."""
    with cp.Loader(pipe, CONFIG) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state = loader.state_dict()
        rest = list(it)
    return state, head + rest


def _flight(sd: dict[str, Any]) -> dict[str, Any]:
    flight: dict[str, Any] = sd["in_flight"]["dispatch"]
    return flight


def _shift_seqs(sd: dict[str, Any]) -> None:
    flight = _flight(sd)
    flight["first_seq"] += 10**18
    flight["next_seq"] += 10**18
    flight["skip"] = []


Mutation = Callable[[dict[str, Any], Path], None]

DAMAGES: dict[str, tuple[Mutation, str]] = {
    "files-index-negative": (
        lambda sd, root: sd["central"]["files"].update(index=-1),
        r"central\['files'\]\.index must be an int >= 0, got -1",
    ),
    "files-index-past-end": (
        lambda sd, root: sd["central"]["files"].update(index=99),
        r"central\['files'\]\.index must be <= 3 \(the number of files\), got 99",
    ),
    "read-lines-other-listed-file": (
        lambda sd, root: sd["central"]["read_lines_1"].update(path=str(root / "a.txt")),
        r"central\['read_lines_1'\]\.path must be '.*c\.txt', the file at index 2 of stage "
        r"'files', got '.*a\.txt'",
    ),
    "read-lines-file-outside-the-list": (
        lambda sd, root: sd["central"]["read_lines_1"].update(path=str(root / "outside.txt")),
        r"central\['read_lines_1'\]\.path must be '.*c\.txt'",
    ),
    "read-lines-path-not-str": (
        lambda sd, root: sd["central"]["read_lines_1"].update(path=3),
        r"central\['read_lines_1'\]\.path must be None or a str, got 3",
    ),
    "read-lines-negative-offset": (
        lambda sd, root: sd["central"]["read_lines_1"].update(offset=-3),
        r"central\['read_lines_1'\]\.offset must be an int >= 0, got -3",
    ),
    "read-lines-offset-past-the-end": (
        lambda sd, root: sd["central"]["read_lines_1"].update(offset=10**6),
        r"'.*c\.txt' is 9 bytes but the checkpoint resumes at byte 1000000",
    ),
    "read-lines-offset-inside-a-line": (
        lambda sd, root: sd["central"]["read_lines_1"].update(offset=1),
        r"resumes '.*c\.txt' at byte 1, which is not the start of a line",
    ),
    "count-negative": (
        lambda sd, root: sd["central"]["c"].update(items=-1),
        r"central\['c'\]\.items must be an int >= 0, got -1",
    ),
    "count-weight-str": (
        lambda sd, root: sd["central"]["c"].update(weight="7"),
        r"central\['c'\]\.weight must be a number, got '7'",
    ),
    "shard-index-negative": (
        lambda sd, root: sd["central"]["shard_4"].update(index=-2),
        r"central\['shard_4'\]\.index must be an int >= 0, got -2",
    ),
    "shuffle-buffer-too-big": (
        lambda sd, root: sd["central"]["shuffle_2"].update(buffer=["z"] * 9),
        r"central\['shuffle_2'\]\.buffer must be at most buffer_size=3 items",
    ),
    "seq-absurd": (
        lambda sd, root: _shift_seqs(sd),
        r"in_flight\['dispatch'\]\.next_seq must be <= \d+ \(the items the central stages "
        r"have yielded",
    ),
    "next-seq-alone": (
        lambda sd, root: _flight(sd).update(next_seq=10**18),
        r"in_flight\['dispatch'\]\.next_seq must be first_seq \+ len\(items\)",
    ),
    "first-seq-negative": (
        lambda sd, root: _flight(sd).update(first_seq=-1),
        r"in_flight\['dispatch'\]\.first_seq must be an int >= 0, got -1",
    ),
    "skip-outputs-more-than-the-item-makes": (
        lambda sd, root: _flight(sd).update(skip_outputs=5),
        r"in_flight\['dispatch'\]\.skip_outputs must be 0 \(the worker stages make at most "
        r"one output per input\), got 5",
    ),
    "skip-seq-out-of-range": (
        lambda sd, root: _flight(sd).update(skip=[10**18]),
        r"in_flight\['dispatch'\]\.skip must be distinct seqs of in-flight items",
    ),
    "items-not-a-list": (
        lambda sd, root: _flight(sd).update(items="abc"),
        r"in_flight\['dispatch'\]\.items must be a list, got 'abc'",
    ),
    "stamp-of-an-item-wrong-type": (
        lambda sd, root: _flight(sd)["stamps"].__setitem__(0, "x"),
        r"in_flight\['dispatch'\]\.stamps must be None or a list of stamps",
    ),
    "delivered-stamp-wrong-type": (
        lambda sd, root: sd.update(delivered_stamp="oops"),
        r"delivered_stamp must be None or a list of shard indexes",
    ),
    "delivered-stamp-wrong-length": (
        lambda sd, root: sd.update(delivered_stamp=[[1, 2]]),
        r"delivered_stamp must be 2 entries \(\[items, weight\], index\)",
    ),
    "delivered-stamp-wrong-kind": (
        lambda sd, root: sd.update(delivered_stamp=[1, 1]),
        r"delivered_stamp\[0\] must be \[items, weight\], got 1",
    ),
    "delivered-stamp-ahead-of-the-stage": (
        lambda sd, root: sd.update(delivered_stamp=[[10**6, 0], 1]),
        r"delivered_stamp\[0\] must be between 0 and the stage's \d+",
    ),
    "in-flight-of-an-unknown-boundary": (
        lambda sd, root: sd.update(in_flight={"elsewhere": sd["in_flight"]["dispatch"]}),
        r"in_flight must be keyed by boundary \['dispatch'\]",
    ),
    "seed-beyond-64-bits": (
        lambda sd, root: sd.update(seed=2**64),
        r"seed must be an int in \[0, 2\*\*64\), got 18446744073709551616",
    ),
    "rank-not-below-world-size": (
        lambda sd, root: sd.update(distributed={"rank": 3, "world_size": 2}),
        r"distributed\.rank must be < world_size \(2\), got 3",
    ),
    "fingerprint-not-pairs": (
        lambda sd, root: sd.update(fingerprint=[["files"]]),
        r"fingerprint must be a list of \[stage name, kind\] pairs",
    ),
    "epoch-negative": (
        lambda sd, root: sd.update(epoch=-1),
        r"epoch must be an int >= 0, got -1",
    ),
}


@pytest.mark.parametrize(("mutate", "match"), list(DAMAGES.values()), ids=list(DAMAGES))
@pytest.mark.usefixtures("whole_chunks")
def test_damaged_checkpoint_is_refused_and_changes_nothing(
    corpus: Path, mutate: Mutation, match: str
) -> None:
    """Each damage is a `CheckpointError` at load naming the key; the pending checkpoint stays."""
    pipe = _files_pipe(corpus)
    damaged, epoch = _state_at(pipe, K_DAMAGED)
    pending, _ = _state_at(pipe, K_PENDING)
    assert damaged["central"]["read_lines_1"]["path"] == "c.txt"  # relative to the files' root
    assert _flight(damaged)["items"], "the checkpoint must hold in-flight items"
    mutate(damaged, corpus)
    with cp.Loader(pipe, CONFIG) as loader:
        loader.load_state_dict(pending)
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(damaged)
        assert loader.state_dict() == pending
        assert collect(loader) == epoch[K_PENDING:]


@pytest.mark.parametrize("name", ["files-index-negative", "seq-absurd", "count-negative"])
def test_refused_checkpoint_leaves_a_live_iterator_running(corpus: Path, name: str) -> None:
    """A refused checkpoint does not touch a loader mid-epoch: its iterator goes on."""
    pipe = _files_pipe(corpus)
    damaged, epoch = _state_at(pipe, K_DAMAGED)
    mutate, match = DAMAGES[name]
    mutate(damaged, corpus)
    with cp.Loader(pipe, CONFIG) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(3)]
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(damaged)
        assert head + list(it) == epoch


def test_read_lines_path_that_is_a_directory(tmp_path: Path) -> None:
    """A `read_lines` path edited to a directory is refused at load, naming the key."""
    path = tmp_path / "a.txt"
    path.write_text("1\n2\n3\n")
    pipe = cp.Pipeline.from_iterable([str(path)]).read_lines()
    state, _ = _state_at(pipe, 1)
    state["central"]["read_lines_1"]["path"] = str(tmp_path)
    with cp.Loader(pipe, CONFIG) as loader:
        with pytest.raises(
            cp.CheckpointError, match=r"central\['read_lines_1'\]\.path must be a regular file"
        ):
            loader.load_state_dict(state)
        assert collect(loader) == ["1", "2", "3"]


def _repeat(x: int) -> list[int]:
    return [x] * x


def test_worker_flat_map_skip_outputs_past_the_items_outputs(tmp_path: Path) -> None:
    """With a worker flat_map, `skip_outputs` beyond the item's outputs is a
    `CheckpointError` before anything of that item is delivered (only running it tells)."""
    pipe = cp.Pipeline.from_iterable([3, 1, 2]).dispatch().flat_map(_repeat)
    state, epoch = _state_at(pipe, 2)
    assert _flight(state)["skip_outputs"] == 2
    good = copy.deepcopy(state)
    _flight(state)["skip_outputs"] = 4
    with cp.Loader(pipe, CONFIG) as loader:
        loader.load_state_dict(state)
        with pytest.raises(
            cp.CheckpointError,
            match=r"skip_outputs must be <= 3 \(the outputs of item seq 0\), got 4",
        ):
            next(iter(loader))
        loader.load_state_dict(good)
        assert collect(loader) == epoch[2:]


class _Shrinking:
    """A re-iterable whose length the test changes (only restore can tell)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


def test_restore_failure_rolls_back_to_the_pending_checkpoint() -> None:
    """A checkpoint refused while restoring (a re-iterable got shorter) restores the
    earlier pending checkpoint: the loader is as it was before the call."""
    source = _Shrinking(10)
    pipe = cp.Pipeline.from_iterable(source).shuffle(2).count("c")
    far, _ = _state_at(pipe, 8)
    near, _ = _state_at(pipe, 2)
    source.n = 5
    with cp.Loader(pipe, CONFIG) as loader:
        loader.load_state_dict(near)
        with pytest.raises(cp.CheckpointError, match="the iterable now has only 5 items"):
            loader.load_state_dict(far)
        assert loader.state_dict() == near
        expected_rest = collect(loader)
    with cp.Loader(pipe, CONFIG) as loader:
        loader.load_state_dict(near)
        assert collect(loader) == expected_rest


def test_restore_failure_mid_pass_keeps_that_pass_position() -> None:
    """A checkpoint refused only while the stages restore, loaded mid-pass, stops
    that pass but keeps its position pending: the next pass resumes it exactly."""
    source = _Shrinking(10)
    pipe = cp.Pipeline.from_iterable(source).shuffle(2).count("c")
    far, _ = _state_at(pipe, 8)
    source.n = 5
    _, epoch = _state_at(pipe, 0)
    with cp.Loader(pipe, CONFIG) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(2)]
        before = loader.state_dict()
        with pytest.raises(cp.CheckpointError, match="the iterable now has only 5 items"):
            loader.load_state_dict(far)
        assert loader.state_dict() == before
        with pytest.raises(RuntimeError, match="superseded"):
            next(it)
        assert head + collect(loader) == epoch


def _square(x: int) -> int:
    return x * x


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-workers"])
def test_parallel_stage_next_seq_past_its_source_is_refused(workers: int) -> None:
    """A source index lowered below a parallel stage's `next_seq` is refused at
    load (it resumed 101 items of 100: the items between were sent twice)."""
    pipe = (
        cp.Pipeline.from_iterable(range(100))
        .map(_square, parallel=True, name="sq")
        .batch(2)
        .dispatch()
    )
    config = loader_config(num_workers=workers, buffer_size=6, chunk_size=3)
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(4)]
        state = loader.state_dict()
    good = copy.deepcopy(state)
    next_seq = state["in_flight"]["sq"]["next_seq"]
    state["central"]["source"]["index"] = next_seq - 1
    match = (
        rf"in_flight\['sq'\]\.next_seq must be <= {next_seq - 1} \(the items the stages "
        rf"before it have yielded, by their state\), got {next_seq}"
    )
    with cp.Loader(pipe, config) as loader:
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(state)
        loader.load_state_dict(good)
        rest = collect(loader)
    assert [x for batch in head + rest for x in batch] == [x * x for x in range(100)]


def _pack_state() -> tuple[cp.Pipeline, dict[str, Any], list[Any]]:
    """A pack(16) pipeline, its checkpoint with open groups, and the whole epoch."""
    lengths = [5, 9, 7, 3, 8, 6, 2, 9, 4, 7, 5, 3, 8, 6, 1, 9, 2, 4]
    items = [[i] * n for i, n in enumerate(lengths)]
    pipe = cp.Pipeline.from_iterable(items).pack(16, buffer_size=6, name="p").dispatch()
    config = loader_config(buffer_size=1, chunk_size=1)
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        head = [next(it)]
        state = loader.state_dict()
        rest = list(it)
    assert state["central"]["p"]["groups"], "the checkpoint must hold open groups"
    return pipe, state, head + rest


def _overfill(group: list[Any]) -> None:
    room, items = group
    items.append([99] * (room + 1))  # one token more than the group has room for


PACK_DAMAGES: dict[str, tuple[Callable[[list[Any]], None], str]] = {
    "item-added": (
        _overfill,
        r"central\['p'\]\.groups\[0\]\[1\] must be items of at most max_tokens=16 tokens "
        r"in all, got '17 tokens'",
    ),
    "room-raised": (
        lambda group: group.__setitem__(0, group[0] + 1),
        r"central\['p'\]\.groups\[0\]\[0\] must be max_tokens less the group's \d+ tokens",
    ),
    "room-lowered": (
        lambda group: group.__setitem__(0, group[0] - 1),
        r"central\['p'\]\.groups\[0\]\[0\] must be max_tokens less the group's \d+ tokens",
    ),
    "item-removed": (
        lambda group: group[1].pop(0) if len(group[1]) > 1 else group[1].append([7]),
        r"central\['p'\]\.groups\[0\]\[0\] must be max_tokens less the group's \d+ tokens",
    ),
}


@pytest.mark.parametrize(("mutate", "match"), list(PACK_DAMAGES.values()), ids=list(PACK_DAMAGES))
def test_pack_group_room_must_match_its_items(
    mutate: Callable[[list[Any]], None], match: str
) -> None:
    """An open group whose `room` is not max_tokens less its items' lengths is refused
    at load (an edit once made a 17-token group under max_tokens=16)."""
    pipe, state, epoch = _pack_state()
    good = copy.deepcopy(state)
    mutate(state["central"]["p"]["groups"][0])
    with cp.Loader(pipe, CONFIG) as loader:
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(state)
        loader.load_state_dict(good)
        assert collect(loader) == epoch[1:]

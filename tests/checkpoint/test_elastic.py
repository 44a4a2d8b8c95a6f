"""Elastic resume in one process: ranks simulated with ``DistributedConfig``.

Every rank of a world size ``W`` takes ``k`` steps and checkpoints; the states
are merged and the global state resumes on ``W2`` ranks. The reference is one
uninterrupted pass on one rank: the old ranks got their shards of its first
``k * W`` items, and the new ranks get the shards of the rest, split anew.
"""

from __future__ import annotations

import copy
import io
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import centralpipe as cp
from tests.support.configs import loader_config

N = 25  # central items (batches) per epoch: rounds of 2, 3 and 4 are incomplete
WORDS = [("w" * (1 + (7 * i) % 5)) for i in range(63)]
EQUALIZE = [None, "drop_last", "pad"]


def tokens(word: str) -> int:
    return len(word)


def pipe(equalize: str | None, *, after: Callable[[Any], Any] | None = None) -> cp.Pipeline:
    """shuffle → bucket_by_max_tokens → count → shard, as in the motivating pipeline."""
    p = (
        cp.Pipeline.from_iterable(WORDS)
        .shuffle(7)
        .count("words", weight_fn=tokens)
        .bucket_by_max_tokens(9, len_fn=tokens, buffer_size=6)
        .count("batches")
        .shard(equalize=equalize)
        .dispatch()
    )
    return p.map(after) if after is not None else p.map(tuple)


def model(stream: list[Any], equalize: str | None, world: int) -> list[list[Any]]:
    """What each rank gets from ``stream`` (the rules of shard())."""
    if equalize is None:
        return [stream[r::world] for r in range(world)]
    full = len(stream) // world
    out = [[stream[q * world + r] for q in range(full)] for r in range(world)]
    rest = stream[full * world :]
    if equalize == "pad" and rest:
        for r in range(world):
            out[r].append(rest[r % len(rest)])
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """One uninterrupted pass on one rank: the central stream and, after each
    item, the ``count`` totals as that item reached the shard."""
    with cp.Loader(pipe(None), loader_config()) as loader:
        stream, words, batches = [], [], []
        for item in loader:
            stream.append(item)
            words.append(loader.query("words", delivered=True))
            batches.append(loader.query("batches", delivered=True))
    assert len(stream) == N
    return {"stream": stream, "words": words, "batches": batches}


def take(equalize: str | None, world: int, k: int, **cfg: Any) -> tuple[list[Any], list[Any]]:
    """``k`` items on each of ``world`` ranks, and each rank's state after them."""
    heads, states = [], []
    for rank in range(world):
        with cp.Loader(pipe(equalize), loader_config(rank=rank, world_size=world, **cfg)) as ld:
            it = iter(ld)
            heads.append([next(it) for _ in range(k)])
            states.append(ld.state_dict())
    return heads, states


def resume(
    equalize: str | None, state: dict[str, Any], world: int, **cfg: Any
) -> tuple[list[list[Any]], list[list[Any]]]:
    """Every rank of ``world`` loads ``state`` and runs to the end of the epoch;
    their items and, per item, the delivered view of the ``batches`` count."""
    tails, views = [], []
    for rank in range(world):
        with cp.Loader(pipe(equalize), loader_config(rank=rank, world_size=world, **cfg)) as ld:
            ld.load_state_dict(state)
            got, seen = [], []
            for item in ld:
                got.append(item)
                seen.append(ld.query("batches", delivered=True))
            tails.append(got)
            views.append(seen)
    return tails, views


def check_views(
    ref: dict[str, Any], equalize: str | None, start: int, world: int, views: list[list[Any]]
) -> None:
    """The delivered view after each item is the count as of that item's round."""
    positions = model(list(range(start, N)), equalize, world)
    full = (N - start) // world
    for rank, seen in enumerate(views):
        for j, view in enumerate(seen):
            if equalize is None:
                at = positions[rank][j]
            elif j < full:
                at = start + (j + 1) * world - 1  # the round is complete at its last item
            else:
                at = N - 1  # pad's last round: emitted once the stream ended
            assert view == ref["batches"][at], (equalize, world, rank, j)


#: How far the feeder reads ahead of delivery: with no workers it pulls one
#: chunk at a time when the consumer needs an item, so a fixed chunk size
#: fixes the read-ahead (13: to the end of the epoch from the first step on).
READ_AHEAD = {"feeder-at-delivered": 1, "feeder-in-the-middle": 3, "feeder-at-end": 13}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("chunk", READ_AHEAD.values(), ids=READ_AHEAD.keys())
@pytest.mark.parametrize("equalize", EQUALIZE, ids=str)
@pytest.mark.parametrize("world", [1, 2, 3], ids=lambda w: f"from{w}")
def test_merged_state_resumes_exactly_on_any_world_size_at_every_step(
    reference: dict[str, Any], equalize: str | None, world: int, chunk: int
) -> None:
    """At every step k, however far the feeder had read ahead, merging all
    ranks' states and resuming on 1 to 4 ranks gives what an uninterrupted
    run on that world size gives from the global position: each remaining
    central item exactly once, split (and dropped or padded) by the new shard,
    with the delivered count view exact after every item."""
    per_rank = model(reference["stream"], equalize, world)
    steps = min(len(s) for s in per_rank)
    for k in range(steps + 1):
        heads, states = take(equalize, world, k, buffer_size=None, chunk_size=chunk)
        assert heads == [s[:k] for s in per_rank]
        merged = cp.merge_states(states)
        start = k * world
        for new_world in (1, 2, 3, 4):
            tails, views = resume(equalize, merged, new_world)
            assert tails == model(reference["stream"][start:], equalize, new_world), (k, new_world)
            check_views(reference, equalize, start, new_world, views)


@pytest.mark.timeout(60)
def test_feeder_done_reading_during_a_slow_step_drops_nothing_on_one_rank(
    reference: dict[str, Any],
) -> None:
    """A checkpoint taken after a slow step, when a worker-fed run has read to
    the end of the epoch and its 2-rank drop_last has dropped the last round,
    resumes on 1 rank with that round's item: the merge re-decides for 1 rank."""
    states = []
    for rank in range(2):
        config = loader_config(rank=rank, world_size=2, num_workers=1, buffer_size=None)
        with cp.Loader(pipe("drop_last"), config) as ld:
            it = iter(ld)
            head = [next(it) for _ in range(3)]
            assert head == model(reference["stream"], "drop_last", 2)[rank][:3]
            deadline = time.monotonic() + 30
            while not ld.query("shard_5")["done"]:  # the slow step: the feeder reads on
                assert time.monotonic() < deadline, "the feeder did not reach the end in 30 s"
                time.sleep(0.01)
            states.append(ld.state_dict())
    tails, _ = resume("drop_last", cp.merge_states(states), 1)
    assert tails == [reference["stream"][6:]]
    last = list(reference["stream"][24])  # the dropped round, as each shard keeps it
    assert [s["central"]["shard_5"]["round"] for s in states] == [[last], [last]]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("equalize", ["drop_last", "pad"])
def test_two_to_three_to_two_with_workers(reference: dict[str, Any], equalize: str) -> None:
    """2 ranks → 3 ranks → 2 ranks, with 2, 1 and 0 workers and a feeder that
    runs ahead: across the three runs every central item arrives once, in
    central order round by round."""
    stream = reference["stream"]
    heads, states = take(equalize, 2, 4, num_workers=2, buffer_size=None)
    assert heads == [s[:4] for s in model(stream, equalize, 2)]
    merged = cp.merge_states(states)
    mid, mid_states = [], []
    for rank in range(3):
        config = loader_config(rank=rank, world_size=3, num_workers=1, buffer_size=3)
        with cp.Loader(pipe(equalize), config) as ld:
            ld.load_state_dict(merged)
            it = iter(ld)
            mid.append([next(it) for _ in range(2)])
            mid_states.append(ld.state_dict())
    assert mid == [s[:2] for s in model(stream[8:], equalize, 3)]
    again = cp.merge_states(list(reversed(mid_states)))
    assert again["position"]["pre_shard_index"] == 14
    tails, views = resume(equalize, again, 2)
    assert tails == model(stream[14:], equalize, 2)
    check_views(reference, equalize, 14, 2, views)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("equalize", ["drop_last", "pad"])
def test_thread_executor_on_both_sides_of_a_merge(reference: dict[str, Any], equalize: str) -> None:
    """Per-rank states of a thread-executor run merge and resume on 3 ranks
    running threads too: every central item once, in central order."""
    stream = reference["stream"]
    _, states = take(equalize, 2, 3, num_workers=2, executor="thread", buffer_size=None)
    tails, views = resume(equalize, cp.merge_states(states), 3, num_workers=2, executor="thread")
    assert tails == model(stream[6:], equalize, 3)
    check_views(reference, equalize, 6, 3, views)


@pytest.mark.timeout(60)
def test_global_state_survives_torch_save_and_weights_only_load(
    reference: dict[str, Any],
) -> None:
    """The global state is builtins only: torch.save / weights_only load keep it."""
    _, states = take("pad", 2, 3)
    buf = io.BytesIO()
    torch.save(cp.merge_states(states), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    tails, _ = resume("pad", loaded, 3)
    assert tails == model(reference["stream"][6:], "pad", 3)


@pytest.mark.timeout(60)
def test_global_state_reports_its_origin_and_position() -> None:
    """A global state names the world size it came from and the global position."""
    _, states = take("drop_last", 3, 2)
    merged = cp.merge_states(states)
    assert merged["distributed"] == {"rank": 0, "world_size": 3, "merged": True}
    assert merged["position"] == {"pre_shard_index": 6, "delivered": 0, "skipped": 0}
    assert merged["in_flight"]["dispatch"]["items"] == []


@pytest.mark.timeout(60)
def test_loaded_global_state_merges_to_itself() -> None:
    """Ranks that loaded one global state and took no step report it again,
    and merging those reports gives the same state back."""
    _, states = take(None, 2, 3)
    merged = cp.merge_states(states)
    again = []
    for rank in range(3):
        with cp.Loader(pipe(None), loader_config(rank=rank, world_size=3)) as ld:
            ld.load_state_dict(merged)
            again.append(ld.state_dict())
    assert cp.merge_states(again) == merged


@pytest.mark.timeout(60)
def test_with_rng_streams_follow_the_item_not_the_world_size() -> None:
    """A worker map with_rng gives each central item the same random draw on
    any world size, before and after an elastic resume."""

    def draw(batch: Any, rng: torch.Generator) -> tuple[Any, int]:
        return (tuple(batch), int(torch.randint(0, 2**30, (1,), generator=rng)))

    def build() -> cp.Pipeline:
        return (
            cp.Pipeline.from_iterable(WORDS)
            .shuffle(7)
            .bucket_by_max_tokens(9, len_fn=tokens, buffer_size=6)
            .shard()
            .dispatch()
            .map(draw, with_rng=True)
        )

    with cp.Loader(build(), loader_config()) as ld:
        whole = sorted(ld)
    states, seen = [], []
    for rank in range(2):
        with cp.Loader(build(), loader_config(rank=rank, world_size=2)) as ld:
            it = iter(ld)
            seen.extend(next(it) for _ in range(3))
            states.append(ld.state_dict())
    merged = cp.merge_states(states)
    for rank in range(3):
        with cp.Loader(build(), loader_config(rank=rank, world_size=3, num_workers=1)) as ld:
            ld.load_state_dict(merged)
            seen.extend(ld)
    assert sorted(seen) == whole


# -- refusals ----------------------------------------------------------------------------


def _states(equalize: str | None = "drop_last", world: int = 2, k: int = 2) -> list[Any]:
    return take(equalize, world, k)[1]


def _refused(states: Any, match: str) -> None:
    with pytest.raises(cp.CheckpointError, match=match):
        cp.merge_states(states)


@pytest.mark.timeout(60)
def test_incomplete_set_and_duplicate_rank_are_refused() -> None:
    """A missing rank or a rank given twice is named in the refusal."""
    states = _states(world=3)
    _refused(states[:2], r"missing ranks \[2\]")
    _refused([states[0], states[1], states[1]], r"rank 1 appears twice")
    _refused([], "got none")
    _refused(states[0], "a list of state_dict")
    _refused([states[0], {"x": 1}], r"states\[1\] is not a centralpipe state_dict")


@pytest.mark.timeout(60)
def test_states_of_different_jobs_or_steps_are_refused() -> None:
    """Different pipelines, seeds, epochs or step counts are refused by name."""
    states = _states()
    other = take("drop_last", 2, 3)[1]
    _refused([states[0], other[1]], "different numbers of steps.*rank 0 after 2.*rank 1 after 3")
    seeded = dict(states[1], seed=5)
    _refused([states[0], seeded], "different seeds")
    later = dict(states[1], epoch=states[1]["epoch"] + 1)
    _refused([states[0], later], "different epochs")
    central = dict(states[1]["central"])
    central["x"] = central.pop("source")
    fingerprint = [["x", "iterable"], *states[1]["fingerprint"][1:]]
    renamed = dict(states[1], fingerprint=fingerprint, central=central)
    _refused([states[0], renamed], "different pipelines")


@pytest.mark.timeout(60)
def test_pipelines_that_cannot_resume_elastically_are_refused() -> None:
    """No shard(), or a central stage after shard(), is refused with the fix."""
    no_shard = cp.Pipeline.from_iterable(range(10)).dispatch().map(abs)
    after = cp.Pipeline.from_iterable(range(10)).shard().count("mine").dispatch().map(abs)
    for p, match in ((no_shard, "has no shard"), (after, "'mine' \\(count\\) comes after")):
        states = []
        for rank in range(2):
            with cp.Loader(p, loader_config(rank=rank, world_size=2)) as ld:
                it = iter(ld)
                next(it)
                states.append(ld.state_dict())
        _refused(states, match)


@pytest.mark.timeout(60)
def test_per_rank_state_on_another_world_size_names_merge_states() -> None:
    """Loading one rank's own state on another world size fails and says to merge."""
    states = _states()
    with (
        cp.Loader(pipe("drop_last"), loader_config(rank=0, world_size=3)) as ld,
        pytest.raises(cp.CheckpointError, match=r"rank 0 of 2.*cp\.merge_states"),
    ):
        ld.load_state_dict(states[0])


@pytest.mark.timeout(60)
def test_another_ranks_state_on_the_same_world_size_explains_the_dcp_mistake() -> None:
    """Rank 1 loading rank 0's state (what one key shared by every rank gives
    with torch.distributed.checkpoint) is refused without claiming a world-size
    change, and the message shows the per-rank and global recipes."""
    states = _states()
    config = loader_config(rank=1, world_size=2)
    with cp.Loader(pipe("drop_last"), config) as ld, pytest.raises(cp.CheckpointError) as info:
        ld.load_state_dict(states[0])
    text = str(info.value)
    assert "rank 0 of 2, but this loader is rank 1 of 2" in text
    assert "world size" not in text.split(":")[0]
    assert "per-rank key" in text and "cp.gather_states" in text


@pytest.mark.timeout(60)
def test_mixing_global_and_per_rank_states_is_refused() -> None:
    """A global state merged again with a rank's own state is refused."""
    states = _states()
    _refused([cp.merge_states(states), states[1]], "already a global state")


@pytest.mark.timeout(60)
def test_inspect_shows_a_global_state(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m centralpipe inspect` names a global state, the world size it
    was merged from, the global position and the merged items."""
    from centralpipe.__main__ import main

    path = tmp_path / "global.pt"
    torch.save({"loader": cp.merge_states(_states("pad", 3, 2))}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "global state: merged from 3 ranks" in out
    assert "pre_shard_index: 6" in out
    assert "queue:" in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("equalize", EQUALIZE, ids=str)
def test_per_rank_checkpoints_after_an_elastic_resume_resume_exactly(
    reference: dict[str, Any], equalize: str | None
) -> None:
    """After loading a global state, each rank's own checkpoints (taken while
    the merged items are still queued) resume exactly on that rank."""
    _, states = take(equalize, 2, 3, buffer_size=None)
    merged = cp.merge_states(states)
    want = model(reference["stream"][6:], equalize, 3)
    for rank in (0, 2):
        config = loader_config(rank=rank, world_size=3, chunk_size=1, buffer_size=1)
        for k in range(len(want[rank]) + 1):
            with cp.Loader(pipe(equalize), config) as ld:
                ld.load_state_dict(merged)
                it = iter(ld)
                head = [next(it) for _ in range(k)]
                state = ld.state_dict()
            with cp.Loader(pipe(equalize), config) as ld:
                ld.load_state_dict(state)
                assert head + list(ld) == want[rank], (rank, k)


def _flight1(sd: dict[str, Any]) -> dict[str, Any]:
    flight: dict[str, Any] = sd["in_flight"]["dispatch"]
    return flight


def _extra_item(sd: dict[str, Any]) -> None:
    flight = _flight1(sd)
    flight["items"].append(flight["items"][0])
    flight["stamps"].append(flight["stamps"][0])


#: A defect in rank 1's state: the mutation, and the refusal (of
#: load_state_dict on rank 1, and of merge_states naming the rank).
RANK_DEFECTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "extra-in-flight-item": (
        _extra_item,
        r"in_flight\['dispatch'\]\.next_seq must be first_seq \+ len\(items\) = 2 \+ 4 = 6, got 5",
    ),
    "next-seq-plus-5": (
        lambda sd: _flight1(sd).update(next_seq=_flight1(sd)["next_seq"] + 5),
        r"in_flight\['dispatch'\]\.next_seq must be first_seq \+ len\(items\) = 2 \+ 3 = 5, got 10",
    ),
    "rank-str": (
        lambda sd: sd["distributed"].update(rank="1"),
        r"distributed\.rank must be an int >= 0, got '1'",
    ),
    "rank-bool": (
        lambda sd: sd["distributed"].update(rank=True),
        r"distributed\.rank must be an int >= 0, got True",
    ),
    "rank-float": (
        lambda sd: sd["distributed"].update(rank=1.0),
        r"distributed\.rank must be an int >= 0, got 1\.0",
    ),
    "stamps-none": (
        lambda sd: _flight1(sd).update(stamps=None),
        r"in_flight\['dispatch'\]\.stamps must be one stamp per in-flight item, got None",
    ),
    "shard-round-not-a-list": (
        lambda sd: sd["central"]["shard_5"].update(round="junk"),
        r"central\['shard_5'\]\.round must be a list, got 'junk'",
    ),
    "shard-round-too-long": (
        lambda sd: sd["central"]["shard_5"].update(round=[["w"]] * 3),
        r"central\['shard_5'\]\.round must be 0 items \(\(index 10 - base 0\) mod world_size 2\)",
    ),
    "delivered-relabelled-to-a-later-step": (
        lambda sd: sd["position"].update(delivered=3),
        r"position\.delivered must be in_flight\['dispatch'\]\.first_seq - position\.skipped = "
        r"2 - 0 = 2 \(each item delivered gave one output or was skipped: .*\), got 3",
    ),
    "delivered-relabelled-to-an-earlier-step": (
        lambda sd: sd["position"].update(delivered=1),
        r"position\.delivered must be in_flight\['dispatch'\]\.first_seq - position\.skipped = "
        r"2 - 0 = 2 \(each item delivered gave one output or was skipped: .*\), got 1",
    ),
    "skipped-relabelled": (
        lambda sd: sd["position"].update(skipped=1),
        r"position\.delivered must be in_flight\['dispatch'\]\.first_seq - position\.skipped = "
        r"2 - 1 = 1 \(each item delivered gave one output or was skipped: .*\), got 2",
    ),
    "skipped-negative": (
        lambda sd: sd["position"].update(skipped=-1),
        r"position\.skipped must be None or an int >= 0, got -1",
    ),
    "skipped-str": (
        lambda sd: sd["position"].update(skipped="0"),
        r"position\.skipped must be None or an int >= 0, got '0'",
    ),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("defect", RANK_DEFECTS, ids=str)
@pytest.mark.usefixtures("whole_chunks")
def test_merge_refuses_a_rank_state_that_loading_refuses(defect: str) -> None:
    """A defect in one rank's state is refused by merge_states as load_state_dict
    refuses it on that rank: the same words, after the rank's place and number."""
    mutate, match = RANK_DEFECTS[defect]
    states = take("drop_last", 2, 2, buffer_size=None, chunk_size=5)[1]
    assert len(_flight1(states[1])["items"]) == 3  # the defects need items in flight
    damaged = copy.deepcopy(states[1])
    mutate(damaged)
    with (
        cp.Loader(pipe("drop_last"), loader_config(rank=1, world_size=2)) as ld,
        pytest.raises(cp.CheckpointError, match=match) as loading,
    ):
        ld.load_state_dict(damaged)
    with pytest.raises(cp.CheckpointError) as merging:
        cp.merge_states([states[0], damaged])
    rank = "" if defect.startswith("rank-") else " (rank 1)"
    assert str(merging.value) == f"states[1]{rank}: {loading.value}"


@pytest.mark.timeout(60)
def test_dropped_round_in_a_rank_state_loads_and_older_states_still_merge(
    reference: dict[str, Any],
) -> None:
    """A drop_last rank state at the epoch's end keeps the dropped round and
    resumes exactly on its own rank (nothing more this epoch); a state from
    before the round was kept (round []) still loads and merges, without that
    round; a round of the wrong length is refused."""
    stream = reference["stream"]
    _, states = take("drop_last", 2, 12, buffer_size=None, chunk_size=13)
    assert [s["central"]["shard_5"]["round"] for s in states] == [[list(stream[24])]] * 2
    older = copy.deepcopy(states)
    for sd in older:
        sd["central"]["shard_5"].update(round=[], round_stamps=[])
    for rank in range(2):
        for sd in (states[rank], older[rank]):
            with cp.Loader(pipe("drop_last"), loader_config(rank=rank, world_size=2)) as ld:
                ld.load_state_dict(sd)
                assert list(ld) == []
    assert resume("drop_last", cp.merge_states(states), 1)[0] == [[stream[24]]]
    assert resume("drop_last", cp.merge_states(older), 1)[0] == [[]]
    bad = copy.deepcopy(states[0])
    bad["central"]["shard_5"]["round"] *= 2
    bad["central"]["shard_5"]["round_stamps"] *= 2
    match = (
        r"central\['shard_5'\]\.round must be 1 items \(\(index 25 - base 0\) mod world_size 2\), "
        r"the round drop_last dropped at the end, or \[\], got"
    )
    with (
        cp.Loader(pipe("drop_last"), loader_config(rank=0, world_size=2)) as ld,
        pytest.raises(cp.CheckpointError, match=match),
    ):
        ld.load_state_dict(bad)
    with pytest.raises(cp.CheckpointError, match=r"states\[0\] \(rank 0\): damaged.*" + match):
        cp.merge_states([bad, states[1]])


def _poison(batch: Any) -> tuple[Any, ...]:
    """A worker map that fails on central item 4 (rank 0's third of 2 ranks;
    no other batch equals it)."""
    if batch == list(_POISON):
        raise ValueError("poison")
    return tuple(batch)


_POISON: tuple[Any, ...] = ()


@pytest.mark.timeout(60)
def test_states_with_a_skipped_item_merge(
    reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With on_error="skip", a rank that skipped an item has delivered fewer
    outputs than items (position.delivered < first_seq): its state still
    merges, and the resumed rank gets every item after the global position."""
    stream = reference["stream"]
    assert stream.count(stream[4]) == 1
    monkeypatch.setattr(sys.modules[__name__], "_POISON", stream[4])
    states = []
    for rank in range(2):
        config = cp.LoaderConfig(
            workers=cp.WorkerConfig(num_workers=0, chunk_size=1, on_error="skip"),
            distributed=cp.DistributedConfig(rank=rank, world_size=2),
        )
        with cp.Loader(pipe("drop_last", after=_poison), config) as ld:
            it = iter(ld)
            head = [next(it) for _ in range(3)]
            states.append(ld.state_dict())
        assert head == [s for s in stream[rank::2] if s != stream[4]][:3]
    assert [(s["position"]["delivered"], _flight1(s)["first_seq"]) for s in states] == [
        (3, 4),
        (3, 3),
    ]
    tails, _ = resume("drop_last", cp.merge_states(states), 1)
    assert tails == [stream[7:]]

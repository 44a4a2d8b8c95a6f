"""Damaged, newer or foreign checkpoints raise `CheckpointError` saying what differs.

A checkpoint is never resumed silently wrong, and a refused checkpoint leaves the
loader usable.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.testing import collect

SEED = 3


def _plus1(x: int) -> int:
    return x + 1


def _pipe() -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(12)).map(_plus1).shuffle(4).count("c").batch(2)


def _config(*, seed: int = SEED, rank: int = 0, world_size: int = 1) -> cp.LoaderConfig:
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(buffer_size=2, chunk_size=1),
        distributed=cp.DistributedConfig(rank=rank, world_size=world_size),
        seed=seed,
    )


def _full(config: cp.LoaderConfig | None = None) -> list[Any]:
    with cp.Loader(_pipe(), config or _config()) as loader:
        return collect(loader)


@pytest.fixture
def good() -> dict[str, Any]:
    """A valid checkpoint of `_pipe()` taken after 2 of its 6 batches."""
    with cp.Loader(_pipe(), _config()) as loader:
        it = iter(loader)
        next(it)
        next(it)
        return loader.state_dict()


def _assert_refused_and_usable(
    state: Any, match: str, config: cp.LoaderConfig | None = None
) -> None:
    """Loading ``state`` raises `CheckpointError` matching ``match``; the loader then
    runs a fresh first epoch."""
    with cp.Loader(_pipe(), config or _config()) as loader:
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(state)
        assert loader.epoch == 0
        assert collect(loader) == _full(config)
        assert loader.epoch == 1


def test_good_checkpoint_resumes(good: dict[str, Any]) -> None:
    """The fixture checkpoint itself is valid and resumes exactly."""
    with cp.Loader(_pipe(), _config()) as loader:
        loader.load_state_dict(good)
        assert _full()[:2] + collect(loader) == _full()


@pytest.mark.parametrize(
    "key",
    [
        "format_version",
        "fingerprint",
        "seed",
        "epoch",
        "finished",
        "distributed",
        "central",
        "in_flight",
        "delivered_stamp",
        "position",
    ],
)
def test_missing_top_level_key(good: dict[str, Any], key: str) -> None:
    """A checkpoint without a required key names the key."""
    del good[key]
    _assert_refused_and_usable(good, rf"damaged checkpoint: {key} is missing")


@pytest.mark.parametrize(
    "key", ["next_seq", "first_seq", "items", "stamps", "skip_outputs", "skip"]
)
def test_missing_in_flight_key(good: dict[str, Any], key: str) -> None:
    """A checkpoint whose in-flight inputs lack a key names its path."""
    del good["in_flight"]["dispatch"][key]
    _assert_refused_and_usable(good, rf"in_flight\['dispatch'\]\.{key} is missing")


def test_unexpected_key(good: dict[str, Any]) -> None:
    """An unknown key is refused (a checkpoint of another format), naming it."""
    good["in_flight"]["dispatch"]["extra"] = 1
    _assert_refused_and_usable(good, r"in_flight\['dispatch'\] has unexpected key\(s\) \['extra'\]")


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("format_version", "1", "2"),
        ("format_version", True, "2"),
        ("fingerprint", {"a": 1}, "a list of"),
        ("seed", 3.0, r"an int in \[0, 2\*\*64\)"),
        ("epoch", "1", "an int >= 0"),
        ("finished", 0, "a bool"),
        ("distributed", [0, 1], "a dict"),
        ("central", [], "a dict of stage name"),
        ("in_flight", (), "a dict of boundary name"),
        ("delivered_stamp", "x", "None or a list"),
        ("position", 3, "a dict"),
    ],
    ids=lambda v: repr(v).replace(" ", "") if not isinstance(v, str) else v,
)
def test_wrong_type(good: dict[str, Any], key: str, value: Any, expected: str) -> None:
    """A value of the wrong type names the key, what was expected and what was got."""
    good[key] = value
    _assert_refused_and_usable(good, rf"{key} must be {expected}.*, got ")


def test_not_a_dict() -> None:
    """Something that is not a dict is refused."""
    _assert_refused_and_usable([1, 2], "a checkpoint must be a dict, got list")


def test_newer_format_version(good: dict[str, Any]) -> None:
    """A newer format version says both versions and to upgrade."""
    good["format_version"] = 99
    _assert_refused_and_usable(
        good, r"format_version is 99, this centralpipe reads format_version 2; upgrade"
    )


def test_older_format_version(good: dict[str, Any]) -> None:
    """An older format version says both versions and that an older release wrote it."""
    good["format_version"] = 1
    _assert_refused_and_usable(
        good, r"format_version is 1, this centralpipe reads format_version 2; .*older"
    )


def test_checkpoint_of_another_pipeline(good: dict[str, Any]) -> None:
    """Another pipeline's checkpoint names the first differing stage on both sides."""
    other = cp.Pipeline.from_iterable(range(12)).map(_plus1).batch(2).count("c").batch(3)
    with cp.Loader(other, _config()) as loader:
        with pytest.raises(
            cp.CheckpointError,
            match=r"another pipeline: at position 2 the checkpoint has stage 'shuffle_2' "
            r"\(shuffle\), this pipeline has 'batch_2' \(batch\)",
        ):
            loader.load_state_dict(good)
        assert collect(loader) == [[[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 10], [11, 12]]]


def test_checkpoint_of_a_renamed_stage(good: dict[str, Any]) -> None:
    """A stage renamed since the checkpoint is another pipeline."""
    renamed = cp.Pipeline.from_iterable(range(12)).map(_plus1).shuffle(4).count("seen").batch(2)
    with (
        cp.Loader(renamed, _config()) as loader,
        pytest.raises(
            cp.CheckpointError,
            match="checkpoint has stage 'c' \\(count\\), this pipeline has 'seen'",
        ),
    ):
        loader.load_state_dict(good)


def test_checkpoint_of_a_longer_pipeline(good: dict[str, Any]) -> None:
    """A pipeline with more stages says both stage counts."""
    longer = _pipe().dispatch().map(len)
    with (
        cp.Loader(longer, _config()) as loader,
        pytest.raises(cp.CheckpointError, match="it has 5 stages, this pipeline has 7"),
    ):
        loader.load_state_dict(good)


def test_different_seed(good: dict[str, Any]) -> None:
    """A checkpoint taken with another seed names both seeds."""
    _assert_refused_and_usable(
        good, f"taken with seed {SEED}, this loader has seed 4", _config(seed=4)
    )


@pytest.mark.parametrize(
    ("rank", "world_size"), [(0, 2), (1, 2)], ids=["other-world-size", "other-rank"]
)
def test_different_rank_or_world_size(rank: int, world_size: int) -> None:
    """A checkpoint of another rank or world size says both."""
    pipe = cp.Pipeline.from_iterable(range(12)).shard()
    with cp.Loader(pipe, _config(world_size=2, rank=0 if rank else 1)) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    if world_size == 2 and rank == 0:
        state["distributed"]["world_size"] = 3
        state["distributed"]["rank"] = 0
    with cp.Loader(pipe, _config(rank=rank, world_size=world_size)) as loader:
        with pytest.raises(cp.CheckpointError, match=f"this loader is rank {rank} of {world_size}"):
            loader.load_state_dict(state)
        assert collect(loader) == list(range(rank, 12, world_size))


def test_missing_and_unexpected_stage_states(good: dict[str, Any]) -> None:
    """`central` must hold exactly one state per central stage, named in the error."""
    del good["central"]["shuffle_2"]
    good["central"]["zzz"] = {}
    _assert_refused_and_usable(good, r"missing \['shuffle_2'\]\), got \"extra \['zzz'\]\"")


def test_stage_state_not_a_dict(good: dict[str, Any]) -> None:
    """A stage state that is not a dict is refused."""
    good["central"]["c"] = 7
    _assert_refused_and_usable(good, "central must be a dict of stage name -> state dict")


GARBAGE: dict[str, tuple[str, Any, str]] = {
    "shuffle-buffer": (
        "shuffle_2",
        {"buffer": 5, "rng": [], "draining": False},
        r"central\['shuffle_2'\]\.buffer must be a list, got 5",
    ),
    "shuffle-empty": ("shuffle_2", {}, r"central\['shuffle_2'\]\.buffer is missing"),
    "shuffle-rng": (
        "shuffle_2",
        {"buffer": [], "rng": "nope", "draining": False},
        r"central\['shuffle_2'\]\.rng must be a random.Random state",
    ),
    "shuffle-rng-values": (
        "shuffle_2",
        {"buffer": [], "rng": [3, [1, 2], None], "draining": False},
        r"central\['shuffle_2'\]\.rng must be a random.Random state",
    ),
    "shuffle-too-big": (
        "shuffle_2",
        {"buffer": [1] * 5, "rng": random.Random(0).getstate(), "draining": False},
        r"central\['shuffle_2'\]\.buffer must be at most buffer_size=4 items",
    ),
    "source-index": ("source", {"index": "abc"}, r"central\['source'\]\.index must be an int"),
    "source-past-end": (
        "source",
        {"index": 13},
        r"central\['source'\]\.index must be <= 12 \(the length of the source\), got 13",
    ),
    "count-items": ("c", {"items": [1], "weight": 0}, r"central\['c'\]\.items must be an int"),
    "count-negative": (
        "c",
        {"items": -1, "weight": 0},
        r"central\['c'\]\.items must be an int >= 0, got -1",
    ),
    "count-empty": ("c", {}, r"central\['c'\]\.items is missing"),
    "map-state": ("map_1", {"x": 1}, r"central\['map_1'\] has unexpected key"),
}


@pytest.mark.parametrize(("stage", "state", "match"), list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_stage_state(good: dict[str, Any], stage: str, state: Any, match: str) -> None:
    """Garbage in one stage's state names that stage and key, and the loader stays usable."""
    good["central"][stage] = state
    _assert_refused_and_usable(good, match)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (
            lambda sd: sd["in_flight"]["dispatch"].update(
                first_seq=sd["in_flight"]["dispatch"]["next_seq"], items=[1], stamps=None
            ),
            r"next_seq must be first_seq \+ len\(items\)",
        ),
        (lambda sd: sd.update(epoch=-1), "epoch must be an int >= 0, got -1"),
        (
            lambda sd: sd["in_flight"]["dispatch"].update(skip_outputs=-2),
            "skip_outputs must be an int >= 0, got -2",
        ),
        (
            lambda sd: sd["in_flight"]["dispatch"].update(stamps=[[[1, 1]]] * 9),
            "stamps must be None or one stamp per item",
        ),
    ],
    ids=["past-next-seq", "negative-epoch", "negative-skip", "stamps"],
)
def test_inconsistent_in_flight(
    good: dict[str, Any], change: Callable[[dict[str, Any]], None], match: str
) -> None:
    """Inconsistent positions are refused as damaged."""
    change(good)
    _assert_refused_and_usable(good, match)


def test_refused_checkpoint_keeps_the_loaded_one(good: dict[str, Any]) -> None:
    """A checkpoint refused by validation leaves an earlier loaded checkpoint in effect."""
    bad = copy.deepcopy(good)
    bad["seed"] = 99
    with cp.Loader(_pipe(), _config()) as loader:
        loader.load_state_dict(good)
        with pytest.raises(cp.CheckpointError):
            loader.load_state_dict(bad)
        assert collect(loader) == _full()[2:]


def test_garbage_after_a_good_load_keeps_the_good_one_pending(good: dict[str, Any]) -> None:
    """After a good load and a refused one, the good checkpoint is still the one resumed."""
    bad = copy.deepcopy(good)
    bad["central"]["shuffle_2"] = {"buffer": 5}
    with cp.Loader(_pipe(), _config()) as loader:
        loader.load_state_dict(good)
        with pytest.raises(cp.CheckpointError, match="shuffle_2"):
            loader.load_state_dict(bad)
        assert loader.epoch == good["epoch"] == 1
        assert loader.state_dict() == good
        assert collect(loader) == _full()[2:]


def test_truncated_file_fails_in_torch_load(good: dict[str, Any], tmp_path: Path) -> None:
    """A truncated checkpoint file fails in `torch.load` itself, before centralpipe sees it."""
    # What the user sees is torch's own exception: `EOFError` (empty file),
    # `RuntimeError` ("PytorchStreamReader failed reading zip archive") or `OSError`,
    # depending on where the file was cut. centralpipe never reads files itself.
    path = tmp_path / "ckpt.pt"
    torch.save(good, path)
    data = path.read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        with pytest.raises((EOFError, RuntimeError, OSError)):
            torch.load(path, weights_only=False)


def test_checkpoint_from_disk_resumes(good: dict[str, Any], tmp_path: Path) -> None:
    """A checkpoint saved to a file and loaded with torch's defaults resumes exactly."""
    path = tmp_path / "ckpt.pt"
    torch.save(good, path)
    with cp.Loader(_pipe(), _config()) as loader:
        loader.load_state_dict(torch.load(path))
        assert collect(loader) == _full()[2:]


def test_loading_does_not_alias_the_checkpoint(good: dict[str, Any]) -> None:
    """Resuming does not change the dict it was given; it can be loaded again."""
    snapshot = copy.deepcopy(good)
    with cp.Loader(_pipe(), _config()) as loader:
        loader.load_state_dict(good)
        first = collect(loader)
        assert good == snapshot
        loader.load_state_dict(good)
        assert collect(loader) == first


def test_changed_source_file_list_is_refused(tmp_path: Path) -> None:
    """A file list that changed since the checkpoint is refused, naming the stage."""
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("1\n2\n")
    pipe = cp.Pipeline.from_files(str(tmp_path / "*.txt")).read_lines()
    with cp.Loader(pipe) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    (tmp_path / "c.txt").write_text("3\n")
    with cp.Loader(pipe) as loader:
        with pytest.raises(cp.CheckpointError, match="stage 'files': the file list changed"):
            loader.load_state_dict(state)
        assert collect(loader) == ["1", "2"] * 2 + ["3"]


def test_wire_form_is_the_models_unstructured_form(good: dict[str, Any]) -> None:
    """`state_dict()` writes exactly the typed model's wire form: structure, then
    unstructure, gives the same dict back."""
    from centralpipe import checkpoint

    model = checkpoint.structure(good)
    assert isinstance(model.in_flight["dispatch"], checkpoint.Boundary)
    assert checkpoint.unstructure(model) == good

"""Each central stage kind's options are typed (``plan.options``): the spec
carries them, node classes read attributes, and they read as the dict the
builder recorded, so ``describe()``, fingerprints and pickles are unchanged."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from torchdata.nodes import IterableWrapper

import centralpipe as cp
from centralpipe.plan.kinds import WORKER_KINDS
from centralpipe.plan.options import (
    CENTRAL_OPTIONS,
    BatchOptions,
    BucketOptions,
    DatasetOptions,
    FilesOptions,
    IterableOptions,
    MixOptions,
    NoOptions,
    Options,
    PackOptions,
    ReadJsonlOptions,
    ReadLinesOptions,
    ShardOptions,
    ShuffleOptions,
    StatefulIterableOptions,
)
from centralpipe.plan.specs import StageSpec
from centralpipe.stages import NODE_CLASSES

P = cp.Pipeline
DATA = [1, 2, 3]


class _Stateful:
    """An iterable that keeps its own position (as a ``datasets.IterableDataset``)."""

    def __iter__(self) -> Iterator[int]:
        return iter(DATA)

    def state_dict(self) -> dict[str, Any]:
        return {"at": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


_NODE = IterableWrapper(DATA)
_STATEFUL = _Stateful()
_SUB = P.from_iterable(DATA)

#: (pipeline, index of the stage, its options class, the dict the builder recorded before).
CASES: list[tuple[Callable[[], cp.Pipeline], int, type[Options], dict[str, Any]]] = [
    (lambda: P.from_iterable(DATA), 0, IterableOptions, {"source": DATA, "mode": "sequence"}),
    (
        lambda: P.from_iterable(_STATEFUL),
        0,
        StatefulIterableOptions,
        {"source": _STATEFUL, "start": {"at": 0}},
    ),
    (lambda: P.from_dataset(DATA), 0, DatasetOptions, {"source": DATA}),
    (lambda: P.from_node(_NODE), 0, DatasetOptions, {"source": _NODE}),
    (lambda: P.from_files("/d/*.txt"), 0, FilesOptions, {"glob": "/d/*.txt"}),
    (lambda: P.from_files(["/a", "/b"]), 0, FilesOptions, {"paths": ("/a", "/b")}),
    (
        lambda: P.from_files(["/a"]).read_lines(errors="replace"),
        1,
        ReadLinesOptions,
        {"encoding": "utf-8", "errors": "replace"},
    ),
    (
        lambda: P.from_files(["/a"]).read_jsonl(field="t"),
        1,
        ReadJsonlOptions,
        {"field": "t", "errors": "strict"},
    ),
    (
        lambda: _SUB.batch(4, drop_last=True),
        1,
        BatchOptions,
        {"batch_size": 4, "drop_last": True},
    ),
    (
        lambda: _SUB.bucket_by_max_tokens(16, buffer_size=None, max_len=9),
        1,
        BucketOptions,
        {
            "max_tokens": 16,
            "buffer_size": None,
            "min_len": 0,
            "max_len": 9,
            "include_padding": False,
        },
    ),
    (
        lambda: _SUB.pack(32, strategy="first_fit", oversize="drop"),
        1,
        PackOptions,
        {"max_tokens": 32, "strategy": "first_fit", "buffer_size": 1000, "oversize": "drop"},
    ),
    (lambda: _SUB.shuffle(8), 1, ShuffleOptions, {"buffer_size": 8}),
    (lambda: _SUB.shard(), 1, ShardOptions, {"equalize": None}),
    (lambda: _SUB.shard(equalize="pad"), 1, ShardOptions, {"equalize": "pad"}),
    (lambda: _SUB.count("c"), 1, NoOptions, {}),
    (lambda: _SUB.dispatch(), 1, NoOptions, {}),
]


@pytest.mark.parametrize(("build", "at", "cls", "old"), CASES)
def test_each_central_kind_carries_typed_options_equal_to_the_old_dict(
    build: Callable[[], cp.Pipeline], at: int, cls: type[Options], old: dict[str, Any]
) -> None:
    """The builder's spec holds the kind's options class; as a mapping it is
    the dict the builder recorded before (same keys, order and values)."""
    spec = build().stages[at]
    assert type(spec.options) is cls
    assert CENTRAL_OPTIONS[spec.kind] is cls
    assert spec.options == old
    assert list(spec.options.items()) == list(old.items())
    assert spec.options_as(cls) is spec.options
    for key, value in old.items():
        assert getattr(spec.options, key) is value or getattr(spec.options, key) == value


def test_mix_options_are_typed_and_hold_the_qualified_sub_plans() -> None:
    """``mix``'s options are :class:`MixOptions`; a nested mix's are too,
    with its stages' names qualified by both prefixes."""
    inner = P.mix({"a": P.from_iterable(DATA).shuffle(2)}, weights={"a": 1})
    spec = P.mix({"x": inner, "y": P.from_iterable(DATA)}, weights={"x": 1, "y": 3}).stages[0]
    o = spec.options_as(MixOptions)
    assert list(o) == ["pipelines", "weights", "stop"]
    assert o.weights == {"x": 1.0, "y": 3.0}
    assert o.stop == "all_exhausted"
    nested = o.pipelines["x"].stages[0]
    assert type(nested.options) is MixOptions
    names = [s.name for s in nested.options_as(MixOptions).pipelines["a"].stages]
    assert names == ["mix/x/mix/a/source", "mix/x/mix/a/shuffle_1"]


def test_every_registered_node_kind_has_an_options_class() -> None:
    """Each kind a central node class registers finds its typed options in
    one place: the per-item kinds in ``plan.kinds``, the others here."""
    missing = sorted(k for k in NODE_CLASSES if k not in CENTRAL_OPTIONS and k not in WORKER_KINDS)
    assert missing == []


def test_a_hand_made_spec_converts_its_dict_of_options() -> None:
    """A ``StageSpec`` given a dict holds the kind's typed options, equal to
    the builder's."""
    spec = StageSpec("batch", "b", "central", options={"batch_size": 2, "drop_last": False})
    assert type(spec.options) is BatchOptions
    assert spec.options_as(BatchOptions).batch_size == 2
    assert spec.options == _SUB.batch(2).stages[1].options


def test_a_hand_made_spec_with_an_unknown_option_is_refused() -> None:
    """An option the kind does not take is a ``PipelineError`` naming the
    stage, the option and the options the kind takes."""
    with pytest.raises(cp.PipelineError) as info:
        StageSpec("shuffle", "s", "central", options={"buffer_size": 4, "bufer": 1})
    assert str(info.value) == "stage 's': unknown option(s) ['bufer'] (its options: buffer_size)."
    with pytest.raises(cp.PipelineError, match=r"stage 'c': unknown option\(s\) \['x'\]"):
        StageSpec("count", "c", "central", options={"x": 1})


def test_a_hand_made_spec_missing_a_required_option_is_refused() -> None:
    """Leaving out an option the kind needs is a ``PipelineError`` naming the
    stage and the option, not a ``KeyError`` at iteration."""
    with pytest.raises(cp.PipelineError, match=r"stage 'b': .*drop_last"):
        StageSpec("batch", "b", "central", options={"batch_size": 2})


def test_reading_another_kinds_options_is_a_type_error() -> None:
    """``options_as`` with the wrong class names the stage and both classes."""
    spec = _SUB.shuffle(3).stages[1]
    msg = r"stage 'shuffle_1' \(shuffle\) has options of type ShuffleOptions, not BatchOptions"
    with pytest.raises(TypeError, match=msg):
        spec.options_as(BatchOptions)


def test_typed_options_are_frozen() -> None:
    """Options cannot change after the spec is built."""
    o = _SUB.batch(2).stages[1].options_as(BatchOptions)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        o.batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(("build", "at", "cls", "old"), CASES[4:])
def test_a_spec_pickles_and_unpickles_equal(
    build: Callable[[], cp.Pipeline], at: int, cls: type[Options], old: dict[str, Any]
) -> None:
    """A spec crosses a pickle with the same kind, name, options class and items."""
    spec = build().stages[at]
    back = pickle.loads(pickle.dumps(spec))
    assert (back.kind, back.name, back.placement) == (spec.kind, spec.name, spec.placement)
    assert type(back.options) is cls
    assert back.options == spec.options == old
    assert back.describe() == spec.describe()


def _pipes() -> list[cp.Pipeline]:
    a = (
        P.from_iterable(range(100))
        .shuffle(8)
        .shard(equalize="pad")
        .batch(4, drop_last=True)
        .count("c")
        .dispatch()
        .map(str)
        .collate(list)
    )
    b = (
        P.from_files(["/tmp/x.txt"])
        .read_lines()
        .bucket_by_max_tokens(16, max_len=8)
        .pack(32, strategy="first_fit", oversize="drop")
    )
    c = P.mix(
        {"x": P.from_iterable([1, 2]).shuffle(2), "y": P.from_iterable([3]).read_jsonl(field="t")},
        weights={"x": 1, "y": 2},
        stop="all_exhausted",
    ).shard()
    return [a, b, c]


#: describe() and fingerprint() of :func:`_pipes`, as they were with dict options.
EXPECTED = [
    (
        "source: iterable(mode='sequence') [source]\n"
        "shuffle_1: shuffle(buffer_size=8) [central]\n"
        "shard_2: shard(equalize='pad') [central]\n"
        "batch_3: batch(batch_size=4, drop_last=True) [central]\n"
        "c: count() [central]\n"
        "dispatch: dispatch() [dispatch]\n"
        "map_6: map(str, with_rng=False) [worker]\n"
        "collate_7: collate(list) [worker]",
        [
            ["source", "iterable"],
            ["shuffle_1", "shuffle"],
            ["shard_2", "shard"],
            ["batch_3", "batch"],
            ["c", "count"],
            ["dispatch", "dispatch"],
            ["map_6", "map"],
            ["collate_7", "collate"],
        ],
    ),
    (
        "files: files(paths=('/tmp/x.txt',)) [source]\n"
        "read_lines_1: read_lines(encoding='utf-8', errors='strict') [central]\n"
        "bucket_by_max_tokens_2: bucket_by_max_tokens(len, max_tokens=16, buffer_size=1000, "
        "min_len=0, max_len=8, include_padding=False) [central]\n"
        "pack_3: pack(len, max_tokens=32, strategy='first_fit', buffer_size=1000, "
        "oversize='drop') [central]",
        [
            ["files", "files"],
            ["read_lines_1", "read_lines"],
            ["bucket_by_max_tokens_2", "bucket_by_max_tokens"],
            ["pack_3", "pack"],
        ],
    ),
    (
        "mix: mix(pipelines={'x': Pipeline(iterable:mix/x/source -> shuffle:mix/x/shuffle_1), "
        "'y': Pipeline(iterable:mix/y/source -> read_jsonl:mix/y/read_jsonl_1)}, "
        "weights={'x': 1.0, 'y': 2.0}, stop='all_exhausted') [source]\n"
        "shard_1: shard(equalize=None) [central]",
        [
            ["mix", "mix"],
            ["mix/x/source", "iterable"],
            ["mix/x/shuffle_1", "shuffle"],
            ["mix/y/source", "iterable"],
            ["mix/y/read_jsonl_1", "read_jsonl"],
            ["shard_1", "shard"],
        ],
    ),
]


@pytest.mark.parametrize("at", range(len(EXPECTED)))
def test_describe_and_fingerprint_are_unchanged(at: int) -> None:
    """``describe()`` and ``fingerprint()`` print what they did with dict options."""
    pipe = _pipes()[at]
    assert (pipe.describe(), pipe.fingerprint()) == EXPECTED[at]


@pytest.mark.parametrize(
    ("kind", "options", "build"),
    [
        ("batch", {"batch_size": 0, "drop_last": False}, lambda: _SUB.batch(0, name="s")),
        ("shuffle", {"buffer_size": True}, lambda: _SUB.shuffle(True, name="s")),
        ("shard", {"equalize": "all"}, lambda: _SUB.shard(equalize="all", name="s")),  # type: ignore[arg-type]
        (
            "pack",
            {"max_tokens": 8, "strategy": "worst_fit", "buffer_size": 4, "oversize": "raise"},
            lambda: _SUB.pack(8, strategy="worst_fit", buffer_size=4, name="s"),  # type: ignore[arg-type]
        ),
        (
            "bucket_by_max_tokens",
            {
                "max_tokens": 8,
                "buffer_size": 0,
                "min_len": 0,
                "max_len": None,
                "include_padding": False,
            },
            lambda: _SUB.bucket_by_max_tokens(8, buffer_size=0, name="s"),
        ),
    ],
)
def test_a_hand_made_spec_with_a_bad_value_is_refused_in_the_builders_words(
    kind: str, options: dict[str, Any], build: Callable[[], cp.Pipeline]
) -> None:
    """A value the builder refuses is refused in a hand-made spec too, with
    the builder's exact message."""
    with pytest.raises(cp.PipelineError) as by_builder:
        build()
    with pytest.raises(cp.PipelineError) as by_hand:
        StageSpec(kind, "s", "central", options=options)
    assert str(by_hand.value) == str(by_builder.value)

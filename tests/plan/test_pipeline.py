"""The builder: immutability, default names, laziness, and construction errors."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torchdata.nodes as tn

import centralpipe as cp

P = cp.Pipeline


def _inc(x: int) -> int:
    return x + 1


def _keep(x: int) -> bool:
    return True


def _twice(x: int) -> list[int]:
    return [x, x]


def _src() -> cp.Pipeline:
    return P.from_iterable([1, 2, 3])


def _dispatched() -> cp.Pipeline:
    return _src().dispatch()


# -- immutability ------------------------------------------------------------------

BUILDERS: dict[str, Callable[[cp.Pipeline], cp.Pipeline]] = {
    "map": lambda p: p.map(_inc),
    "filter": lambda p: p.filter(_keep),
    "flat_map": lambda p: p.flat_map(_twice),
    "read_lines": lambda p: p.read_lines(),
    "batch": lambda p: p.batch(2),
    "bucket_by_max_tokens": lambda p: p.bucket_by_max_tokens(8),
    "shuffle": lambda p: p.shuffle(4),
    "count": lambda p: p.count(),
    "shard": lambda p: p.shard(),
    "dispatch": lambda p: p.dispatch(),
}


@pytest.mark.parametrize("add", list(BUILDERS.values()), ids=list(BUILDERS))
def test_builder_methods_return_a_new_pipeline(add: Callable[[cp.Pipeline], cp.Pipeline]) -> None:
    """Each builder method returns a new Pipeline and leaves the old one unchanged."""
    base = _src().map(_inc, name="first")
    before = base.stages
    new = add(base)
    assert new is not base
    assert base.stages == before
    assert len(base.stages) == 2
    assert new.stages[:2] == before
    assert len(new.stages) == 3


WORKER_BUILDERS: dict[str, Callable[[cp.Pipeline], cp.Pipeline]] = {
    "map": lambda p: p.map(_inc),
    "map-with-rng": lambda p: p.map(_inc, with_rng=True),
    "filter": lambda p: p.filter(_keep),
    "flat_map": lambda p: p.flat_map(_twice),
    "collate": lambda p: p.collate(),
}


@pytest.mark.parametrize("add", list(WORKER_BUILDERS.values()), ids=list(WORKER_BUILDERS))
def test_worker_builders_return_a_new_pipeline(add: Callable[[cp.Pipeline], cp.Pipeline]) -> None:
    """Worker stage methods also return a new Pipeline placed after dispatch."""
    base = _dispatched()
    new = add(base)
    assert len(base.stages) == 2
    assert len(new.stages) == 3
    assert new.stages[-1].placement == "worker"
    assert new.worker_stages == (new.stages[-1],)
    assert base.worker_stages == ()


def test_branching_from_one_pipeline() -> None:
    """Two pipelines built from one base are independent and share the base's stages."""
    base = _src()
    a = base.map(_inc)
    b = base.filter(_keep)
    assert [s.kind for s in a.stages] == ["iterable", "map"]
    assert [s.kind for s in b.stages] == ["iterable", "filter"]
    assert a.stages[0] is b.stages[0] is base.stages[0]


def test_stage_specs_are_frozen() -> None:
    """A stage spec cannot be changed after building."""
    import attrs

    spec = _src().map(_inc).stages[1]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


# -- names ---------------------------------------------------------------------------


def test_default_names_are_kind_and_index() -> None:
    """Unnamed stages are named `<kind>_<index>` by their position in the pipeline."""
    pipe = (
        _src()
        .map(_inc)
        .filter(_keep)
        .flat_map(_twice)
        .batch(2)
        .bucket_by_max_tokens(5)
        .shuffle(3)
        .count()
        .shard()
        .dispatch()
        .map(len)
        .filter(_keep)
        .flat_map(_twice)
        .collate()
    )
    assert [s.name for s in pipe.stages] == [
        "source",
        "map_1",
        "filter_2",
        "flat_map_3",
        "batch_4",
        "bucket_by_max_tokens_5",
        "shuffle_6",
        "count_7",
        "shard_8",
        "dispatch",
        "map_10",
        "filter_11",
        "flat_map_12",
        "collate_13",
    ]
    assert pipe.dispatch_name == "dispatch"
    assert [s.placement for s in pipe.stages] == ["source"] + ["central"] * 8 + ["dispatch"] + [
        "worker"
    ] * 4


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: P.from_iterable([1]), "source"),
        (lambda: P.from_files(["a.txt"]), "files"),
        (lambda: P.from_dataset([1, 2]), "dataset"),
        (lambda: P.from_node(tn.IterableWrapper([1])), "node"),
    ],
    ids=["iterable", "files", "dataset", "node"],
)
def test_default_source_names(make: Callable[[], cp.Pipeline], name: str) -> None:
    """Sources have fixed default names."""
    assert make().stages[0].name == name


def test_explicit_names_are_used() -> None:
    """`name=` overrides the default, for sources, central and worker stages."""
    pipe = (
        P.from_iterable([1], name="src")
        .map(_inc, name="tokenize")
        .count("seen")
        .dispatch(name="boundary")
        .map(_inc, name="pad")
    )
    assert [s.name for s in pipe.stages] == ["src", "tokenize", "seen", "boundary", "pad"]
    assert pipe.fingerprint() == [
        ["src", "iterable"],
        ["tokenize", "map"],
        ["seen", "count"],
        ["boundary", "dispatch"],
        ["pad", "map"],
    ]


def test_count_name_may_be_a_keyword() -> None:
    """`count(name=..., weight_fn=...)` works as the API documents it."""
    pipe = _src().count(name="pre_shard", weight_fn=len)
    assert pipe.stages[-1].name == "pre_shard"


def test_describe_and_repr_list_the_stages() -> None:
    """`describe()` and `repr()` name every stage in order."""
    pipe = _src().map(_inc).dispatch().collate()
    assert repr(pipe) == (
        "Pipeline(iterable:source -> map:map_1 -> dispatch:dispatch -> collate:collate_3)"
    )
    text = pipe.describe()
    assert "map_1: map(_inc" in text
    assert "[worker]" in text


def test_central_and_worker_split() -> None:
    """`central_stages` is the source and stages before dispatch; `worker_stages` after."""
    pipe = _src().map(_inc).dispatch().map(_inc)
    assert [s.name for s in pipe.central_stages] == ["source", "map_1"]
    assert [s.name for s in pipe.worker_stages] == ["map_3"]
    plain = _src().map(_inc)
    assert plain.central_stages == plain.stages
    assert plain.worker_stages == ()
    assert plain.dispatch_name is None


# -- nothing runs while building ---------------------------------------------------


def test_building_touches_no_file(tmp_path: Path) -> None:
    """A glob matching nothing builds fine and raises `PipelineError` when the Loader starts."""
    pipe = P.from_files(str(tmp_path / "*.missing")).read_lines().map(_inc)
    with pytest.raises(cp.PipelineError, match=r"stage 'files': the glob .* matches no file"):
        cp.Loader(pipe)


def test_missing_listed_file_fails_when_read(tmp_path: Path) -> None:
    """A listed path that does not exist builds and starts; reading it names the stage."""
    pipe = P.from_files([str(tmp_path / "missing.txt")]).read_lines()
    with cp.Loader(pipe) as loader, pytest.raises(FileNotFoundError) as info:
        list(loader)
    assert "(raised in central stage 'read_lines_1')" in info.value.__notes__


def test_building_calls_no_user_code() -> None:
    """Building never calls the source factory, the dataset, or any stage function."""
    calls: list[str] = []

    def factory() -> Iterator[int]:
        calls.append("factory")
        return iter([1])

    def fn(x: Any) -> Any:
        calls.append("fn")
        return x

    class Data:
        def __len__(self) -> int:
            calls.append("len")
            return 1

        def __getitem__(self, i: int) -> int:
            calls.append("getitem")
            return i

    P.from_iterable(factory).map(fn).filter(fn).flat_map(fn).count(weight_fn=fn)
    P.from_dataset(Data()).bucket_by_max_tokens(3, len_fn=fn).dispatch().map(fn).collate(fn)
    assert calls == []


def test_a_glob_resolves_when_the_loader_starts(tmp_path: Path) -> None:
    """Files created after building but before the Loader are found."""
    pipe = P.from_files(str(tmp_path / "*.txt")).read_lines()
    (tmp_path / "late.txt").write_text("x\ny\n")
    with cp.Loader(pipe) as loader:
        assert list(loader) == ["x", "y"]


# -- construction errors name the stage --------------------------------------------------

CENTRAL_AFTER_DISPATCH: dict[str, tuple[Callable[[cp.Pipeline], Any], str]] = {
    "batch": (lambda p: p.batch(2), "batch_2"),
    "shuffle": (lambda p: p.shuffle(4), "shuffle_2"),
    "count": (lambda p: p.count(), "count_2"),
    "count-named": (lambda p: p.count("progress"), "progress"),
    "shard": (lambda p: p.shard(), "shard_2"),
    "read_lines": (lambda p: p.read_lines(), "read_lines_2"),
    "bucket_by_max_tokens": (lambda p: p.bucket_by_max_tokens(8), "bucket_by_max_tokens_2"),
}


@pytest.mark.parametrize(
    ("add", "stage"), list(CENTRAL_AFTER_DISPATCH.values()), ids=list(CENTRAL_AFTER_DISPATCH)
)
def test_central_stage_after_dispatch(add: Callable[[cp.Pipeline], Any], stage: str) -> None:
    """A central stage after `dispatch()` raises `PipelineError` naming it and the fix."""
    with pytest.raises(cp.PipelineError, match=f"stage '{stage}'.*move it before .dispatch"):
        add(_dispatched())


def test_second_dispatch() -> None:
    """A second `dispatch()` raises `PipelineError` naming both."""
    with pytest.raises(cp.PipelineError, match=r"stage 'again': dispatch\(\) was already called"):
        _src().dispatch(name="first").map(_inc).dispatch(name="again")
    with pytest.raises(cp.PipelineError, match=r"'dispatch'.*at most one"):
        _dispatched().dispatch()


@pytest.mark.parametrize(
    "build",
    [
        lambda: _src().map(_inc, name="m").filter(_keep, name="m"),
        lambda: _src().map(_inc, name="source"),
        lambda: _src().count("m").dispatch().map(_inc, name="m"),
        lambda: _src().map(_inc, name="dispatch").dispatch(),
        lambda: _src().map(_inc).map(_inc, name="map_1"),
    ],
    ids=["two-central", "source-name", "central-and-worker", "dispatch-name", "default-name"],
)
def test_duplicate_names(build: Callable[[], Any]) -> None:
    """A stage name used twice raises `PipelineError` naming it."""
    with pytest.raises(cp.PipelineError, match=r"stage name '.+' is already used"):
        build()


NOT_CALLABLE: dict[str, tuple[Callable[[], Any], str]] = {
    "map": (lambda: _src().map(3), "map_1"),  # type: ignore[arg-type]
    "filter": (lambda: _src().filter(None), "filter_1"),  # type: ignore[arg-type]
    "flat_map": (lambda: _src().flat_map("x"), "flat_map_1"),  # type: ignore[arg-type]
    "worker-map": (lambda: _dispatched().map(3), "map_2"),  # type: ignore[arg-type]
    "worker-filter": (lambda: _dispatched().filter(1), "filter_2"),  # type: ignore[arg-type]
    "worker-flat_map": (lambda: _dispatched().flat_map([]), "flat_map_2"),  # type: ignore[arg-type]
    "collate": (lambda: _dispatched().collate(5), "collate_2"),  # type: ignore[arg-type]
    "named-map": (lambda: _src().map(3, name="tok"), "tok"),  # type: ignore[arg-type]
    "len_fn": (lambda: _src().bucket_by_max_tokens(8, len_fn=3), "bucket_by_max_tokens_1"),  # type: ignore[arg-type]
    "weight_fn": (lambda: _src().count(weight_fn=3), "count_1"),  # type: ignore[arg-type]
    "weight_fn-named": (lambda: _src().count("c", weight_fn="len"), "c"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize(("build", "stage"), list(NOT_CALLABLE.values()), ids=list(NOT_CALLABLE))
def test_non_callable_functions(build: Callable[[], Any], stage: str) -> None:
    """A non-callable function raises `PipelineError` naming the stage."""
    with pytest.raises(cp.PipelineError, match=f"stage '{stage}'.*must be callable"):
        build()


BAD_ARGS: dict[str, tuple[Callable[[], Any], str]] = {
    "batch(0)": (
        lambda: _src().batch(0),
        r"stage 'batch_1': `batch_size` must be an int >= 1, got 0",
    ),
    "batch(-1)": (lambda: _src().batch(-1), r"stage 'batch_1': `batch_size` .* got -1"),
    "batch('3')": (lambda: _src().batch("3"), r"stage 'batch_1': `batch_size` .* got '3'"),  # type: ignore[arg-type]
    "batch(True)": (lambda: _src().batch(True), r"stage 'batch_1': `batch_size` .* got True"),
    "batch(2.0)": (lambda: _src().batch(2.0), r"stage 'batch_1': `batch_size`"),  # type: ignore[arg-type]
    "batch-named": (lambda: _src().batch(0, name="b"), r"stage 'b': `batch_size`"),
    "bucket-max_tokens": (
        lambda: _src().bucket_by_max_tokens(0),
        r"stage 'bucket_by_max_tokens_1': `max_tokens` must be an int >= 1",
    ),
    "bucket-max_tokens-str": (
        lambda: _src().bucket_by_max_tokens("8"),  # type: ignore[arg-type]
        r"stage 'bucket_by_max_tokens_1': `max_tokens`",
    ),
    "bucket-buffer_size": (
        lambda: _src().bucket_by_max_tokens(8, buffer_size=0),
        r"stage 'bucket_by_max_tokens_1': `buffer_size` must be an int >= 1",
    ),
    "bucket-min_len": (
        lambda: _src().bucket_by_max_tokens(8, min_len=-1),
        r"stage 'bucket_by_max_tokens_1': `min_len` must be an int >= 0",
    ),
    "bucket-max_len-below-min_len": (
        lambda: _src().bucket_by_max_tokens(8, min_len=5, max_len=3, name="bk"),
        r"stage 'bk': `max_len` must be an int >= 5, got 3",
    ),
    "shuffle(0)": (
        lambda: _src().shuffle(0),
        r"stage 'shuffle_1': `buffer_size` must be an int >= 1",
    ),
    "shuffle(None)": (lambda: _src().shuffle(None), r"stage 'shuffle_1': `buffer_size`"),  # type: ignore[arg-type]
    "shard-equalize": (
        lambda: _src().shard(equalize="x"),  # type: ignore[arg-type]
        r"stage 'shard_1': `equalize` must be None, 'drop_last' or 'pad', got 'x'",
    ),
    "read_lines-encoding": (
        lambda: _src().read_lines(encoding="no-such-codec"),
        r"stage 'read_lines_1': unknown encoding 'no-such-codec'",
    ),
    "read_lines-utf-16": (
        lambda: _src().read_lines(encoding="utf-16"),
        r"stage 'read_lines_1': read_lines needs an ASCII-compatible text encoding .* "
        r"'utf-16' is not one",
    ),
    "read_lines-utf-32-be": (
        lambda: _src().read_lines(encoding="utf-32-be"),
        r"'utf-32-be' is not one",
    ),
    "read_lines-ebcdic": (lambda: _src().read_lines(encoding="cp037"), r"'cp037' is not one"),
    "read_lines-not-text": (
        lambda: _src().read_lines(encoding="rot13"),
        r"stage 'read_lines_1': 'rot13' is not a text encoding",
    ),
    "read_lines-encoding-type": (
        lambda: _src().read_lines(encoding=8, name="rl"),  # type: ignore[arg-type]
        r"stage 'rl': `encoding` must be a str",
    ),
    "collate-before-dispatch": (
        lambda: _src().collate(),
        r"stage 'collate_1': collate\(\) is a worker stage; call dispatch\(\) first",
    ),
    "with_rng-central": (
        lambda: _src().map(_inc, with_rng=True),
        r"stage 'map_1': with_rng=True is for worker maps",
    ),
}


@pytest.mark.parametrize(("build", "match"), list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_bad_stage_arguments(build: Callable[[], Any], match: str) -> None:
    """A bad stage argument raises `PipelineError` naming the stage, the argument and the value."""
    with pytest.raises(cp.PipelineError, match=match):
        build()


def _generator() -> Iterator[int]:
    yield 1


SOURCE_ERRORS: dict[str, tuple[Callable[[], Any], str]] = {
    "iterable-int": (
        lambda: P.from_iterable(5),
        r"stage 'source': from_iterable needs a list, .* got int",
    ),
    "iterable-generator": (
        lambda: P.from_iterable(_generator()),
        r"stage 'source': from_iterable got a one-shot iterator \(generator\)",
    ),
    "iterable-iterator": (
        lambda: P.from_iterable(iter([1, 2]), name="it"),
        r"stage 'it': from_iterable got a one-shot iterator",
    ),
    "iterable-str": (lambda: P.from_iterable("abc"), r"stage 'source': from_iterable got a str"),
    "iterable-bytes": (
        lambda: P.from_iterable(b"abc"),
        r"stage 'source': from_iterable got a bytes",
    ),
    "dataset-int": (
        lambda: P.from_dataset(5),
        r"stage 'dataset': from_dataset needs a map-style dataset .* got int",
    ),
    "dataset-generator": (
        lambda: P.from_dataset(_generator(), name="ds"),
        r"stage 'ds': from_dataset needs a map-style dataset",
    ),
    "node-list": (
        lambda: P.from_node([1, 2]),  # type: ignore[arg-type]
        r"stage 'node': from_node needs a torchdata.nodes.BaseNode, got list",
    ),
    "files-empty": (lambda: P.from_files([]), r"stage 'files': from_files got an empty list"),
    "files-int": (
        lambda: P.from_files(5),  # type: ignore[arg-type]
        r"stage 'files': from_files needs a glob string or a list of paths, got int",
    ),
    "files-bad-path": (
        lambda: P.from_files(["a.txt", 5], name="f"),  # type: ignore[list-item]
        r"stage 'f': paths must be str or os.PathLike, got 5",
    ),
}


@pytest.mark.parametrize(("build", "match"), list(SOURCE_ERRORS.values()), ids=list(SOURCE_ERRORS))
def test_bad_sources(build: Callable[[], Any], match: str) -> None:
    """A source that cannot be read again or is of the wrong kind raises `PipelineError`."""
    with pytest.raises(cp.PipelineError, match=match):
        build()


@pytest.mark.parametrize("name", ["", 3, None], ids=repr)
def test_bad_stage_names(name: Any) -> None:
    """A stage name must be a non-empty str."""
    with pytest.raises(cp.PipelineError, match="stage name must be a non-empty str"):
        if name is None:
            P.from_iterable([1], name=name)
        else:
            _src().map(_inc, name=name)


def test_pipeline_needs_a_source() -> None:
    """A Pipeline built without a source raises `PipelineError` saying how to start one."""
    with pytest.raises(cp.PipelineError, match="starts with a source"):
        cp.Pipeline(())


@pytest.mark.parametrize("bad", [None, [1, 2], "pipe"], ids=repr)
def test_loader_needs_a_pipeline(bad: Any) -> None:
    """`Loader` of something that is not a Pipeline raises `PipelineError`."""
    with pytest.raises(cp.PipelineError, match=r"Loader needs a centralpipe\.Pipeline"):
        cp.Loader(bad)


def test_loader_needs_a_loader_config() -> None:
    """`Loader(config=...)` of another type raises `PipelineError` naming `config`."""
    with pytest.raises(cp.PipelineError, match=r"`config` must be a centralpipe\.LoaderConfig"):
        cp.Loader(_src(), cp.WorkerConfig())  # type: ignore[arg-type]


def _local_map_pipeline() -> cp.Pipeline:
    def local(x: int) -> int:
        return x

    return _src().dispatch().map(local, name="local_map")


def test_unpicklable_worker_function_is_named_before_workers_start() -> None:
    """With spawn, a worker function that cannot be pickled is a `PipelineError` naming it."""
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=1, start_method="spawn"))
    with pytest.raises(cp.PipelineError, match=r"stage 'local_map'.*cannot be pickled"):
        cp.Loader(_local_map_pipeline(), config)


@pytest.mark.parametrize(
    "source", [{1, 2}, frozenset({1}), {"a": 1}], ids=["set", "frozenset", "dict"]
)
def test_from_iterable_refuses_unordered_collections(source: object) -> None:
    """Sets and dicts have no order that survives a process restart: refused."""
    with pytest.raises(cp.PipelineError, match="sorted"):
        cp.Pipeline.from_iterable(source)

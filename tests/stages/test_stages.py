"""Every stage kind: exact outputs (hand-computed) and exact resume at every k."""

from __future__ import annotations

import heapq
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchdata.nodes as tn
from torch.utils.data import Dataset

import centralpipe as cp
from centralpipe.stages import RunContext, build_central
from centralpipe.testing import _equal, assert_resumes_exactly, collect
from tests.conftest import CORPUS
from tests.support.configs import loader_config

CORPUS_LINES = ["alpha", "beta", "gamma", "naïve café", "Жёлтый 日本語 🙂", "", "last line"]


_config = loader_config


#: Central stages exactly at the consumer's position: one item per chunk.
LOCKSTEP = _config(buffer_size=1, chunk_size=1)


def _run(pipe: cp.Pipeline, config: cp.LoaderConfig | None = None) -> list[Any]:
    with cp.Loader(pipe, config) as loader:
        return collect(loader)


def _take_state(pipe: cp.Pipeline, k: int, config: cp.LoaderConfig) -> dict[str, Any]:
    """The checkpoint after the first ``k`` items."""
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        for _ in range(k):
            next(it)
        return loader.state_dict()


# -- stage functions (module level: picklable for workers) ---------------------


def _times10(x: int) -> int:
    return x * 10


def _is_even(x: int) -> bool:
    return x % 2 == 0


def _repeat(x: int) -> list[int]:
    """``x`` copies of ``x``: 0 gives nothing, 3 gives three outputs."""
    return [x] * x


def _noise(x: int, rng: torch.Generator) -> float:
    return x + torch.rand((), generator=rng).item()


def _pair(x: int) -> dict[str, Any]:
    return {"x": x, "v": torch.tensor([x, x + 1])}


# -- sources ---------------------------------------------------------------------


def _letters_factory() -> Iterator[str]:
    return iter(["a", "b", "c", "d"])


def _letters_generator() -> Iterator[str]:
    yield from "abcd"


class _Reiterable:
    """``iter()`` gives a fresh iterator each time; no ``len`` or indexing."""

    def __iter__(self) -> Iterator[str]:
        return iter(["a", "b", "c", "d"])


SOURCES: dict[str, tuple[Any, list[Any]]] = {
    "list": ([10, 20, 30, 40, 50], [10, 20, 30, 40, 50]),
    "range": (range(3, 12, 2), [3, 5, 7, 9, 11]),
    "tuple": (("x", ("y", 1), None), ["x", ("y", 1), None]),
    "empty-list": ([], []),
    "factory": (_letters_factory, ["a", "b", "c", "d"]),
    "generator-function": (_letters_generator, ["a", "b", "c", "d"]),
    "reiterable": (_Reiterable(), ["a", "b", "c", "d"]),
}


@pytest.mark.parametrize(("source", "expected"), list(SOURCES.values()), ids=list(SOURCES))
def test_from_iterable_outputs_and_resumes(source: Any, expected: list[Any]) -> None:
    """`from_iterable` yields the items in order and resumes exactly at every k."""
    pipe = cp.Pipeline.from_iterable(source)
    assert _run(pipe) == expected
    assert assert_resumes_exactly(pipe) == expected
    assert assert_resumes_exactly(pipe, LOCKSTEP, epochs=2) == expected * 2


@pytest.mark.parametrize(
    "source", [[1, 2, 3], _letters_factory, _Reiterable()], ids=["list", "factory", "reiterable"]
)
def test_from_iterable_is_read_again_each_epoch(source: Any) -> None:
    """A re-iterable source gives the same items in every epoch."""
    with cp.Loader(cp.Pipeline.from_iterable(source)) as loader:
        assert collect(loader) == collect(loader) == collect(loader)


def test_from_iterable_checkpoint_past_a_shrunken_source_fails() -> None:
    """Resuming a factory source at an index it no longer reaches raises `CheckpointError`."""
    items = [1, 2, 3, 4]

    def factory() -> Iterator[int]:
        return iter(list(items))

    pipe = cp.Pipeline.from_iterable(factory)
    state = _take_state(pipe, 3, LOCKSTEP)
    del items[1:]
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match="only 1 items"):
        loader.load_state_dict(state)


class _Squares(Dataset[torch.Tensor]):
    """A tiny map-style dataset of tensors ``[i, i*i]``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([i, i * i])


def test_from_dataset_outputs_and_resumes() -> None:
    """`from_dataset` yields `dataset[i]` in index order and resumes exactly."""
    pipe = cp.Pipeline.from_dataset(_Squares(6))
    expected = [torch.tensor([i, i * i]) for i in range(6)]
    assert _equal(_run(pipe), expected)
    assert _equal(assert_resumes_exactly(pipe), expected)
    assert _equal(assert_resumes_exactly(pipe, LOCKSTEP), expected)


def test_from_node_outputs_and_resumes() -> None:
    """`from_node` yields a torchdata node's items and resumes through its state."""
    pipe = cp.Pipeline.from_node(tn.IterableWrapper(["p", "q", "r", "s", "t"]))
    assert _run(pipe) == ["p", "q", "r", "s", "t"]
    assert_resumes_exactly(pipe)
    assert_resumes_exactly(pipe, LOCKSTEP, epochs=2)
    state = _take_state(pipe, 2, LOCKSTEP)
    assert state["central"]["node"] == {"node": {"_num_yielded": 2}}


def test_a_node_serves_one_live_loader_at_a_time() -> None:
    """A torchdata node is an iterator: a second live Loader over it is refused,
    and allowed again once the first is closed."""
    pipe = cp.Pipeline.from_node(tn.IterableWrapper(range(6)))
    with cp.Loader(pipe, LOCKSTEP) as a:
        assert list(a) == list(range(6))
        with pytest.raises(cp.PipelineError, match="another live Loader"):
            cp.Loader(pipe, LOCKSTEP)
    with cp.Loader(pipe, LOCKSTEP) as b:
        assert list(b) == list(range(6))


def test_two_loaders_of_one_iterable_pipeline_are_independent() -> None:
    """Loaders built from one `from_iterable` pipeline each have their own position."""
    pipe = cp.Pipeline.from_iterable(_letters_factory).shuffle(2)
    with cp.Loader(pipe, LOCKSTEP) as a, cp.Loader(pipe, LOCKSTEP) as b:
        ia, ib = iter(a), iter(b)
        first = [next(ia), next(ib), next(ia), next(ib)]
    assert first[0::2] == first[1::2]


def test_from_node_of_a_torchdata_batcher() -> None:
    """A composed torchdata graph is a source; its output feeds later stages."""
    node = tn.Batcher(tn.IterableWrapper(range(7)), batch_size=3, drop_last=False)
    pipe = cp.Pipeline.from_node(node).map(sum)
    assert _run(pipe) == [3, 12, 6]
    assert_resumes_exactly(pipe, LOCKSTEP)


# -- files and lines -----------------------------------------------------------------


def test_from_files_yields_paths_in_given_order(tmp_corpus: list[str]) -> None:
    """A list of paths is kept in the given order; a glob is sorted."""
    reversed_paths = list(reversed(tmp_corpus))
    assert _run(cp.Pipeline.from_files(reversed_paths)) == reversed_paths
    glob = str(Path(tmp_corpus[0]).parent / "*.txt")
    assert _run(cp.Pipeline.from_files(glob)) == tmp_corpus
    assert_resumes_exactly(cp.Pipeline.from_files(glob))


@pytest.mark.parametrize("how", ["list", "glob", "pathlike"])
def test_read_lines_over_the_corpus(tmp_corpus: list[str], how: str) -> None:
    """`read_lines` splits on `\\n`, strips one `\\r`, keeps empty and unterminated lines."""
    paths: Any = {
        "list": tmp_corpus,
        "glob": str(Path(tmp_corpus[0]).parent / "*.txt"),
        "pathlike": [Path(p) for p in tmp_corpus],
    }[how]
    pipe = cp.Pipeline.from_files(paths).read_lines()
    assert _run(pipe) == CORPUS_LINES
    assert_resumes_exactly(pipe)
    assert_resumes_exactly(pipe, LOCKSTEP, epochs=2)


#: (file index, byte offset of the next line) after each line, hand-computed:
#: b: "alpha\n" 6, "beta\n" 11, "gamma" 16; c: "naïve café\r\n" 14 bytes,
#: "Жёлтый 日本語 🙂\r\n" 29 (12 + 1 + 9 + 1 + 4 + 2), "\r\n" 2, "last line\r\n" 11.
OFFSETS = [(1, 6), (1, 11), (1, 16), (2, 14), (2, 43), (2, 45), (2, 56)]


class _CountingFile:
    """A binary file that counts the bytes read as lines (``lines``) and otherwise
    (``other``: the resume check reads the byte before the offset)."""

    def __init__(self, path: str, mode: str, counter: dict[str, int]) -> None:
        self._f = open(path, mode)  # noqa: SIM115 - closed by close()
        self._counter = counter

    def readline(self) -> bytes:
        line = self._f.readline()
        self._counter["lines"] += len(line)
        return line

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._counter["other"] += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def close(self) -> None:
        self._f.close()


def test_read_lines_resumes_by_byte_offset_without_rereading(
    tmp_corpus: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint holds (file, byte offset); resuming reads only the lines after it."""
    import centralpipe.stages.files as files_module

    assert len(CORPUS["c_unicode_crlf.txt"]) == 56
    sizes = [len(CORPUS[Path(p).name]) for p in tmp_corpus]
    pipe = cp.Pipeline.from_files(tmp_corpus).read_lines()
    for k in range(len(CORPUS_LINES) + 1):
        state = _take_state(pipe, k, LOCKSTEP)
        line_state = state["central"]["read_lines_1"]
        file_index = state["central"]["files"]["index"]
        if k == 0:
            assert line_state == {"path": None, "offset": 0}
            remaining = sum(sizes)
        else:
            i, offset = OFFSETS[k - 1]
            # Named relative to the files' root (their common parent): the data may move.
            assert line_state == {"path": Path(tmp_corpus[i]).name, "offset": offset}
            assert file_index == i + 1
            remaining = sizes[i] - offset + sum(sizes[file_index:])
        counter = {"lines": 0, "other": 0}
        monkeypatch.setattr(
            files_module, "open", lambda p, m, c=counter: _CountingFile(p, m, c), raising=False
        )
        with cp.Loader(pipe, LOCKSTEP) as loader:
            loader.load_state_dict(state)
            assert collect(loader) == CORPUS_LINES[k:]
        monkeypatch.undo()
        assert counter["lines"] == remaining, f"k={k}: read {counter}, expected {remaining}"
        assert counter["other"] <= 1, f"k={k}: read {counter}"


def test_read_lines_resumes_at_the_end_of_an_unterminated_file(tmp_path: Path) -> None:
    """A checkpoint after a last line without a newline resumes (offset = file size)."""
    path = tmp_path / "x.txt"
    path.write_bytes(b"one\ntwo")
    pipe = cp.Pipeline.from_files([str(path)]).read_lines()
    state = _take_state(pipe, 2, LOCKSTEP)
    assert state["central"]["read_lines_1"] == {"path": "x.txt", "offset": 7}
    with cp.Loader(pipe, LOCKSTEP) as loader:
        loader.load_state_dict(state)
        assert collect(loader) == []


def test_read_lines_refuses_an_offset_inside_a_line(tmp_path: Path) -> None:
    """A file changed so that the offset falls inside a line is a `CheckpointError`
    (a change of size is refused earlier, by the files stage)."""
    path = tmp_path / "x.txt"
    path.write_bytes(b"one\ntwo\nthree\n")
    pipe = cp.Pipeline.from_files([str(path)]).read_lines()
    state = _take_state(pipe, 1, LOCKSTEP)
    path.write_bytes(b"on\netwo\nthree\n")  # same size, line starts moved
    with (
        cp.Loader(pipe) as loader,
        pytest.raises(cp.CheckpointError, match="not the start of a line"),
    ):
        loader.load_state_dict(state)


def test_read_lines_invalid_utf8_names_file_and_stage(tmp_path: Path) -> None:
    """Undecodable bytes raise `UnicodeDecodeError` with notes naming the file and stage."""
    path = tmp_path / "bad.txt"
    path.write_bytes(b"ok\nbad \xff\xfe here\nafter\n")
    pipe = cp.Pipeline.from_files([str(path)]).read_lines()
    got: list[str] = []
    with cp.Loader(pipe) as loader, pytest.raises(UnicodeDecodeError) as info:
        for line in loader:
            got.append(line)
    assert got == ["ok"]
    notes = "\n".join(info.value.__notes__)
    assert str(path) in notes
    assert "byte offset 3" in notes
    assert "read_lines_1" in notes


def test_read_lines_other_encoding(tmp_path: Path) -> None:
    """`encoding=` decodes each line with that codec."""
    path = tmp_path / "latin.txt"
    path.write_bytes("café\nnaïve\n".encode("latin-1"))
    pipe = cp.Pipeline.from_files([str(path)]).read_lines(encoding="latin-1")
    assert _run(pipe) == ["café", "naïve"]


def test_read_lines_detects_a_truncated_file(tmp_corpus: list[str]) -> None:
    """A file shorter than the checkpoint's offset is a `CheckpointError` at load."""
    pipe = cp.Pipeline.from_files(tmp_corpus).read_lines()
    state = _take_state(pipe, 5, LOCKSTEP)
    Path(tmp_corpus[2]).write_bytes(b"short\n")
    with cp.Loader(pipe) as loader, pytest.raises(cp.CheckpointError, match="changed"):
        loader.load_state_dict(state)


def test_from_files_detects_a_changed_file_list(tmp_corpus: list[str]) -> None:
    """A checkpoint of another file list is a `CheckpointError` naming the stage."""
    state = _take_state(cp.Pipeline.from_files(tmp_corpus).read_lines(), 2, LOCKSTEP)
    other = cp.Pipeline.from_files(tmp_corpus[:2]).read_lines()
    with cp.Loader(other) as loader, pytest.raises(cp.CheckpointError, match="'files'"):
        loader.load_state_dict(state)


# -- map, filter, flat_map -----------------------------------------------------------


TRANSFORMS: dict[str, tuple[Callable[[cp.Pipeline], cp.Pipeline], list[Any]]] = {
    "map": (lambda p: p.map(_times10), [0, 10, 20, 30, 40, 50]),
    "filter": (lambda p: p.filter(_is_even), [0, 2, 4]),
    "flat_map": (lambda p: p.flat_map(_repeat), [1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5]),
    "map-filter": (lambda p: p.map(_times10).filter(_is_even), [0, 10, 20, 30, 40, 50]),
}


@pytest.mark.parametrize(("add", "expected"), list(TRANSFORMS.values()), ids=list(TRANSFORMS))
@pytest.mark.parametrize("where", ["central", "worker"])
def test_transforms_outputs_and_resume(
    add: Callable[[cp.Pipeline], cp.Pipeline], expected: list[Any], where: str
) -> None:
    """map/filter/flat_map give the expected items, central or in workers, and resume."""
    pipe = cp.Pipeline.from_iterable(range(6))
    pipe = add(pipe) if where == "central" else add(pipe.dispatch())
    assert _run(pipe) == expected
    assert assert_resumes_exactly(pipe) == expected
    assert assert_resumes_exactly(pipe, LOCKSTEP) == expected


def test_central_flat_map_checkpoint_inside_one_inputs_outputs() -> None:
    """A checkpoint between two outputs of one input keeps the rest as pending state."""
    calls: list[int] = []

    def repeat(x: int) -> list[int]:
        calls.append(x)
        return [x] * x

    pipe = cp.Pipeline.from_iterable([3, 1, 2]).flat_map(repeat)
    state = _take_state(pipe, 1, LOCKSTEP)
    assert state["central"]["flat_map_1"] == {"pending": [3, 3]}
    calls.clear()
    with cp.Loader(pipe, LOCKSTEP) as loader:
        loader.load_state_dict(state)
        assert collect(loader) == [3, 3, 1, 2, 2]
    assert calls == [1, 2], "fn is not called again for the input being split"


def test_worker_flat_map_checkpoint_inside_one_inputs_outputs() -> None:
    """A worker flat_map checkpoint mid-input records how many outputs were delivered."""
    pipe = cp.Pipeline.from_iterable([3, 1, 2]).dispatch().flat_map(_repeat)
    state = _take_state(pipe, 2, _config())
    flight = state["in_flight"]["dispatch"]
    assert flight["first_seq"] == 0
    assert flight["items"] == [3, 1, 2]
    assert flight["skip_outputs"] == 2
    assert_resumes_exactly(pipe)


# -- batch ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "size", "drop_last", "expected"),
    [
        (7, 3, False, [[0, 1, 2], [3, 4, 5], [6]]),
        (7, 3, True, [[0, 1, 2], [3, 4, 5]]),
        (6, 3, False, [[0, 1, 2], [3, 4, 5]]),
        (6, 3, True, [[0, 1, 2], [3, 4, 5]]),
        (2, 3, False, [[0, 1]]),
        (2, 3, True, []),
        (0, 3, False, []),
        (3, 1, False, [[0], [1], [2]]),
    ],
    ids=lambda v: repr(v).replace(" ", "") if isinstance(v, list) else str(v),
)
def test_batch(n: int, size: int, drop_last: bool, expected: list[list[int]]) -> None:
    """`batch` makes lists of `batch_size`; the short last one is kept unless `drop_last`."""
    pipe = cp.Pipeline.from_iterable(range(n)).batch(size, drop_last=drop_last)
    assert _run(pipe) == expected
    assert assert_resumes_exactly(pipe) == expected
    assert assert_resumes_exactly(pipe, LOCKSTEP) == expected


def test_batch_then_collate_makes_tensors() -> None:
    """`collate()` with no function applies `default_collate` to each batch."""
    pipe = cp.Pipeline.from_iterable(range(5)).map(_pair).batch(2).dispatch().collate()
    out = _run(pipe)
    assert len(out) == 3
    assert torch.equal(out[0]["x"], torch.tensor([0, 1]))
    assert torch.equal(out[0]["v"], torch.tensor([[0, 1], [1, 2]]))
    assert torch.equal(out[2]["v"], torch.tensor([[4, 5]]))
    assert_resumes_exactly(pipe)


# -- bucket_by_max_tokens ------------------------------------------------------------


def _reference_buckets(
    items: list[Any],
    max_tokens: int,
    *,
    len_fn: Callable[[Any], int] = len,
    buffer_size: int | None = 1000,
    min_len: int = 0,
    max_len: int | None = None,
    include_padding: bool = False,
) -> list[list[Any]]:
    """torchdata's MaxTokenBucketizer, written plainly: a heap of (len, arrival, item);
    pop the shortest whenever the heap reaches buffer_size (then drain); a batch
    goes out when adding the popped item would exceed max_tokens."""
    heap: list[tuple[int, int, Any]] = []
    out: list[list[Any]] = []
    batch: list[Any] = []
    state = {"tokens": 0, "longest": 0}

    def pop() -> None:
        nonlocal batch
        length, _, item = heapq.heappop(heap)
        if include_padding:
            longest = max(state["longest"], length)
            tokens = (len(batch) + 1) * longest
        else:
            longest = max(state["longest"], length)
            tokens = state["tokens"] + length
        if tokens > max_tokens:
            if batch:
                out.append(batch)
            batch = [item]
            state["tokens"] = state["longest"] = length
        else:
            batch.append(item)
            state["tokens"], state["longest"] = tokens, longest

    for arrival, item in enumerate(items):
        length = len_fn(item)
        if length < min_len or (max_len is not None and length > max_len):
            continue
        heapq.heappush(heap, (length, arrival, item))
        if buffer_size is not None and len(heap) == buffer_size:
            pop()
    while heap:
        pop()
    if batch:
        out.append(batch)
    return out


WORDS = [
    "aaaa",
    "b",
    "cc",
    "dddddd",
    "ee",
    "f",
    "ggg",
    "hhhhhhhhhhhh",
    "",
    "ii",
    "jjjjj",
    "kk",
    "l",
]


def test_reference_bucketizer_hand_computed() -> None:
    """The reference implementation itself matches a hand-worked example."""
    items = ["aaa", "b", "cc", "dddd", "e"]
    # buffer 2: push aaa,b -> pop b; push cc -> pop cc (b+cc=3); push dddd -> pop aaa (6 > 4:
    # emit [b, cc]); push e -> pop e (aaa+e=4); drain dddd (8 > 4: emit [aaa, e]); end [dddd].
    expected = [["b", "cc"], ["aaa", "e"], ["dddd"]]
    assert _reference_buckets(items, 4, buffer_size=2) == expected
    pipe = cp.Pipeline.from_iterable(items).bucket_by_max_tokens(4, buffer_size=2)
    assert _run(pipe) == expected


BUCKET_CASES: dict[str, dict[str, Any]] = {
    "defaults": {"max_tokens": 10},
    "buffer-1": {"max_tokens": 8, "buffer_size": 1},
    "buffer-3": {"max_tokens": 8, "buffer_size": 3},
    "unlimited": {"max_tokens": 8, "buffer_size": None},
    "padding": {"max_tokens": 9, "buffer_size": 4, "include_padding": True},
    "padding-unlimited": {"max_tokens": 12, "buffer_size": None, "include_padding": True},
    "min-max-len": {"max_tokens": 7, "buffer_size": 5, "min_len": 1, "max_len": 5},
    "longer-than-max": {"max_tokens": 4, "buffer_size": 4},
    "max-tokens-1": {"max_tokens": 1, "buffer_size": 2},
}


@pytest.mark.parametrize("options", list(BUCKET_CASES.values()), ids=list(BUCKET_CASES))
def test_bucket_by_max_tokens_matches_reference(options: dict[str, Any]) -> None:
    """`bucket_by_max_tokens` equals the reference MaxTokenBucketizer and resumes exactly."""
    options = dict(options)
    max_tokens = options.pop("max_tokens")
    expected = _reference_buckets(WORDS, max_tokens, **options)
    pipe = cp.Pipeline.from_iterable(WORDS).bucket_by_max_tokens(max_tokens, **options)
    assert _run(pipe) == expected
    assert assert_resumes_exactly(pipe) == expected
    assert assert_resumes_exactly(pipe, LOCKSTEP) == expected


def test_bucket_emits_long_items_alone_and_respects_the_budget() -> None:
    """Every batch fits `max_tokens` except a single item longer than it, emitted alone."""
    out = _run(cp.Pipeline.from_iterable(WORDS).bucket_by_max_tokens(4, buffer_size=4))
    assert sorted(w for b in out for w in b) == sorted(WORDS)
    for batch in out:
        total = sum(len(w) for w in batch)
        assert total <= 4 or len(batch) == 1, batch
    assert ["hhhhhhhhhhhh"] in out
    assert ["dddddd"] in out


def test_bucket_min_max_len_drop_items() -> None:
    """Items shorter than `min_len` or longer than `max_len` are dropped."""
    out = _run(cp.Pipeline.from_iterable(WORDS).bucket_by_max_tokens(100, min_len=2, max_len=4))
    assert sorted(w for b in out for w in b) == sorted(w for w in WORDS if 2 <= len(w) <= 4)


def test_bucket_with_len_fn_and_unorderable_items() -> None:
    """`len_fn` sets the length; equal lengths keep arrival order (items need not order)."""
    items = [{"n": 2, "id": i} for i in range(5)] + [{"n": 1, "id": 9}]
    pipe = cp.Pipeline.from_iterable(items).bucket_by_max_tokens(
        4, len_fn=_dict_len, buffer_size=None
    )
    out = _run(pipe)
    assert [[d["id"] for d in b] for b in out] == [[9, 0], [1, 2], [3, 4]]
    assert_resumes_exactly(pipe, LOCKSTEP)


def _dict_len(d: dict[str, int]) -> int:
    return d["n"]


# -- shuffle ---------------------------------------------------------------------------


def _shuffled(n: int, buffer: int, seed: int, epochs: int = 1) -> list[list[int]]:
    with cp.Loader(cp.Pipeline.from_iterable(range(n)).shuffle(buffer), _config(seed=seed)) as ld:
        return [collect(ld) for _ in range(epochs)]


def test_shuffle_is_a_seeded_per_epoch_permutation() -> None:
    """Each epoch is a permutation; same seed and epoch repeat, another epoch or seed differs."""
    first = _shuffled(50, 10, seed=1, epochs=2)
    again = _shuffled(50, 10, seed=1, epochs=2)
    other_seed = _shuffled(50, 10, seed=2, epochs=1)
    for order in (*first, *other_seed):
        assert sorted(order) == list(range(50))
    assert first == again
    assert first[0] != first[1], "another epoch gives another order"
    assert first[0] != other_seed[0], "another seed gives another order"
    assert first[0] != list(range(50))


def test_shuffle_buffer_of_one_keeps_order() -> None:
    """`shuffle(1)` cannot move anything."""
    assert _shuffled(10, 1, seed=3) == [list(range(10))]


def test_shuffle_buffer_bounds_displacement() -> None:
    """An item comes out no earlier than `buffer_size - 1` places before its input index."""
    (order,) = _shuffled(200, 5, seed=0)
    for position, item in enumerate(order):
        assert item <= position + 4


@pytest.mark.parametrize("buffer", [1, 3, 64], ids=str)
def test_shuffle_resumes_exactly(buffer: int) -> None:
    """Shuffle's buffer and generator state resume the same permutation, across epochs."""
    pipe = cp.Pipeline.from_iterable(range(12)).shuffle(buffer)
    assert_resumes_exactly(pipe, _config(seed=5), epochs=2)
    assert_resumes_exactly(pipe, LOCKSTEP)


# -- count ------------------------------------------------------------------------------


def test_count_passes_items_and_counts() -> None:
    """`count` passes items through; its state is `{"items", "weight"}`."""
    pipe = cp.Pipeline.from_iterable(["ab", "c", "defg"]).count("seen")
    with cp.Loader(pipe) as loader:
        assert collect(loader) == ["ab", "c", "defg"]
        assert loader.query("seen") == {"items": 3, "weight": 3}
    assert_resumes_exactly(pipe, LOCKSTEP)


def test_count_weight_fn_sums_weights() -> None:
    """With `weight_fn`, `weight` sums it: batch sizes of batches, here."""
    pipe = cp.Pipeline.from_iterable(range(7)).batch(3).count("c", weight_fn=len)
    with cp.Loader(pipe) as loader:
        assert collect(loader) == [[0, 1, 2], [3, 4, 5], [6]]
        assert loader.query("c") == {"items": 3, "weight": 7}
    assert_resumes_exactly(pipe, LOCKSTEP)
    state = _take_state(pipe, 2, LOCKSTEP)
    assert state["central"]["c"] == {"items": 2, "weight": 6}


def test_count_default_name() -> None:
    """An unnamed `count()` is named `count_<index>`."""
    with cp.Loader(cp.Pipeline.from_iterable([1, 2]).map(_times10).count()) as loader:
        collect(loader)
        assert loader.query("count_2") == {"items": 2, "weight": 2}


# -- shard --------------------------------------------------------------------------------


def _shards(n: int, world_size: int, equalize: str | None) -> list[list[int]]:
    pipe = cp.Pipeline.from_iterable(range(n)).shard(equalize=equalize)  # type: ignore[arg-type]
    out = []
    for rank in range(world_size):
        with cp.Loader(pipe, _config(rank=rank, world_size=world_size)) as loader:
            got = collect(loader)
            assert len(loader) == len(got), "len() is each rank's count"
        out.append(got)
    return out


def test_shard_hand_computed() -> None:
    """10 items on 4 ranks: plain, drop_last and pad, worked out by hand."""
    assert _shards(10, 4, None) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert _shards(10, 4, "drop_last") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _shards(10, 4, "pad") == [[0, 4, 8], [1, 5, 9], [2, 6, 8], [3, 7, 9]]


@pytest.mark.parametrize("n", [0, 1, 5, 8, 11], ids=lambda n: f"n={n}")
@pytest.mark.parametrize("world_size", [1, 2, 3, 4], ids=lambda w: f"w={w}")
def test_shard_properties(n: int, world_size: int) -> None:
    """Plain shards are disjoint and complete; equalized ones have equal lengths."""
    plain = _shards(n, world_size, None)
    assert sorted(x for s in plain for x in s) == list(range(n))
    for rank, shard in enumerate(plain):
        assert shard == list(range(rank, n, world_size))
    full_rounds = n // world_size * world_size
    dropped = _shards(n, world_size, "drop_last")
    assert all(len(s) == n // world_size for s in dropped)
    assert sorted(x for s in dropped for x in s) == list(range(full_rounds))
    padded = _shards(n, world_size, "pad")
    assert all(len(s) == -(-n // world_size) for s in padded)
    last_round = list(range(full_rounds, n))
    for rank, shard in enumerate(padded):
        expected = list(range(rank, full_rounds, world_size))
        if last_round:
            expected.append(last_round[rank % len(last_round)])
        assert shard == expected
    assert set(x for s in padded for x in s) == set(range(n)), "pad drops nothing"


@pytest.mark.parametrize("equalize", [None, "drop_last", "pad"], ids=str)
@pytest.mark.parametrize(("rank", "world_size"), [(0, 3), (2, 3), (1, 4)], ids=str)
def test_shard_resumes_exactly(equalize: str | None, rank: int, world_size: int) -> None:
    """Every rank resumes its shard exactly at every k."""
    pipe = (
        cp.Pipeline.from_iterable(range(11)).shuffle(4).count("pre").shard(equalize=equalize)  # type: ignore[arg-type]
    )
    assert_resumes_exactly(pipe, _config(rank=rank, world_size=world_size), epochs=2)
    assert_resumes_exactly(pipe, _config(rank=rank, world_size=world_size, buffer_size=1))


def test_shard_records_the_pre_shard_index() -> None:
    """The checkpoint records the central (pre-shard) index of the delivered position."""
    pipe = cp.Pipeline.from_iterable(range(10)).shard()
    config = _config(rank=1, world_size=3, buffer_size=1, chunk_size=1)
    state = _take_state(pipe, 2, config)  # items 1 and 4 delivered
    assert state["central"]["shard_1"]["index"] == 5
    assert state["position"]["pre_shard_index"] == 5


# -- dispatch and worker stages inline ---------------------------------------------------


def test_with_rng_is_reproducible() -> None:
    """`map(fn, with_rng=True)` gives the same output on every run, differing per item."""
    pipe = cp.Pipeline.from_iterable(range(20)).dispatch().map(_noise, with_rng=True)
    first, second = _run(pipe), _run(pipe)
    assert first == second
    assert [int(x) for x in first] == list(range(20))
    assert len({x - int(x) for x in first}) == 20, "each item gets its own stream"
    assert _run(pipe, _config(seed=1)) != first, "another seed, other draws"
    assert_resumes_exactly(pipe)


def test_with_rng_same_across_worker_counts() -> None:
    """The rng depends on (seed, epoch, seq), not on which worker ran the item."""
    pipe = cp.Pipeline.from_iterable(range(20)).dispatch().map(_noise, with_rng=True)
    assert _run(pipe, _config(num_workers=2, chunk_size=3)) == _run(pipe)


def test_with_rng_differs_per_epoch() -> None:
    """Each epoch draws new random numbers for the same items."""
    pipe = cp.Pipeline.from_iterable(range(5)).dispatch().map(_noise, with_rng=True)
    with cp.Loader(pipe) as loader:
        assert collect(loader) != collect(loader)


def test_dispatch_without_worker_stages_passes_items() -> None:
    """`dispatch()` alone changes nothing in the output."""
    pipe = cp.Pipeline.from_iterable(range(9)).batch(4).dispatch()
    assert _run(pipe) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]
    assert_resumes_exactly(pipe)


def test_mixed_pipeline_resumes_into_workers() -> None:
    """A mixed pipeline checkpointed inline resumes exactly with 2 workers."""
    pipe = (
        cp.Pipeline.from_iterable(range(40))
        .shuffle(8)
        .count("c")
        .batch(3)
        .dispatch()
        .map(sum)
        .flat_map(_repeat)
        .filter(_is_even)
    )
    ks = [0, 1, 5, 17, 60]
    full = assert_resumes_exactly(pipe, _config(buffer_size=5), ks=ks)
    assert (
        assert_resumes_exactly(
            pipe, _config(buffer_size=5), resume_config=_config(num_workers=2), ks=ks
        )
        == full
    )


# -- the central stages as plain torchdata nodes -----------------------------------------


def test_central_chain_runs_under_torchdata_loader() -> None:
    """The built central chain is a `BaseNode`: `torchdata.nodes.Loader` iterates and resumes it."""
    pipe = cp.Pipeline.from_iterable(range(10)).shuffle(4).map(_times10).batch(3).count("c")

    def root() -> tn.BaseNode[Any]:
        return build_central(pipe.central_stages, RunContext(seed=1, epoch=1))[-1]

    full = list(tn.Loader(root()))
    with cp.Loader(pipe, _config(seed=1)) as loader:
        assert collect(loader) == full, "same stream as centralpipe's own Loader"
    assert sorted(x for b in full for x in b) == [x * 10 for x in range(10)]
    for k in range(len(full) + 1):
        loader = tn.Loader(root())
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        buffer = io.BytesIO()
        torch.save(loader.state_dict(), buffer)
        buffer.seek(0)
        # torchdata restarts a loader resumed at the end unless told not to.
        resumed = tn.Loader(root(), restart_on_stop_iteration=False)
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
        assert head + list(resumed) == full, f"k={k}"


def test_central_nodes_nest_state_under_source_key() -> None:
    """Each node's torchdata state is its own fields plus its source's under `source`."""
    pipe = cp.Pipeline.from_iterable([1, 2, 3]).count("c")
    node = build_central(pipe.central_stages, RunContext())[-1]
    node.reset()
    next(node)
    assert node.state_dict() == {"items": 1, "weight": 1, "source": {"index": 1}}


# -- the resume checker itself ----------------------------------------------------------


class _Forgetful(tn.BaseNode[int]):
    """Yields 0..4 but forgets its position: every reset starts again at 0."""

    def __init__(self) -> None:
        super().__init__()
        self._i = 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        self._i = 0

    def next(self) -> int:
        if self._i >= 5:
            raise StopIteration
        self._i += 1
        return self._i - 1

    def get_state(self) -> dict[str, Any]:
        return {}


def test_resume_checker_reports_the_first_difference() -> None:
    """A source that does not resume fails the check, naming k, index, expected and got."""
    pipe = cp.Pipeline.from_node(_Forgetful())
    with pytest.raises(AssertionError) as info:
        assert_resumes_exactly(pipe, LOCKSTEP, ks=[0, 2])
    text = str(info.value)
    assert "k=2" in text
    assert "first difference at index 2 (0 after the resume): expected 2, got 0" in text
    assert "has 5 items, head + resumed rest has 7" in text


def test_resume_checker_rejects_bad_arguments() -> None:
    """A k outside the run or `epochs < 1` is a `ValueError`."""
    pipe = cp.Pipeline.from_iterable([1, 2])
    with pytest.raises(ValueError, match=r"k=3 is outside 0\.\.2"):
        assert_resumes_exactly(pipe, ks=[3])
    with pytest.raises(ValueError, match="`epochs` must be >= 1"):
        assert_resumes_exactly(pipe, epochs=0)


def test_resume_checker_default_ks() -> None:
    """Every k up to 200 items; above that about 60, always with 0, 1, n-1 and n."""
    from centralpipe.testing import _default_ks

    assert _default_ks(0) == [0]
    assert _default_ks(200) == list(range(201))
    spread = _default_ks(1000)
    assert {0, 1, 999, 1000} <= set(spread)
    assert 55 <= len(spread) <= 65
    assert spread == sorted(set(spread))


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (torch.tensor([1, 2]), torch.tensor([1, 2]), True),
        (torch.tensor([1, 2]), torch.tensor([1, 3]), False),
        (torch.tensor([1, 2]), torch.tensor([1.0, 2.0]), False),
        (torch.tensor([1, 2]), [1, 2], False),
        (
            [torch.tensor(1), {"a": (1, torch.tensor([2]))}],
            [torch.tensor(1), {"a": (1, torch.tensor([2]))}],
            True,
        ),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        ([1, 2], (1, 2), False),
        ([1, [2]], [1, [2]], True),
        ("x", "x", True),
    ],
    ids=[
        "tensor-equal",
        "tensor-value",
        "tensor-dtype",
        "tensor-vs-list",
        "nested",
        "dict-keys",
        "list-vs-tuple",
        "nested-lists",
        "str",
    ],
)
def test_resume_checker_equality(a: Any, b: Any, same: bool) -> None:
    """The checker compares tensors by dtype, shape and value, containers element-wise."""
    assert _equal(a, b) is same
    assert _equal(b, a) is same


def test_every_stage_kind_has_one_home() -> None:
    """Each central kind the builder makes has a registered node class declaring its
    kind, its construction and its state schema; each worker kind its output rule."""
    import attrs

    from centralpipe.plan.pipeline import WORKER_KINDS
    from centralpipe.stages import NODE_CLASSES

    words = cp.Pipeline.from_iterable(["a", "bb"])
    pipes = [
        cp.Pipeline.from_files(["x.txt"])
        .read_lines()
        .map(len)
        .filter(bool)
        .flat_map(_repeat)
        .batch(2)
        .shuffle(2)
        .count("c")
        .shard()
        .dispatch()
        .map(len)
        .filter(bool)
        .flat_map(_repeat)
        .collate(),
        words.bucket_by_max_tokens(4).dispatch(),
        words.pack(4),
        cp.Pipeline.from_dataset([1, 2]),
        cp.Pipeline.from_node(tn.IterableWrapper([1])),
        cp.Pipeline.mix({"w": words}, weights={"w": 1.0}),
    ]
    for pipe in pipes:
        for spec in pipe.central_stages:
            cls = NODE_CLASSES[spec.kind]
            assert cls.kind == spec.kind
            assert not getattr(cls.from_spec, "__isabstractmethod__", False), spec.kind
            assert cls.State is not None and attrs.has(cls.State), spec.kind
        for spec in pipe.worker_stages:
            assert spec.kind in WORKER_KINDS

"""Known totals: line counts of ``read_lines`` (fast, cached), ``loader.total()``
exact or upper bound per stage, and ``len()``."""

from __future__ import annotations

import builtins
import io
import os
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.stages import files as files_module
from centralpipe.stages.files import count_lines
from centralpipe.testing import collect
from tests.support.configs import loader_config

CORPUS_GLOB = str(Path(__file__).resolve().parents[2] / "examples" / "data" / "*.txt")


def _lines(paths: list[str] | str) -> list[str]:
    with cp.Loader(cp.Pipeline.from_files(paths).read_lines()) as loader:
        return collect(loader)


def test_count_lines_matches_read_lines_on_edge_cases(
    tmp_corpus: list[str], tmp_path: Path
) -> None:
    """Empty files, an unterminated last line, CRLF and blank lines count as read_lines reads."""
    extra = {"only_newline.txt": b"\n", "two_blank.txt": b"\n\n", "cr_only.txt": b"a\rb\r"}
    paths = list(tmp_corpus)
    for name, data in extra.items():
        (tmp_path / name).write_bytes(data)
        paths.append(str(tmp_path / name))
    for path in paths:
        assert count_lines(path) == len(_lines([path])), path
    with cp.Loader(cp.Pipeline.from_files(paths).read_lines()) as loader:
        assert len(loader) == len(collect(loader))


def test_count_lines_is_cached_by_size_and_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second count opens nothing; a changed file (size or mtime) is counted again."""
    path = tmp_path / "a.txt"
    path.write_bytes(b"1\n2\n3\n")
    assert count_lines(path) == 3
    opened: list[Any] = []
    real_open = builtins.open

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    assert count_lines(path) == 3 and opened == []
    path.write_bytes(b"1\n2\n3\n4")  # size changes
    assert count_lines(path) == 4 and len(opened) == 1
    stat = path.stat()
    path.write_bytes(b"1\n2\n3\n\n")  # same size, later mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert count_lines(path) == 4 and len(opened) == 2
    assert count_lines(str(path)) == 4 and len(opened) == 2  # str and Path share the cache


def test_count_lines_reads_bytes_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files larger than one chunk count right, including a line split across chunks."""
    monkeypatch.setattr(files_module, "COUNT_CHUNK_BYTES", 7)
    path = tmp_path / "big.txt"
    text = "".join(f"line {i}\n" for i in range(100)) + "tail"
    path.write_text(text)
    assert count_lines(path) == 101 == len(_lines([str(path)]))


def test_len_of_line_level_pipelines() -> None:
    """read_lines after from_files has a length; map, batch and shard keep it known."""
    n = len(_lines(CORPUS_GLOB))
    base = cp.Pipeline.from_files(CORPUS_GLOB).read_lines()
    with cp.Loader(base.map(str.upper)) as loader:
        assert len(loader) == n and loader.total() == cp.Total(n)
    with cp.Loader(cp.Pipeline.from_files(CORPUS_GLOB).shuffle(2).read_lines()) as loader:
        assert len(loader) == n  # shuffled files: the same lines
    with cp.Loader(base.batch(64).shard(), loader_config(rank=1, world_size=3)) as loader:
        batches = -(-n // 64)
        assert len(loader) == len(collect(loader)) == len(range(1, batches, 3))


def test_upper_bounds_are_marked_and_len_refuses_them() -> None:
    """After a filter (or bucket, pack) the total is an upper bound naming the stage."""
    n = len(_lines(CORPUS_GLOB))
    pipe = (
        cp.Pipeline.from_files(CORPUS_GLOB)
        .read_lines(name="lines")
        .map(str.split)
        .filter(bool, name="non_blank")
        .count("pre_shard")
        .shard()
        .dispatch()
        .map(len)
    )
    with cp.Loader(pipe, loader_config(world_size=2)) as loader:
        assert loader.total("lines") == cp.Total(n)
        assert loader.total("pre_shard") == cp.Total(n, exact=False, bound_by="non_blank")
        assert loader.total() == cp.Total(-(-n // 2), exact=False, bound_by="non_blank")
        with pytest.raises(TypeError, match="upper bound of") as info:
            len(loader)
        assert "'non_blank'" in str(info.value)
        delivered = len(collect(loader))
        assert delivered <= loader.total().items  # type: ignore[union-attr]
    words = cp.Pipeline.from_files(CORPUS_GLOB).read_lines().map(str.split)
    for built in (words.bucket_by_max_tokens(64), words.pack(64, oversize="drop")):
        with cp.Loader(built) as loader:
            total = loader.total()
            assert total is not None and not total.exact and total.items == n


def test_paths_filtered_before_read_lines_give_an_upper_bound(tmp_corpus: list[str]) -> None:
    """A filter or shard of the paths makes the line count an upper bound."""
    n = sum(count_lines(p) for p in tmp_corpus)
    pipe = cp.Pipeline.from_files(tmp_corpus).filter(lambda p: "empty" not in p, name="f")
    with cp.Loader(pipe.read_lines()) as loader:
        assert loader.total() == cp.Total(n, exact=False, bound_by="f")
    with cp.Loader(cp.Pipeline.from_files(tmp_corpus).map(str).read_lines()) as loader:
        assert loader.total() is None  # a map may change the paths
        with pytest.raises(TypeError, match="stage 'read_lines_2'"):
            len(loader)


def test_progress_bar_with_a_known_total() -> None:
    """progress() over a count of lines uses total() and ends exactly at it."""
    pipe = cp.Pipeline.from_files(CORPUS_GLOB).read_lines().count("pre_shard").dispatch()
    out = io.StringIO()
    with cp.Loader(pipe) as loader:
        total = loader.total("pre_shard")
        assert total is not None and total.exact
        for _ in cp.progress(loader, "pre_shard", total=total.items, file=out, mininterval=0):
            pass
        assert loader.query("pre_shard", delivered=True)["items"] == total.items
    assert f"{total.items}/{total.items}" in out.getvalue()


def test_mix_totals_per_stop_mode() -> None:
    """all_exhausted: exact sum; first_exhausted: an upper bound; never: unknown."""
    subs = {"a": cp.Pipeline.from_iterable(range(10)), "b": cp.Pipeline.from_iterable(range(4))}
    subs["z"] = cp.Pipeline.from_iterable(lambda: iter(range(3)))  # no length, weight 0
    weights = {"a": 1, "b": 1, "z": 0}
    with cp.Loader(cp.Pipeline.mix(subs, weights)) as loader:
        assert len(loader) == 14 == len(collect(loader))
        assert loader.total("mix/a/source") == cp.Total(10)
        assert loader.total("mix/z/source") is None
    with cp.Loader(cp.Pipeline.mix(subs, weights, stop="first_exhausted", name="m")) as loader:
        assert loader.total() == cp.Total(14, exact=False, bound_by="m")
        assert len(collect(loader)) <= 14
    with cp.Loader(cp.Pipeline.mix(subs, weights, stop="never")) as loader:
        assert loader.total() is None
        with pytest.raises(TypeError, match="stage 'mix'"):
            len(loader)
    with cp.Loader(cp.Pipeline.mix(subs, {"a": 1, "b": 1, "z": 1})) as loader:
        assert loader.total() is None  # a drawn source without a length


def test_total_of_unknown_stage_lists_the_stages() -> None:
    """total() of an unknown name raises KeyError listing the stages."""
    pipe = cp.Pipeline.from_iterable(range(5)).count("c").dispatch().filter(bool, name="w")
    with cp.Loader(pipe) as loader:
        assert loader.total("c") == cp.Total(5)
        assert loader.total("w") == cp.Total(5, exact=False, bound_by="w")
        with pytest.raises(KeyError, match="'c'"):
            loader.total("nope")


def test_unreadable_file_makes_the_total_unknown(tmp_path: Path) -> None:
    """A missing file: total() is None, len() a TypeError, reading names the stage."""
    pipe = cp.Pipeline.from_files([str(tmp_path / "missing.txt")]).read_lines(name="lines")
    with cp.Loader(pipe) as loader:
        assert loader.total() is None
        with pytest.raises(TypeError, match="stage 'lines'"):
            len(loader)
        with pytest.raises(FileNotFoundError) as info:
            list(loader)  # list() asks len() first
        assert "(raised in central stage 'lines')" in info.value.__notes__


def _collected(pipe: cp.Pipeline) -> tuple[cp.Total | None, int]:
    with cp.Loader(pipe) as loader:
        return loader.total(), len(collect(loader))


@pytest.mark.parametrize(
    ("batch_rows", "items"),
    [(None, 45), (3, 13 + 7), (7, 5 + 3), (100, 5 + 3)],
    ids=["rows", "batches-3", "batches-7", "batches-100"],
)
def test_parquet_totals_come_from_the_footers(
    tmp_path: Path, batch_rows: int | None, items: int
) -> None:
    """read_parquet's total is exact from the footers: rows, or batches per row
    group (rows of 30 and 15 in row groups of 7)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for name, rows in (("a", range(30)), ("b", range(30, 45))):
        table = pa.Table.from_pylist([{"id": i} for i in rows])
        pq.write_table(table, str(tmp_path / f"{name}.parquet"), row_group_size=7)
    pipe = cp.Pipeline.from_files(str(tmp_path / "*.parquet")).read_parquet(batch_rows=batch_rows)
    assert _collected(pipe) == (cp.Total(items), items)
    subset = cp.Pipeline.from_files(str(tmp_path / "*.parquet")).filter(bool, name="f")
    with cp.Loader(subset.read_parquet(batch_rows=batch_rows)) as loader:
        assert loader.total() == cp.Total(items, exact=False, bound_by="f")


def test_parquet_totals_over_a_url_and_of_a_damaged_file(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A memory:// Parquet file's footer gives its rows; a file that is not Parquet
    leaves the total unknown (reading it raises)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/{request.node.name}"
    with fs.open(f"{root}/a.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist([{"id": i} for i in range(12)]), f, row_group_size=5)
    try:
        pipe = cp.Pipeline.from_files(f"memory://{root}/*.parquet").read_parquet(batch_rows=2)
        assert _collected(pipe) == (cp.Total(3 + 3 + 1), 7)
    finally:
        fs.rm(root, recursive=True)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with cp.Loader(cp.Pipeline.from_files(str(tmp_path / "*.parquet")).read_parquet()) as loader:
        assert loader.total() is None


JSONL_EDGES = {
    "blank-lines": b'{"a": 1}\n\n \t\r\n{"a": 2}\n',
    "crlf": b'{"a": 1}\r\n{"a": 2}\r\n',
    "no-final-newline": b'{"a": 1}\n{"a": 2}',
    "blank-last-line": b'{"a": 1}\n  ',
    "empty": b"",
    "one-newline": b"\n",
    "vertical-tab-and-form-feed": b"\x0b\x0c\n1\n",
}


@pytest.mark.parametrize("data", list(JSONL_EDGES.values()), ids=list(JSONL_EDGES))
@pytest.mark.parametrize("chunk", [3, 1 << 20], ids=["tiny-chunks", "one-chunk"])
def test_jsonl_totals_count_the_lines_read_jsonl_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: bytes, chunk: int
) -> None:
    """An uncompressed local file's total is its non-blank lines, exactly what
    read_jsonl yields, also when lines span the counting chunks."""
    from centralpipe.stages import jsonl as jsonl_module

    monkeypatch.setattr(jsonl_module, "COUNT_CHUNK_BYTES", chunk)
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    total, got = _collected(cp.Pipeline.from_files([str(path)]).read_jsonl())
    assert total == cp.Total(got)


def test_jsonl_totals_skip_bound_compressed_and_urls_unknown(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """errors='skip' makes the count an upper bound naming the reader; a gzip file
    or a URL leaves it unknown (it would be read whole)."""
    import gzip

    fsspec = pytest.importorskip("fsspec")
    data = b'{"a": 1}\nnot json\n{"a": 3}\n'
    (tmp_path / "x.jsonl").write_bytes(data)
    skip = cp.Pipeline.from_files([str(tmp_path / "x.jsonl")]).read_jsonl(errors="skip", name="r")
    assert _collected(skip) == (cp.Total(3, exact=False, bound_by="r"), 2)
    (tmp_path / "y.jsonl.gz").write_bytes(gzip.compress(data))
    both = cp.Pipeline.from_files(str(tmp_path / "*")).read_jsonl(errors="skip")
    assert _collected(both) == (None, 4)
    fs = fsspec.filesystem("memory")
    fs.pipe(f"/{request.node.name}/x.jsonl", data)
    try:
        url = cp.Pipeline.from_files([f"memory:///{request.node.name}/x.jsonl"])
        assert _collected(url.read_jsonl(errors="skip")) == (None, 2)
    finally:
        fs.rm(f"/{request.node.name}", recursive=True)


def test_reader_counts_are_cached_until_the_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second total() counts nothing again; a file rewritten (size or mtime) is
    counted afresh."""
    from centralpipe.stages import jsonl as jsonl_module

    calls: list[str] = []
    real = jsonl_module.count_records

    def spy(path: str) -> int:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(jsonl_module, "count_records", spy)
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"1\n2\n")
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl()
    with cp.Loader(pipe) as loader:
        assert loader.total() == cp.Total(2) and loader.total() == cp.Total(2)
        assert len(calls) == 1
        path.write_bytes(b"1\n2\n3\n")
        assert loader.total() == cp.Total(3) and len(calls) == 2
        stat = path.stat()
        path.write_bytes(b"1\n\n3\n")  # same size, later mtime
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        assert loader.total() == cp.Total(2) and len(calls) == 3


def _size(x: int) -> int:
    return x % 5 + 1


def _len_of(batch: list[int]) -> int:
    return len(batch)


_SRC = cp.Pipeline.from_iterable(range(50))
#: A pipeline ending in count "c", and the weight total it tells (None: unknown).
WEIGHT_TOTALS: dict[str, tuple[cp.Pipeline, cp.Total | None]] = {
    "no-weight-fn": (_SRC.batch(7).count("c"), cp.Total(8)),
    "len-after-batch": (_SRC.batch(7).count("c", weight_fn=len), cp.Total(50)),
    "len-after-batch-drop-last": (
        _SRC.batch(7, drop_last=True).count("c", weight_fn=len),
        cp.Total(49),
    ),
    "len-after-bucket": (
        _SRC.bucket_by_max_tokens(10, len_fn=_size, buffer_size=8).count("c", weight_fn=len),
        cp.Total(50),
    ),
    "len-after-bucket-with-min-len": (
        _SRC.bucket_by_max_tokens(10, len_fn=_size, min_len=2, name="b").count("c", weight_fn=len),
        cp.Total(50, exact=False, bound_by="b"),
    ),
    "len-after-pack": (_SRC.pack(12, len_fn=_size).count("c", weight_fn=len), cp.Total(50)),
    "len-after-pack-dropping-oversize": (
        _SRC.pack(4, len_fn=_size, oversize="drop", name="p").count("c", weight_fn=len),
        cp.Total(50, exact=False, bound_by="p"),
    ),
    "len-through-shuffle-and-count": (
        _SRC.batch(7).shuffle(3).count("b").count("c", weight_fn=len),
        cp.Total(50),
    ),
    "len-after-a-filter": (
        _SRC.filter(lambda x: x % 3 != 0, name="f").batch(7).count("c", weight_fn=len),
        cp.Total(50, exact=False, bound_by="f"),
    ),
    "another-weight-fn": (_SRC.batch(7).count("c", weight_fn=_len_of), None),
    "len-after-a-map": (_SRC.batch(7).map(list).count("c", weight_fn=len), None),
    "len-of-items-not-lists": (
        cp.Pipeline.from_iterable(["ab", "c"]).count("c", weight_fn=len),
        None,
    ),
    "source-without-length": (
        cp.Pipeline.from_iterable(lambda: iter(range(50))).batch(7).count("c", weight_fn=len),
        None,
    ),
}


@pytest.mark.parametrize("case", WEIGHT_TOTALS, ids=str)
def test_weight_total_of_a_count(case: str) -> None:
    """loader.total(name, weight=True) is the weight the count reaches at the
    end of the epoch where the pipeline tells it (exact, or an upper bound
    naming the stage that may drop items), else None; the epoch then ends
    exactly there (or within the bound)."""
    pipe, want = WEIGHT_TOTALS[case]
    with cp.Loader(pipe.shard().dispatch()) as loader:
        assert loader.total("c", weight=True) == want
        collect(loader)
        reached = loader.query("c", delivered=True)["weight"]
    if want is not None and want.exact:
        assert reached == want.items
    elif want is not None:
        assert reached <= want.items


def test_weight_total_refuses_bad_calls() -> None:
    """weight=True needs a count stage's name and a bool: the errors say so."""
    with cp.Loader(_SRC.batch(7, name="b").count("c", weight_fn=len)) as loader:
        with pytest.raises(ValueError, match=r"weight=True needs the name of a count stage"):
            loader.total(weight=True)
        with pytest.raises(ValueError, match=r"weight=True is for count stages; 'b' is a batch"):
            loader.total("b", weight=True)
        with pytest.raises(TypeError, match=r"`weight` must be a bool, got 'yes'"):
            loader.total("c", weight="yes")  # type: ignore[arg-type]
        with pytest.raises(KeyError, match=r"no stage named 'x'"):
            loader.total("x", weight=True)


def _corpus_buckets(min_len: int = 0) -> cp.Pipeline:
    return (
        cp.Pipeline.from_files(CORPUS_GLOB)
        .read_lines()
        .bucket_by_max_tokens(4096, len_fn=len, buffer_size=500, min_len=min_len)
        .count("pre_shard", weight_fn=len)
        .shard(equalize="drop_last")
        .dispatch()
    )


def test_progress_bar_of_summed_batch_sizes_ends_at_the_known_total() -> None:
    """The motivating bar: batch sizes summed before shard(), with no total
    given, ends at the corpus's 8000 lines, before and after a resume; with
    min_len (lines dropped: only an upper bound) the bar has no end."""
    whole = sum(count_lines(p) for p in sorted(Path(CORPUS_GLOB).parent.glob("*.txt")))
    assert whole == 8000
    out = io.StringIO()
    with cp.Loader(_corpus_buckets()) as loader:
        assert loader.total("pre_shard", weight=True) == cp.Total(8000)
        bar = cp.progress(loader, file=out, mininterval=0)
        head = []
        for batch in bar:
            head.append(batch)
            if len(head) == 5:
                break
        bar.close()
        state = loader.state_dict()
        half = loader.query("pre_shard", delivered=True)["weight"]
    assert half == sum(len(batch) for batch in head)
    assert out.getvalue().split("\r")[-1].strip().startswith(f"{100 * half // 8000}%")
    assert f" {half}/8000 " in out.getvalue()
    out = io.StringIO()
    with cp.Loader(_corpus_buckets()) as loader:
        loader.load_state_dict(state)
        for _ in cp.progress(loader, file=out, mininterval=0):
            pass
    frames = [f for f in out.getvalue().split("\r") if f.strip()]
    assert f" {half}/8000 " in frames[0]  # starts at the checkpoint's value
    assert " 8000/8000 " in frames[-1]
    out = io.StringIO()
    with cp.Loader(_corpus_buckets(min_len=1)) as loader:
        assert loader.total("pre_shard", weight=True) == cp.Total(
            8000, exact=False, bound_by="bucket_by_max_tokens_2"
        )
        for _ in cp.progress(loader, file=out, mininterval=0):
            pass
    kept = sum(1 for line in _lines(CORPUS_GLOB) if len(line) >= 1)
    assert kept == 7971
    assert "/8000" not in out.getvalue() and f"{kept}samples" in out.getvalue()

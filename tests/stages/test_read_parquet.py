"""``read_parquet``: rows or column batches, streamed by row group, resumed at
(file, row group, row)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, checkpoint_after, collect
from tests.support.configs import loader_config

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

LOCKSTEP = loader_config(buffer_size=1, chunk_size=1)
ROWS = [{"id": i, "text": f"t{i}", "score": i / 4} for i in range(45)]
GROUP_ROWS = 7


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=GROUP_ROWS)


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Two files of 30 and 15 rows, in row groups of 7."""
    _write(tmp_path / "a.parquet", ROWS[:30])
    _write(tmp_path / "b.parquet", ROWS[30:])
    return tmp_path


@pytest.mark.parametrize(
    ("columns", "expect"),
    [(None, ROWS), (["text", "id"], [{"text": r["text"], "id": r["id"]} for r in ROWS])],
    ids=["all-columns", "two-columns"],
)
@pytest.mark.parametrize(
    ("workers", "resume_workers"), [(0, 0), (2, 0), (2, 2)], ids=["0-0", "2-0", "2-2"]
)
def test_rows_resume_exactly(
    dataset: Path, columns: Any, expect: Any, workers: int, resume_workers: int
) -> None:
    """Each row once, in order, as a dict of the chosen columns, at every k."""
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet(columns=columns)
    full = assert_resumes_exactly(
        pipe.dispatch(),
        loader_config(num_workers=workers),
        resume_config=loader_config(num_workers=resume_workers),
    )
    assert full == expect


@pytest.mark.parametrize(
    ("workers", "resume_workers"), [(0, 0), (2, 0), (2, 2)], ids=["0-0", "2-0", "2-2"]
)
def test_batches_resume_exactly(dataset: Path, workers: int, resume_workers: int) -> None:
    """batch_rows=3 gives RecordBatches of up to 3 rows of one row group, at every k,
    across worker counts."""
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet(
        columns=["id"], batch_rows=3
    )
    full = assert_resumes_exactly(
        pipe.dispatch(),
        loader_config(num_workers=workers),
        resume_config=loader_config(num_workers=resume_workers),
    )
    assert all(isinstance(b, pa.RecordBatch) for b in full)
    ids = [b.column("id").to_pylist() for b in full]
    expected = []
    for start, end in ((0, 30), (30, 45)):
        for group in range(start, end, GROUP_ROWS):
            stop = min(group + GROUP_ROWS, end)
            expected.extend(list(range(i, min(i + 3, stop))) for i in range(group, stop, 3))
    assert ids == expected


def test_state_mid_row_group_and_resume_reads_from_that_group(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state names the row group and row; a resume reads that row group and
    the ones after it, only the chosen columns, never the whole file."""
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet(columns=["id"])
    state = checkpoint_after(pipe, 17, LOCKSTEP).state
    assert state["central"]["read_parquet_1"] == {"path": "a.parquet", "row_group": 2, "row": 3}
    calls: list[tuple[int, Any]] = []
    iter_batches = pq.ParquetFile.iter_batches

    def recording(self: Any, *, row_groups: Any = None, columns: Any = None, **kw: Any) -> Any:
        (i,) = row_groups  # one row group at a time
        calls.append((i, columns))
        return iter_batches(self, row_groups=row_groups, columns=columns, **kw)

    def whole(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read_parquet read a whole file")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recording)
    monkeypatch.setattr(pq.ParquetFile, "read", whole)
    with cp.Loader(pipe, LOCKSTEP) as loader:
        loader.load_state_dict(state)
        assert collect(loader) == [{"id": i} for i in range(17, 45)]
    assert calls == [(2, ["id"]), (3, ["id"]), (4, ["id"]), (0, ["id"]), (1, ["id"]), (2, ["id"])]


def _corrupt(state: dict[str, Any], **changes: Any) -> dict[str, Any]:
    state = copy.deepcopy(state)
    state["central"]["read_parquet_1"].update(changes)
    return state


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"row_group": 9}, "at row group 9, row 3, but the file has 5 row groups"),
        ({"row": 8}, "at row 8 of row group 2, which has 7 rows"),
        ({"row_group": 5}, "at row group 5, row 3, but the file has 5 row groups"),
        ({"row": -1}, "row must be an int >= 0"),
        ({"path": None}, "row must be 0 when no file is open"),
    ],
    ids=["group-out-of-range", "row-past-group", "group-at-end", "negative", "no-path"],
)
def test_damaged_positions_are_refused_at_load(
    dataset: Path, changes: dict[str, Any], match: str
) -> None:
    """A row group or row out of the file's range is a CheckpointError at load."""
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet(columns=["id"])
    state = checkpoint_after(pipe, 17, LOCKSTEP).state
    with cp.Loader(pipe, LOCKSTEP) as loader:
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(_corrupt(state, **changes))
        assert len(collect(loader)) == 45  # refused: the loader is as it was


def test_a_file_that_is_no_longer_parquet_is_refused(dataset: Path) -> None:
    """A file overwritten (same size) with other bytes is a CheckpointError at load."""
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet()
    state = checkpoint_after(pipe, 3, LOCKSTEP).state
    path = dataset / "a.parquet"
    path.write_bytes(b"x" * path.stat().st_size)
    with (
        cp.Loader(pipe, LOCKSTEP) as loader,
        pytest.raises(cp.CheckpointError, match=r"cannot resume .*a\.parquet"),
    ):
        loader.load_state_dict(state)


def test_a_missing_column_names_the_columns(dataset: Path) -> None:
    """columns= naming a column the file lacks raises ValueError listing its columns."""
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet(columns=["nope"])
    with cp.Loader(pipe) as loader, pytest.raises(ValueError, match=r"no column\(s\) \['nope'\]"):
        collect(loader)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"columns": "id"}, "`columns` must be None or a list of str"),
        ({"columns": [1]}, "`columns` must be None or a list of str, got 1"),
        ({"columns": []}, "got 'an empty list'"),
        ({"batch_rows": 0}, "`batch_rows` must be an int >= 1"),
    ],
    ids=["str", "int-column", "empty", "zero-rows"],
)
def test_bad_arguments_are_refused_at_build(kwargs: dict[str, Any], match: str) -> None:
    """Bad `columns` or `batch_rows` are a PipelineError when the pipeline is built."""
    with pytest.raises(cp.PipelineError, match=match):
        cp.Pipeline.from_files(["x.parquet"]).read_parquet(**kwargs)


def test_without_pyarrow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pyarrow, read_parquet is a PipelineError naming centralpipe[parquet]."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(cp.PipelineError, match=r"pip install 'centralpipe\[parquet\]'"):
        cp.Pipeline.from_files(["x.parquet"]).read_parquet()


def test_parquet_over_a_memory_url(request: pytest.FixtureRequest) -> None:
    """A Parquet file on fsspec's memory filesystem resumes mid row group."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = f"/{request.node.name}"
    with fs.open(f"{root}/a.parquet", "wb") as f:
        pq.write_table(pa.Table.from_pylist(ROWS), f, row_group_size=GROUP_ROWS)
    try:
        pipe = cp.Pipeline.from_files(f"memory://{root}/*.parquet").read_parquet(columns=["id"])
        ks = [0, 1, 10, 17, 44, 45]
        assert assert_resumes_exactly(pipe, LOCKSTEP, ks=ks) == [{"id": i} for i in range(45)]
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize("reader_rows", [1, 2, 5], ids=["reader-1", "reader-2", "reader-5"])
def test_batches_are_cut_per_row_group_whatever_the_reader_gives(
    dataset: Path, monkeypatch: pytest.MonkeyPatch, reader_rows: int
) -> None:
    """When pyarrow's reader hands out batches of another size than batch_rows, the
    items are still batch_rows rows at multiples of it in each row group, and resume
    exactly."""
    iter_batches = pq.ParquetFile.iter_batches

    def other_size(self: Any, batch_size: int = 0, **kwargs: Any) -> Any:
        return iter_batches(self, batch_size=reader_rows, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", other_size)
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet(
        columns=["id"], batch_rows=3
    )
    full = assert_resumes_exactly(pipe, LOCKSTEP)
    expected = []
    for start, end in ((0, 30), (30, 45)):
        for group in range(start, end, GROUP_ROWS):
            stop = min(group + GROUP_ROWS, end)
            expected.extend(list(range(i, min(i + 3, stop))) for i in range(group, stop, 3))
    assert [b.column("id").to_pylist() for b in full] == expected


def test_a_resume_converts_rows_from_its_row_on(
    dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumed mid row group in rows mode, the rows before the position are read but
    never converted to dicts: the first conversion starts at the row."""
    pipe = cp.Pipeline.from_files(str(dataset / "*.parquet")).read_parquet(columns=["id"])
    state = checkpoint_after(pipe, 17, LOCKSTEP).state
    converted: list[int] = []
    iter_batches = pq.ParquetFile.iter_batches

    class Counting:
        """A RecordBatch that records the first id of each conversion to rows."""

        def __init__(self, batch: Any) -> None:
            self.batch, self.num_rows = batch, batch.num_rows

        def slice(self, *args: Any) -> Counting:
            return Counting(self.batch.slice(*args))

        def to_pylist(self) -> list[dict[str, Any]]:
            rows: list[dict[str, Any]] = self.batch.to_pylist()
            converted.append(rows[0]["id"] if rows else -1)
            return rows

    def counting(self: Any, **kwargs: Any) -> Any:
        return map(Counting, iter_batches(self, **kwargs))

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counting)
    with cp.Loader(pipe, LOCKSTEP) as loader:
        loader.load_state_dict(state)
        assert collect(loader) == [{"id": i} for i in range(17, 45)]
    assert converted[0] == 17 and sorted(converted) == converted

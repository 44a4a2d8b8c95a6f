"""``read_lines`` followed by parallel stages on workers: byte ranges go out,
the workers read and split them (``WorkerConfig.read_in_workers``).

Every test compares against exact lines written out by hand, and the path on
against the path off: same outputs, queries, errors and checkpoints, which
load whichever way they were taken.
"""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe import checkpoint
from centralpipe.dispatch.worker.ranges import LineRange, split_lines
from centralpipe.stages import files as files_stage
from centralpipe.testing import assert_resumes_exactly

#: File name -> bytes; names sort in this order. Every line shape read_lines knows.
CORPUS: dict[str, bytes] = {
    "a_empty.txt": b"",
    "b_lf.txt": b"one\ntwo\n\nfour\n",
    "c_crlf_no_final_newline.txt": b"caf\xc3\xa9\r\n\r\nx\r\ny\rz\r",
    "d_only_newlines.txt": b"\n\n\n",
    "e_long.txt": b"".join(b"line %d\n" % i for i in range(23)) + b"tail",
    "f_one_line.txt": b"single",
}
LINES: list[str] = [
    *["one", "two", "", "four"],
    *["café", "", "x", "y\rz"],
    *["", "", ""],
    *[f"line {i}" for i in range(23)],
    "tail",
    "single",
]

STAGE_NOTE = "(raised in central stage 'lines')"
PROCESS_AND_THREAD = [
    pytest.param(w, ex, id=f"{w}w-{ex}")
    for w, ex in [*((w, "process") for w in range(4)), *((w, "thread") for w in (1, 2, 3))]
]


def _write(root: Path, corpus: dict[str, bytes]) -> str:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in corpus.items():
        (root / name).write_bytes(data)
    return str(root / "*.txt")


def _cfg(
    workers: int = 2,
    executor: str = "process",
    *,
    on: bool = True,
    chunk_size: int | None = 3,
    **kw: Any,
) -> cp.LoaderConfig:
    kw.setdefault("buffer_size", 8)
    return cp.LoaderConfig(
        workers=cp.WorkerConfig(
            num_workers=workers,
            executor=executor,
            start_method="fork",
            chunk_size=chunk_size,
            read_in_workers=on,
            **kw,
        ),
        seed=3,
    )


def _tag(line: str) -> str:
    return f"<{line}>"


def _short(line: str) -> bool:
    return len(line) < 6


def _chars(line: str) -> list[str]:
    return list(line[:2])


def _pipe(glob: str, *, errors: str = "strict", stage: str = "map") -> cp.Pipeline:
    lines = cp.Pipeline.from_files(glob).read_lines(errors=errors, name="lines")
    if stage == "map":
        par = lines.map(_tag, parallel=True, name="par")
    elif stage == "filter":
        par = lines.filter(_short, parallel=True, name="par")
    else:
        par = lines.flat_map(_chars, parallel=True, name="par")
    return par.count("seen", weight_fn=len)


def _run(pipe: cp.Pipeline, config: cp.LoaderConfig) -> tuple[list[Any], Any, int]:
    with cp.Loader(pipe, config) as loader:
        out = list(loader)
        seen = loader.query("seen")
        read = loader.metrics()["par"]["parallel"]["lines_read_in_workers"]
    return out, seen, read


EXPECTED = {
    "map": [f"<{line}>" for line in LINES],
    "filter": [line for line in LINES if len(line) < 6],
    "flat_map": [c for line in LINES for c in line[:2]],
}


@pytest.mark.parametrize("stage", ["map", "filter", "flat_map"])
@pytest.mark.parametrize(("workers", "executor"), PROCESS_AND_THREAD)
def test_outputs_and_queries_are_the_lines_with_reading_on_and_off(
    tmp_path: Path, workers: int, executor: str, stage: str
) -> None:
    """Every line shape (LF, CRLF, empty lines, a lone \\r, no final newline,
    empty files, files of one line and of many ranges) gives the exact lines,
    and the same query, with the workers reading ranges or the main process
    sending lines; with workers, the lines are read there."""
    glob = _write(tmp_path, CORPUS)
    expected = EXPECTED[stage]
    for on in (True, False):
        out, seen, read = _run(_pipe(glob, stage=stage), _cfg(workers, executor, on=on))
        assert out == expected, on
        assert seen == {"items": len(expected), "weight": sum(map(len, expected))}
        assert read == (len(LINES) if on and workers else 0)


@pytest.mark.parametrize(
    ("range_bytes", "chunk_size"),
    [
        pytest.param(1, 1024, id="one-byte-ranges"),
        pytest.param(7, 1024, id="ranges-shorter-than-lines"),
        pytest.param(40, None, id="a-few-lines-each"),
        pytest.param(1 << 20, 1024, id="whole-files"),
    ],
)
def test_ranges_cut_by_bytes_keep_whole_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, range_bytes: int, chunk_size: int | None
) -> None:
    """However many bytes a range may hold (down to one byte, shorter than a
    line: then one line each), it ends at a line start and the lines are exact."""
    monkeypatch.setattr(files_stage, "RANGE_BYTES", range_bytes)
    monkeypatch.setattr(files_stage, "MIN_RANGE_READ", 1)
    glob = _write(tmp_path, CORPUS)
    out, _, read = _run(_pipe(glob), _cfg(2, chunk_size=chunk_size, buffer_size=None))
    assert out == EXPECTED["map"]
    assert read == len(LINES)


BAD = {
    "a.txt": b"ok\nbad \xff byte\r\nmid\xc3 cut\nend",
    "b.txt": b"\xe2\x82\nnext\n",
}


@pytest.mark.parametrize(
    ("errors", "lines"),
    [
        pytest.param(
            "replace",
            ["ok", "bad \ufffd byte", "mid\ufffd cut", "end", "\ufffd", "next"],
            id="replace",
        ),
        pytest.param("ignore", ["ok", "bad  byte", "mid cut", "end", "", "next"], id="ignore"),
        pytest.param(
            "backslashreplace",
            ["ok", "bad \\xff byte", "mid\\xc3 cut", "end", "\\xe2\\x82", "next"],
            id="backslashreplace",
        ),
    ],
)
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_decode_errors_options_behave_as_read_lines(
    tmp_path: Path, errors: str, lines: list[str], on: bool
) -> None:
    """``errors="replace"``/``"ignore"``/``"backslashreplace"``: the same lines
    whoever decodes them."""
    glob = _write(tmp_path, BAD)
    out, _, _ = _run(_pipe(glob, errors=errors), _cfg(2, on=on))
    assert out == [f"<{line}>" for line in lines]


@pytest.mark.parametrize(("workers", "executor"), [("1", "process"), ("2", "thread")])
@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_a_line_that_does_not_decode_raises_naming_file_and_offset(
    tmp_path: Path, on: bool, workers: str, executor: str
) -> None:
    """``errors="strict"``: the lines before the bad one are delivered, then
    the ``UnicodeDecodeError`` read_lines raises, noted with the file and the
    line's byte offset; ``on_error="skip"`` does not skip it (a reader's error)."""
    glob = _write(tmp_path, BAD)
    got: list[Any] = []
    config = _cfg(int(workers), executor, on=on, on_error="skip")
    with cp.Loader(_pipe(glob), config) as loader, pytest.raises(UnicodeDecodeError) as info:
        for item in loader:
            got.append(item)
    assert got == ["<ok>"]
    assert info.value.reason == "invalid start byte"
    path = str(tmp_path / "a.txt")
    assert info.value.__notes__ == [f"(in file {path!r} at byte offset 3)", STAGE_NOTE]


def _kill_on(line: str, *, at: str, marker: str) -> str:
    if line == at and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return _tag(line)


def test_a_worker_killed_mid_range_loses_nothing(tmp_path: Path) -> None:
    """A worker killed halfway through a range: replaced, the range re-sent,
    the output exact."""
    import functools

    glob = _write(tmp_path / "data", CORPUS)
    fn = functools.partial(_kill_on, at="line 9", marker=str(tmp_path / "killed"))
    pipe = cp.Pipeline.from_files(glob).read_lines().map(fn, parallel=True, name="par")
    with cp.Loader(pipe, _cfg(2, chunk_size=8)) as loader:
        assert list(loader) == EXPECTED["map"]
        metrics = loader.metrics()
    assert (tmp_path / "killed").exists()
    assert metrics["dispatch"]["restarts"] == 1
    assert metrics["par"]["parallel"]["lines_read_in_workers"] == len(LINES)


@pytest.mark.parametrize(
    ("config", "resume_config"),
    [
        pytest.param(_cfg(2), None, id="on-2w"),
        pytest.param(_cfg(2), _cfg(0, on=False), id="on-to-off-0w"),
        pytest.param(_cfg(2, on=False), _cfg(3, "thread"), id="off-to-on-3w-thread"),
        pytest.param(
            _cfg(1, "thread", chunk_size=None),
            _cfg(2, "thread", on=False),
            id="adaptive-on-to-off-thread",
        ),
    ],
)
def test_resumes_exactly_at_every_k_whichever_way_it_reads(
    tmp_path: Path, config: cp.LoaderConfig, resume_config: cp.LoaderConfig | None
) -> None:
    """A checkpoint at every k resumes exactly, with the path on, and taken
    on resuming off and back: the in-flight lines of a range are lines."""
    names = ["a_empty.txt", "b_lf.txt", "c_crlf_no_final_newline.txt", "f_one_line.txt"]
    glob = _write(tmp_path, {name: CORPUS[name] for name in names})
    pipe = _pipe(glob, stage="flat_map")
    full = assert_resumes_exactly(pipe, config, resume_config=resume_config)
    assert full == [c for line in LINES[:8] + LINES[-1:] for c in line[:2]]


def _state_mid_file(glob: str) -> dict[str, Any]:
    """A state taken with ranges in flight, the reader inside ``e_long.txt``."""
    with cp.Loader(_pipe(glob), _cfg(2)) as loader:
        it = iter(loader)
        for _ in range(16):
            next(it)
        return loader.state_dict()


@pytest.mark.parametrize(
    ("offset", "message"),
    [
        pytest.param(10**6, "the file changed since the checkpoint", id="past-the-end"),
        pytest.param(3, "which is not the start of a line", id="not-a-line-start"),
    ],
)
def test_damaged_positions_are_refused(tmp_path: Path, offset: int, message: str) -> None:
    """A state taken while ranges were in flight whose reader position is past
    the end of its file, or not at a line start, is refused with ``CheckpointError``."""
    glob = _write(tmp_path, CORPUS)
    state = _state_mid_file(glob)
    lines_state = state["central"]["lines"]
    assert lines_state["path"] == "e_long.txt"
    assert state["in_flight"]["par"]["ranges"]  # lines in flight, as ranges
    state["central"]["lines"] = {**lines_state, "offset": offset}
    with (
        cp.Loader(_pipe(glob), _cfg(2)) as loader,
        pytest.raises(cp.CheckpointError, match=message),
    ):
        loader.load_state_dict(state)


def test_no_workers_reads_in_the_main_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``num_workers=0``: no range is ever cut (the path costs nothing)."""

    def no_ranges(*_: Any) -> None:
        raise AssertionError("take_range called without workers")

    monkeypatch.setattr(files_stage.ReadLines, "take_range", no_ranges)
    glob = _write(tmp_path, CORPUS)
    out, _, read = _run(_pipe(glob), _cfg(0))
    assert (out, read) == (EXPECTED["map"], 0)


def test_no_lines_at_all(tmp_path: Path) -> None:
    """Only empty files: nothing is sent, the pass ends at once, state stays exact."""
    glob = _write(tmp_path, {"a.txt": b"", "b.txt": b""})
    assert _run(_pipe(glob), _cfg(2))[:2] == ([], {"items": 0, "weight": 0})


@pytest.mark.parametrize("value", [1, "yes", None], ids=["int", "str", "none"])
def test_read_in_workers_must_be_a_bool(value: Any) -> None:
    """``read_in_workers`` of another type is a ``ConfigError`` naming it."""
    with pytest.raises(cp.ConfigError, match="read_in_workers"):
        cp.WorkerConfig(read_in_workers=value)


def test_remote_files_are_read_in_the_main_process(tmp_path: Path) -> None:
    """An fsspec path (``file://``) is read as read_lines reads it, lines sent
    (the workers get no range of it): the same lines."""
    pytest.importorskip("fsspec")
    _write(tmp_path, CORPUS)
    url = "file://" + str(tmp_path) + "/*.txt"
    out, _, read = _run(_pipe(url), _cfg(2))
    assert (out, read) == (EXPECTED["map"], 0)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\n", id="one-empty-line"),
        pytest.param(b"a\r\n\r\nb", id="crlf-no-final"),
        pytest.param(b"x\r", id="lone-cr-at-end"),
        pytest.param("Жёлтый\n🙂\n".encode(), id="unicode"),
    ],
)
def test_split_lines_is_read_lines(tmp_path: Path, data: bytes) -> None:
    """The worker's split of a range's bytes equals read_lines run centrally
    over the same file."""
    (tmp_path / "f.txt").write_bytes(data)
    pipe = cp.Pipeline.from_files(str(tmp_path / "f.txt")).read_lines()
    with cp.Loader(pipe) as loader:
        central = list(loader)
    assert split_lines(data, "utf-8", "strict") == (central, None)


def test_a_range_pickles_as_its_fields_and_reads_its_lines(tmp_path: Path) -> None:
    """A LineRange crosses as a few fields; it is a sequence of its lines;
    a file changed under it is an error saying so."""
    path = tmp_path / "f.txt"
    path.write_bytes(b"a\nbb\nccc\n")
    r = LineRange(str(path), 2, 9, 2, encoding="utf-8", errors="strict", stage="lines")
    back = pickle.loads(pickle.dumps(r))
    assert len(pickle.dumps(r)) < 200
    assert (len(back), list(back), back[1:]) == (2, ["bb", "ccc"], ["ccc"])
    path.write_bytes(b"a\nbb")
    assert back.read() == ([], f"{str(path)!r} changed while it was read: bytes 2..9 held "
                               "2 lines when the range was cut, and now 1.")  # fmt: skip
    with pytest.raises(RuntimeError, match="changed while it was read"):
        list(back)


def _noisy(line: str, rng: Any) -> tuple[str, int]:
    import torch

    return line, int(torch.randint(0, 10**6, (1,), generator=rng))


def _fails_on_two(line: str) -> str:
    if line == "two":
        raise ValueError("no twos")
    return line


@pytest.mark.parametrize(("workers", "executor"), [(2, "process"), (3, "thread")])
def test_seeds_and_skipped_failures_are_per_line(
    tmp_path: Path, workers: int, executor: str
) -> None:
    """``with_rng`` draws and ``on_error="skip"`` are those of the lines run one
    by one: each line keeps its own seed, a failing line alone is skipped."""
    glob = _write(tmp_path, CORPUS)
    lines = cp.Pipeline.from_files(glob).read_lines(name="lines")
    noisy = lines.map(_noisy, parallel=True, with_rng=True, name="par")
    skipping = lines.map(_fails_on_two, parallel=True, name="par")
    ref = list(cp.Loader(noisy, _cfg(0)))
    assert [line for line, _ in ref] == LINES
    for on in (True, False):
        assert list(cp.Loader(noisy, _cfg(workers, executor, on=on))) == ref
        config = _cfg(workers, executor, on=on, on_error="skip")
        with cp.Loader(skipping, config) as loader:
            assert list(loader) == [line for line in LINES if line != "two"]
            assert loader.metrics()["dispatch"]["skipped"] == 1


def test_in_flight_lines_are_saved_as_ranges(tmp_path: Path) -> None:
    """Mid-epoch, the lines workers read are in the checkpoint as byte ranges
    of their files (no line text), and ``next_seq`` counts their lines."""
    glob = _write(tmp_path, CORPUS)
    state = _state_mid_file(glob)
    flight = state["in_flight"]["par"]
    assert flight["items"] == []
    lines = 0
    for at, name, start, end, count, skip in flight["ranges"]:
        data = (tmp_path / name).read_bytes()
        assert at == 0 and 0 <= skip < count
        assert start == 0 or data[start - 1 : start] == b"\n"
        assert data[start:end].count(b"\n") + (end == len(data) and data[-1:] != b"\n") == count
        lines += count - skip
    assert flight["next_seq"] == flight["first_seq"] + lines
    assert checkpoint.unstructure(checkpoint.structure(state)) == state  # the typed model's form


def _with_range(state: dict[str, Any], **change: Any) -> dict[str, Any]:
    flight = state["in_flight"]["par"]
    at, name, start, end, count, skip = flight["ranges"][0]
    record = {"at": at, "name": name, "start": start, "end": end, "count": count, "skip": skip}
    record.update(change)
    if record["skip"] is None:  # as many as the range holds
        record["skip"] = record["count"]
    fixed = [list(record.values()), *flight["ranges"][1:]]
    lines = sum(r[4] - r[5] for r in fixed)
    in_flight = {**flight, "ranges": fixed, "next_seq": flight["first_seq"] + lines}
    return {**state, "in_flight": {**state["in_flight"], "par": in_flight}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        pytest.param({"start": 1}, "is not .* whole lines", id="start-not-a-line-start"),
        pytest.param({"end": 10**6}, "ends at byte 1000000", id="end-past-the-file"),
        pytest.param({"name": "nope.txt"}, "cannot reopen", id="missing-file"),
        pytest.param({"start": "0"}, r"ranges must be a list of \[at, file", id="wrong-type"),
        pytest.param({"skip": None}, "skip < lines", id="skip-all-the-range"),
        pytest.param({"at": 5}, r"each 'at' <= len\(items\)", id="at-past-the-items"),
    ],
)
def test_damaged_ranges_are_refused(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    """A range in flight that is not whole lines of a file here (off a line
    start, past the end, a missing file, wrong types, a skip past its lines,
    out of order) is refused with ``CheckpointError``, changing nothing."""
    glob = _write(tmp_path, CORPUS)
    state = _state_mid_file(glob)
    with cp.Loader(_pipe(glob), _cfg(2)) as loader:
        with pytest.raises(cp.CheckpointError, match=message):
            loader.load_state_dict(_with_range(state, **change))
        assert list(loader) == EXPECTED["map"]  # nothing was loaded


def test_ranges_into_a_stage_that_reads_none_are_refused(tmp_path: Path) -> None:
    """Ranges in flight for a parallel stage that does not read from
    ``read_lines`` (another pipeline of the same shape) are refused."""
    glob = _write(tmp_path, CORPUS)
    state = _state_mid_file(glob)
    other = (
        cp.Pipeline.from_files(glob)
        .flat_map(_chars, name="lines")
        .map(_tag, parallel=True, name="par")
        .count("seen", weight_fn=len)
    )
    with cp.Loader(other, _cfg(2)) as loader:
        theirs = loader.state_dict()
        theirs["in_flight"]["par"] = state["in_flight"]["par"]
        with pytest.raises(cp.CheckpointError, match=r"in_flight\['par'\].ranges must be \[\]"):
            loader.load_state_dict(theirs)


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
def test_resuming_after_a_line_that_does_not_decode_goes_on_after_it(
    tmp_path: Path, on: bool
) -> None:
    """A checkpoint taken when a line failed to decode resumes after that
    line, with the path on or off: each bad line raises once, every good line
    is delivered once."""
    glob = _write(tmp_path, BAD)
    got: list[Any] = []
    errors: list[list[str]] = []
    state: dict[str, Any] | None = None
    for _ in range(4):
        with cp.Loader(_pipe(glob), _cfg(2, on=on)) as loader:
            if state is not None:
                loader.load_state_dict(state)
            try:
                got.extend(loader)
            except UnicodeDecodeError as exc:
                errors.append(exc.__notes__)
            state = loader.state_dict()
    assert got == ["<ok>", "<end>", "<next>"]
    where = [("a.txt", 3), ("a.txt", 15), ("b.txt", 0)]
    assert errors == [
        [f"(in file {str(tmp_path / name)!r} at byte offset {offset})", STAGE_NOTE]
        for name, offset in where
    ]


def _crash_on(line: str, *, at: str) -> str:
    if line == at:
        os._exit(3)
    return _tag(line)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_line_that_kills_every_worker_is_that_line_alone(tmp_path: Path, on_error: str) -> None:
    """A poison line inside a range: with ``on_error="raise"`` the lines before
    it are delivered, then ``WorkerError`` naming the stage and the line's
    seq; with ``"skip"`` only that line is missing, as when lines are sent."""
    import functools

    glob = _write(tmp_path, CORPUS)
    fn = functools.partial(_crash_on, at="line 9")
    pipe = cp.Pipeline.from_files(glob).read_lines().map(fn, parallel=True, name="par")
    seq = LINES.index("line 9")
    for on in (True, False):
        config = _cfg(2, chunk_size=8, on=on, on_error=on_error, max_restarts=10)
        got: list[Any] = []
        with cp.Loader(pipe, config) as loader:
            if on_error == "skip":
                got = list(loader)
                assert got == [_tag(x) for x in LINES if x != "line 9"], on
                continue
            with pytest.raises(cp.WorkerError) as info:
                got.extend(loader)
        assert got == EXPECTED["map"][:seq], on
        assert (info.value.stage, info.value.seq) == ("par", seq), on


def test_a_count_before_read_lines_keeps_lines_sent(tmp_path: Path) -> None:
    """A ``count`` of the paths before ``read_lines`` stamps each line as it is
    pulled, so lines are sent (no range), with the same lines and counts."""
    glob = _write(tmp_path, CORPUS)
    pipe = (
        cp.Pipeline.from_files(glob)
        .count("paths")
        .read_lines()
        .map(_tag, parallel=True, name="par")
    )
    with cp.Loader(pipe, _cfg(2)) as loader:
        assert list(loader) == EXPECTED["map"]
        assert loader.query("paths") == {"items": len(CORPUS), "weight": len(CORPUS)}
        assert loader.metrics()["par"]["parallel"]["lines_read_in_workers"] == 0


@pytest.mark.parametrize("flat_arrays", [True, False], ids=["flat-arrays", "pickled"])
def test_the_main_process_never_reads_the_lines_of_a_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flat_arrays: bool
) -> None:
    """The main process sends a range's fields, whatever else is on (flat
    arrays): only the workers read its bytes."""
    from centralpipe.dispatch.worker.ranges import LineRange

    main, read = os.getpid(), LineRange.read_bytes

    def read_in_a_worker_only(self: LineRange) -> bytes:
        assert os.getpid() != main, "the main process read the lines of a range"
        return read(self)

    monkeypatch.setattr(LineRange, "read_bytes", read_in_a_worker_only)
    glob = _write(tmp_path, {"a.txt": b"".join(b"line %d\n" % i for i in range(60))})
    out, _, _ = _run(_pipe(glob), _cfg(2, on=True, flat_arrays=flat_arrays))
    assert out == [f"<line {i}>" for i in range(60)]

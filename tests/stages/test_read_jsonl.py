"""``read_jsonl``: plain, gzip and zstd JSON lines, resumed by position, never replayed."""

from __future__ import annotations

import copy
import gzip
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
import centralpipe.stages.jsonl as jsonl_module
from centralpipe.stages import RunContext, build_central
from centralpipe.testing import assert_resumes_exactly, checkpoint_after, collect
from tests.support.configs import loader_config

zstandard = pytest.importorskip("zstandard")

RECORDS = [{"id": i, "text": "w" * (i % 5), "tags": ["a"] * (i % 3)} for i in range(40)]
LOCKSTEP = loader_config(buffer_size=1, chunk_size=1)


def _lines(records: list[Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def _pieces(data: bytes, n: int) -> list[bytes]:
    """``data`` cut into ``n`` pieces at arbitrary bytes (lines span pieces)."""
    step = len(data) // n + 1
    return [data[i : i + step] for i in range(0, len(data), step)]


def _write(path: Path, codec: str, data: bytes, blocks: int = 3) -> list[int]:
    """Write ``data`` as ``blocks`` gzip members / zstd frames; the block starts."""
    if codec == "plain":
        path.write_bytes(data)
        return [0]
    compress = gzip.compress if codec == "gzip" else zstandard.ZstdCompressor().compress
    parts = [compress(p) for p in _pieces(data, blocks)]
    path.write_bytes(b"".join(parts))
    starts, at = [], 0
    for p in parts:
        starts.append(at)
        at += len(p)
    return starts


SUFFIX = {"plain": ".jsonl", "gzip": ".jsonl.gz", "zstd": ".jsonl.zst"}


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Three files, one per codec, the same records split across them."""
    root = tmp_path / "data"
    root.mkdir()
    for i, (codec, part) in enumerate(
        (("plain", RECORDS[:13]), ("gzip", RECORDS[13:26]), ("zstd", RECORDS[26:]))
    ):
        _write(root / f"{i}{SUFFIX[codec]}", codec, _lines(part))
    return root


@pytest.mark.parametrize(
    ("field", "expect"),
    [(None, lambda r: r), ("id", lambda r: r["id"]), (lambda r: r["text"], lambda r: r["text"])],
    ids=["record", "field-name", "callable"],
)
@pytest.mark.parametrize(
    ("workers", "resume_workers"), [(0, 0), (2, 2), (2, 0)], ids=["0-0", "2-2", "2-0"]
)
def test_resumes_exactly_over_every_codec(
    dataset: Path, field: Any, expect: Any, workers: int, resume_workers: int
) -> None:
    """Plain, gzip and zstd files give every record once, in order, resumed at every k."""
    pipe = cp.Pipeline.from_files(str(dataset / "*")).read_jsonl(field=field).dispatch()
    full = assert_resumes_exactly(
        pipe,
        loader_config(num_workers=workers),
        resume_config=loader_config(num_workers=resume_workers),
    )
    assert full == [expect(r) for r in RECORDS]


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_state_inside_a_compressed_block_and_resume_reads_one_block(
    tmp_path: Path, codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint inside a block names that block and the bytes into it; the
    resume reads nothing of the file before that block."""
    data = _lines(RECORDS)
    path = tmp_path / f"x{SUFFIX[codec]}"
    starts = _write(path, codec, data, blocks=4)
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl(field="id")
    k = 31  # well inside the last block
    state = checkpoint_after(pipe, k, LOCKSTEP).state
    inner = state["central"]["read_jsonl_1"]
    consumed = len(_lines(RECORDS[:k]))
    piece = len(data) // 4 + 1
    assert inner == {
        "path": path.name,
        "block": starts[consumed // piece],
        "offset": consumed % piece,
        "line": k + 1,
        "skipped": 0,
    }
    assert inner["block"] > 0 and inner["offset"] > 0
    read = {"bytes": 0, "lowest": path.stat().st_size}
    opened = jsonl_module.open_binary

    class Counting:
        def __init__(self, f: Any) -> None:
            self._f = f

        def read(self, n: int = -1) -> bytes:
            read["lowest"] = min(read["lowest"], self._f.tell())
            out = self._f.read(n)
            read["bytes"] += len(out)
            return out

        def seek(self, offset: int, whence: int = 0) -> int:
            return self._f.seek(offset, whence)

        def close(self) -> None:
            self._f.close()

    monkeypatch.setattr(jsonl_module, "open_binary", lambda p, w: Counting(opened(p, w)))
    with cp.Loader(pipe, LOCKSTEP) as loader:
        loader.load_state_dict(state)
        assert collect(loader) == list(range(k, 40))
    # The magic check reads a few bytes at the block; nothing before it is read.
    assert read["lowest"] == inner["block"]
    assert read["bytes"] <= 2 * (path.stat().st_size - inner["block"])


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    """A line that is not JSON raises ValueError naming the file, the line and errors='skip'."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2\n{"a": 3}\n')
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl()
    with cp.Loader(pipe) as loader, pytest.raises(ValueError) as info:
        collect(loader)
    message = str(info.value)
    assert f"{str(path)!r} line 3: not JSON" in message
    assert "errors='skip'" in message


def test_skip_counts_malformed_lines_and_resumes(tmp_path: Path) -> None:
    """errors='skip' passes over lines that are not JSON or lack the field, counting them."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\nnot json\n{"b": 2}\n   \n{"a": 3}\n[1]\n{"a": 4}')
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl(field="a", errors="skip")
    full = assert_resumes_exactly(pipe, LOCKSTEP)
    assert full == [1, 3, 4]
    with cp.Loader(pipe, LOCKSTEP) as loader:
        assert collect(loader) == [1, 3, 4]
        assert loader.query("read_jsonl_1")["skipped"] == 3


def test_missing_field_is_an_error_by_default(tmp_path: Path) -> None:
    """A record without `field` raises ValueError naming the field, file and line."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl(field="a")
    with cp.Loader(pipe) as loader, pytest.raises(ValueError, match=r"line 2: no field 'a'"):
        collect(loader)


def _corrupt(state: dict[str, Any], **changes: Any) -> dict[str, Any]:
    state = copy.deepcopy(state)
    state["central"]["read_jsonl_1"].update(changes)
    return state


@pytest.mark.parametrize(
    ("codec", "changes", "match"),
    [
        ("plain", {"offset": 10**6}, "bytes but the checkpoint resumes at byte 1000000"),
        ("plain", {"offset": 5}, "not the start of a line"),
        ("plain", {"block": 7}, "block must be 0"),
        ("gzip", {"block": 10**6}, "bytes but the checkpoint resumes at byte 1000000"),
        ("gzip", {"block": 3}, "does not start a gzip block"),
        ("gzip", {"offset": 10**6}, "fewer than 1000000"),
        ("gzip", {"offset": 5}, "not the start of a line"),
        ("zstd", {"block": 1}, "does not start a zstd block"),
        ("zstd", {"offset": 10**6}, "fewer than 1000000"),
        ("plain", {"offset": -1}, "offset must be an int >= 0"),
        ("plain", {"line": 0}, "line must be an int >= 1"),
    ],
    ids=[
        "plain-past-end",
        "plain-mid-line",
        "plain-block",
        "gzip-block-past-end",
        "gzip-not-a-block",
        "gzip-offset-past-block",
        "gzip-mid-line",
        "zstd-not-a-block",
        "zstd-offset-past-block",
        "negative",
        "line-zero",
    ],
)
def test_damaged_positions_are_refused_at_load(
    tmp_path: Path, codec: str, changes: dict[str, Any], match: str
) -> None:
    """A position that cannot be a line start of the file is a CheckpointError at load."""
    path = tmp_path / f"x{SUFFIX[codec]}"
    _write(path, codec, _lines(RECORDS), blocks=2)
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl(field="id")
    state = checkpoint_after(pipe, 3, LOCKSTEP).state
    with cp.Loader(pipe, LOCKSTEP) as loader:
        with pytest.raises(cp.CheckpointError, match=match):
            loader.load_state_dict(_corrupt(state, **changes))
        assert collect(loader) == list(range(40))  # refused: the loader is as it was


def test_a_changed_file_is_refused(tmp_path: Path) -> None:
    """A file rewritten since the checkpoint (another size) is a CheckpointError."""
    path = tmp_path / "x.jsonl.gz"
    _write(path, "gzip", _lines(RECORDS))
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl(field="id")
    state = checkpoint_after(pipe, 5, LOCKSTEP).state
    _write(path, "gzip", _lines(RECORDS[:30]))
    with cp.Loader(pipe, LOCKSTEP) as loader, pytest.raises(cp.CheckpointError, match="changed"):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"field": 3}, "`field` must be None, a str"),
        ({"errors": "ignore"}, "`errors` must be 'strict' or 'skip'"),
    ],
    ids=["field-int", "errors-ignore"],
)
def test_bad_arguments_are_refused_at_build(kwargs: dict[str, Any], match: str) -> None:
    """A `field` that is neither str nor callable, or an unknown `errors`, is a PipelineError."""
    with pytest.raises(cp.PipelineError, match=match):
        cp.Pipeline.from_files(["x.jsonl"]).read_jsonl(**kwargs)


def test_zstd_without_zstandard_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a .zst file without zstandard is a PipelineError naming centralpipe[zstd]."""
    path = tmp_path / "x.jsonl.zst"
    _write(path, "zstd", _lines(RECORDS[:3]))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl()
    with cp.Loader(pipe) as loader, pytest.raises(cp.PipelineError, match=r"centralpipe\[zstd\]"):
        collect(loader)


def test_empty_files_and_blank_lines(tmp_path: Path) -> None:
    """Empty files and whitespace-only lines yield nothing; a last line without \\n is read."""
    (tmp_path / "a.jsonl").write_bytes(b"")
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "c.jsonl").write_bytes(b'\n \r\n"x"\r\n\t\n5')
    pipe = cp.Pipeline.from_files(str(tmp_path / "*")).read_jsonl()
    assert assert_resumes_exactly(pipe, LOCKSTEP) == ["x", 5]


@pytest.mark.parametrize("codec", ["plain", "gzip", "zstd"])
def test_a_last_line_without_newline_resumes_at_the_end(tmp_path: Path, codec: str) -> None:
    """A checkpoint after a last line without \\n (the end of the file) resumes to nothing more."""
    data = _lines(RECORDS[:5]).rstrip(b"\n")
    path = tmp_path / f"x{SUFFIX[codec]}"
    _write(path, codec, data, blocks=2)
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl(field="id")
    assert assert_resumes_exactly(pipe, LOCKSTEP) == list(range(5))
    state = checkpoint_after(pipe, 5, LOCKSTEP).state["central"]["read_jsonl_1"]
    assert state["line"] == 6 and state["offset"] > 0


#: Lines the bulk path hands back to produce(): blank (CRLF too), a "\x1c" line
#: (str.isspace says space, JSON does not), non-ASCII and non-UTF-8 bytes, lines
#: that are not JSON, lack the field or are not objects, one longer than the
#: bulk window, and a last line without "\n".
TRICKY = (
    b'{"a": 1}\n\n  \r\n{"a": 2}\r\n\x1c\n{"a": "\xc3\xa9"}\n{"a": "\xff"}\n'
    b'not json\n{"b": 3}\n[5]\n{"a": 4}\n{"a": 5}\n{"a": "' + b"x" * 5000 + b'"}\n{"a": 6}'
)
TRICKY_ITEMS = [1, 2, "é", 4, 5, "x" * 5000, 6]


def _chain(pipe: cp.Pipeline) -> list[Any]:
    nodes = build_central(pipe.central_stages, RunContext())
    for node in nodes:
        node.prepare()
    nodes[-1].load_flat(None)
    return nodes


def _pull_all(tip: Any, n: int) -> tuple[list[Any], list[tuple[int, dict[str, Any]]]]:
    """Every item of ``tip`` pulled ``n`` at a time, and (items so far, state) after each pull."""
    items: list[Any] = []
    states = []
    while True:
        try:
            tip.pull_into(items, n)
        except StopIteration:
            return items, states
        finally:
            states.append((len(items), {node.name: node.own_state() for node in tip.chain()}))


@pytest.mark.parametrize("codec", ["plain", "gzip", "zstd"])
@pytest.mark.parametrize("n", [2, 3, 64, 4096], ids=["n2", "n3", "n64", "n4096"])
def test_bulk_pulls_give_the_items_skips_and_positions_of_single_ones(
    tmp_path: Path, codec: str, n: int
) -> None:
    """pull_into(n) over lines the bulk path must hand back to produce() gives the
    items and skip count of pulling one at a time, and the state after each pull
    resumes a fresh chain at exactly the next item."""
    path = tmp_path / f"x{SUFFIX[codec]}"
    _write(path, codec, TRICKY, blocks=3)
    pipe = cp.Pipeline.from_files([str(path)]).read_jsonl(field="a", errors="skip")
    single = _chain(pipe)
    assert _pull_all(single[-1], 1)[0] == TRICKY_ITEMS
    nodes = _chain(pipe)
    items, states = _pull_all(nodes[-1], n)
    assert items == TRICKY_ITEMS
    assert nodes[-1].own_state()["skipped"] == single[-1].own_state()["skipped"] == 5
    assert states[-1][1]["read_jsonl_1"]["line"] == 1  # closed at the end
    for k, state in states:
        fresh = _chain(pipe)
        fresh[-1].load_flat(state)
        rest, _ = _pull_all(fresh[-1], n)
        assert items[:k] + rest == TRICKY_ITEMS, f"resumed after {k} items"


def test_bulk_pulls_raise_where_single_ones_do(tmp_path: Path) -> None:
    """With errors='strict', pull_into(64) yields the items before a malformed line,
    then raises naming its line, and goes on after it, as single pulls do."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n\n{"a": 3\n{"a": 4}\n')
    tip = _chain(cp.Pipeline.from_files([str(path)]).read_jsonl(field="a"))[-1]
    items: list[Any] = []
    tip.pull_into(items, 64)
    assert items == [1, 2]
    with pytest.raises(ValueError, match=r"line 4: not JSON"):
        tip.pull_into(items, 64)
    tip.pull_into(items, 64)
    assert items == [1, 2, 4]


class _Trip:
    """``fn``, except that its ``k``-th call raises KeyboardInterrupt (once)."""

    def __init__(self, fn: Any, k: int) -> None:
        self.fn, self.k, self.calls = fn, k, 0

    def __call__(self, record: Any) -> Any:
        self.calls += 1
        if self.calls == self.k:
            raise KeyboardInterrupt(f"injected at call {self.k}")
        return self.fn(record)


def _get_a(record: dict[str, Any]) -> Any:
    return record["a"]


@pytest.mark.parametrize("n", [1, 64], ids=["single", "bulk"])
@pytest.mark.parametrize("k", [1, 3, 7], ids=["k1", "k3", "k7"])
def test_ctrl_c_in_a_field_function_keeps_its_line(tmp_path: Path, n: int, k: int) -> None:
    """Ctrl-C inside a field function: the items before it stay pulled, and the
    line it was reading is read again by the next pull (nothing lost or repeated)."""
    path = tmp_path / "x.jsonl"
    path.write_bytes(b"".join(b'{"a": %d}\n' % i for i in range(10)))
    tip = _chain(cp.Pipeline.from_files([str(path)]).read_jsonl(field=_Trip(_get_a, k)))[-1]
    items: list[Any] = []
    with pytest.raises(KeyboardInterrupt):
        while True:
            tip.pull_into(items, n)
    assert items == list(range(k - 1))
    rest, _ = _pull_all(tip, n)
    assert items + rest == list(range(10))

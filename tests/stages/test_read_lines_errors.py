"""``read_lines(errors=...)``: open()'s decoding choices, with "strict" the default."""

from __future__ import annotations

from pathlib import Path

import pytest

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, collect
from tests.support.configs import loader_config

# A UTF-8 file with one line of Big5 bytes in the middle (as one badly
# encoded file of a corpus would be).
BIG5_LINE = "中文編碼測試".encode("big5")
LINES = [b"plain ascii", "naïve café".encode(), BIG5_LINE, b"", b"last"]
DATA = b"\n".join(LINES) + b"\n"


@pytest.fixture
def mixed(tmp_path: Path) -> str:
    path = tmp_path / "mixed.txt"
    path.write_bytes(DATA)
    return str(path)


def test_strict_is_the_default_and_names_file_and_offset(mixed: str) -> None:
    """By default a line that is not valid UTF-8 raises, naming the file and byte offset."""
    pipe = cp.Pipeline.from_files([mixed]).read_lines()
    with cp.Loader(pipe) as loader, pytest.raises(UnicodeDecodeError) as info:
        collect(loader)
    offset = len(LINES[0]) + 1 + len(LINES[1]) + 1
    assert f"(in file {mixed!r} at byte offset {offset})" in info.value.__notes__


@pytest.mark.parametrize(
    "errors", ["replace", "ignore", "backslashreplace", "surrogateescape"], ids=str
)
@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-workers"])
def test_errors_decode_as_open_does_and_resume_exactly(
    mixed: str, errors: str, workers: int
) -> None:
    """Each of open()'s decoding choices gives the lines open() gives, at every k."""
    pipe = cp.Pipeline.from_files([mixed]).read_lines(errors=errors).dispatch().map(str)
    config = loader_config(num_workers=workers)
    full = assert_resumes_exactly(pipe, config)
    with open(mixed, encoding="utf-8", errors=errors, newline="") as f:
        assert full == f.read().splitlines()
    assert full[2] == BIG5_LINE.decode("utf-8", errors)


def test_errors_other_encoding(tmp_path: Path) -> None:
    """`errors` applies to the chosen encoding too (ASCII with a Latin-1 byte)."""
    path = tmp_path / "x.txt"
    path.write_bytes(b"caf\xe9\nok\n")
    pipe = cp.Pipeline.from_files([str(path)]).read_lines(encoding="ascii", errors="replace")
    with cp.Loader(pipe) as loader:
        assert collect(loader) == ["caf\ufffd", "ok"]


@pytest.mark.parametrize("errors", ["xmlcharrefreplace", "namereplace", "bogus", None, 3], ids=repr)
def test_bad_errors_are_refused_at_build(errors: object) -> None:
    """An `errors` that cannot decode (or is no choice) is a PipelineError naming the choices."""
    with pytest.raises(cp.PipelineError, match=r"`errors` must be one of 'strict', 'replace'"):
        cp.Pipeline.from_files(["x.txt"]).read_lines(errors=errors)  # type: ignore[arg-type]

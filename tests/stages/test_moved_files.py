"""A checkpoint survives its dataset moving to another directory; a file list
that really changed is refused with the files added, removed or resized."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from tests.support.configs import loader_config

FILES = {"a.txt": b"one\ntwo\nthree\n", "b.txt": b"four\nfive\n", "sub/c.txt": b"six\nseven\n"}


def _write(root: Path) -> Path:
    for name, data in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def _glob(root: Path) -> cp.Pipeline:
    return cp.Pipeline.from_files(str(root / "**" / "*.txt")).read_lines().dispatch().map(str)


def _listed(root: Path, names: list[str]) -> cp.Pipeline:
    return cp.Pipeline.from_files([str(root / n) for n in names]).read_lines().dispatch().map(str)


def _state_after(pipe: cp.Pipeline, k: int, **config: Any) -> tuple[list[Any], dict[str, Any]]:
    with cp.Loader(pipe, loader_config(**config)) as loader:
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        return head, loader.state_dict()


def _resume(pipe: cp.Pipeline, state: dict[str, Any]) -> list[Any]:
    with cp.Loader(pipe, loader_config()) as loader:
        loader.load_state_dict(state)
        return list(loader)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [0, 2, 3, 5, 7])
@pytest.mark.parametrize("how", ["glob", "list"])
def test_checkpoint_resumes_after_the_dataset_moved(tmp_path: Path, k: int, how: str) -> None:
    """Copied to another directory (here also renamed), the dataset resumes
    exactly from a checkpoint taken in the middle of a file."""
    old = _write(tmp_path / "old" / "data")
    names = ["b.txt", "a.txt", "sub/c.txt"]  # a list keeps its order
    build = _glob if how == "glob" else (lambda root: _listed(root, names))
    with cp.Loader(build(old), loader_config()) as loader:
        full = list(loader)
    head, state = _state_after(build(old), k, chunk_size=1, buffer_size=1)
    new = tmp_path / "scratch" / "copy"
    shutil.copytree(old, new)
    shutil.rmtree(old)
    assert head + _resume(build(new), state) == full


@pytest.mark.timeout(60)
def test_checkpoint_names_files_relative_to_the_root(tmp_path: Path) -> None:
    """The checkpoint holds no absolute path: names relative to the glob's root."""
    root = _write(tmp_path / "data")
    _, state = _state_after(_glob(root), 2, chunk_size=1, buffer_size=1)
    flat = repr(state)
    assert str(tmp_path) not in flat
    assert "a.txt\t14" in state["central"]["files"]["listing"]
    assert state["central"]["read_lines_1"]["path"] == "a.txt"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(lambda r: (r / "d.txt").write_bytes(b"x\n"), r"added: d\.txt", id="added"),
        pytest.param(lambda r: (r / "b.txt").unlink(), r"removed: b\.txt", id="removed"),
        pytest.param(
            lambda r: (r / "sub" / "c.txt").write_bytes(b"six\nseven\neight\n"),
            r"changed size: sub/c\.txt \(10 -> 16 bytes\)",
            id="resized",
        ),
    ],
)
@pytest.mark.timeout(60)
def test_a_changed_file_list_is_refused_naming_the_files(
    tmp_path: Path, change: Any, expected: str
) -> None:
    """Files added, removed or changed in size are named in the refusal."""
    old = _write(tmp_path / "old")
    _, state = _state_after(_glob(old), 1)
    new = tmp_path / "new"
    shutil.copytree(old, new)
    change(new)
    with (
        cp.Loader(_glob(new), loader_config()) as loader,
        pytest.raises(cp.CheckpointError, match=expected),
    ):
        loader.load_state_dict(state)


@pytest.mark.timeout(60)
def test_a_list_in_another_order_is_refused(tmp_path: Path) -> None:
    """The same files listed in another order would read another stream."""
    root = _write(tmp_path / "data")
    _, state = _state_after(_listed(root, ["a.txt", "b.txt"]), 1)
    with (
        cp.Loader(_listed(root, ["b.txt", "a.txt"]), loader_config()) as loader,
        pytest.raises(cp.CheckpointError, match="the same files in another order"),
    ):
        loader.load_state_dict(state)


@pytest.mark.timeout(60)
def test_relative_and_absolute_globs_match(tmp_path: Path, monkeypatch: Any) -> None:
    """A checkpoint of `data/*.txt` run from one directory resumes with an
    absolute glob of the same files elsewhere."""
    root = _write(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    pipe = cp.Pipeline.from_files(os.path.join("data", "*.txt")).read_lines().dispatch().map(str)
    with cp.Loader(pipe, loader_config()) as loader:
        full = list(loader)
    head, state = _state_after(pipe, 4)
    moved = tmp_path / "elsewhere"
    shutil.move(str(root), str(moved))
    other = cp.Pipeline.from_files(str(moved / "*.txt")).read_lines().dispatch().map(str)
    assert head + _resume(other, state) == full

"""Every ```python block of the README and docs/ runs, or is marked as a fragment.

Each page's runnable blocks are joined, in order, into one script (after the
small PRELUDE below, which defines the helper names the docs use without
defining: ``cp``, ``tokenize``, ``collate_pad``, ``train_step``, ``num_sequences``,
``num_epochs``) and
run in a fresh directory holding the bundled corpus as ``data/*.txt``. A block
whose info string says ```` ```python fragment ```` is illustrative (a
signature, a printed dict, part of a larger program) and is only checked to be
marked so. The script is laid out as a user would write it (see ``as_script``).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_TIMEOUT_S = 240
BLOCK = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)

PRELUDE = """
import torch

import centralpipe as cp


def tokenize(line: str) -> list[int]:
    return [ord(c) % 128 for c in line]


def collate_pad(batch: list[list[int]]) -> torch.Tensor:
    width = max(len(x) for x in batch)
    return torch.tensor([x + [0] * (width - len(x)) for x in batch])


def train_step(batch: object) -> None:
    pass


num_sequences = 8000
num_epochs = 2
"""


def blocks(page: Path) -> list[tuple[str, str]]:
    """(info string, code) of each ```python block of ``page``."""
    return [(m.group(1).strip(), m.group(2)) for m in BLOCK.finditer(page.read_text())]


def _runnable(page: Path) -> list[str]:
    return [code for info, code in blocks(page) if "fragment" not in info.split()]


RUNNABLE = [p for p in PAGES if _runnable(p)]
#: The README's one runnable block runs exactly as printed, from the repository
#: root, in ``test_readme_snippet_runs_as_shown_from_the_repository_root``; the
#: other pages' blocks run with ``PRELUDE`` in ``test_page_runs``.
PAGES_RUN_WITH_PRELUDE = [p for p in RUNNABLE if p.name != "README.md"]


def as_script(code: str) -> str:
    """``code`` as a script a user would write: imports, functions and classes
    at module level (importable by forkserver/spawn workers), everything else
    under ``if __name__ == "__main__":`` (not re-run by them), in order."""
    tree = ast.parse(code)
    hoisted = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)
    top = [node for node in tree.body if isinstance(node, hoisted)]
    main = [node for node in tree.body if not isinstance(node, hoisted)]
    guard = ast.parse('if __name__ == "__main__":\n    pass').body[0]
    assert isinstance(guard, ast.If)
    guard.body = main or [ast.Pass()]
    return ast.unparse(ast.Module(body=[*top, guard], type_ignores=[]))


def test_docs_have_python_blocks() -> None:
    """The extraction finds the blocks (a changed fence style would silently test nothing)."""
    assert sum(len(blocks(p)) for p in PAGES) >= 40
    assert {p.name for p in RUNNABLE} >= {"README.md", "frameworks.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_block_is_python_or_marked(page: Path) -> None:
    """Every unmarked block at least compiles, so only real code is left unmarked."""
    for info, code in blocks(page):
        if "fragment" in info.split():
            continue
        compile(code, f"{page.name} block", "exec")


def _run(script: Path, *, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python script`` in ``cwd``, importing this checkout's centralpipe."""
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("page", PAGES_RUN_WITH_PRELUDE, ids=lambda p: p.name)
def test_page_runs(page: Path, tmp_path: Path) -> None:
    """The page's runnable blocks run in order as one script, on the bundled corpus."""
    for data in (tmp_path / "data", tmp_path / "examples" / "data"):
        data.mkdir(parents=True)
        for path in sorted((ROOT / "examples" / "data").glob("*.txt")):
            shutil.copy(path, data / path.name)
    script = tmp_path / f"{page.stem}_doc.py"
    script.write_text(as_script(PRELUDE + "\n\n".join(_runnable(page))))
    proc = _run(script, cwd=tmp_path)
    assert proc.returncode == 0, f"{page.name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_readme_snippet_runs_as_shown_from_the_repository_root(tmp_path: Path) -> None:
    """The README's 30-second snippet, exactly as printed (no prelude), run from
    the repository root as a new user would: it finds the bundled corpus, resumes
    after batch 10, and no batch is the blank lines' batch of empty rows."""
    (code,) = _runnable(ROOT / "README.md")
    check = """
if __name__ == "__main__":
    assert state is not None and rest, "the snippet delivered nothing after its checkpoint"
    assert all(len(row) > 0 for batch in rest for row in batch), "a batch holds an empty line"
    print("README-OK", step, len(rest))
"""
    script = tmp_path / "readme_snippet.py"
    script.write_text(code + check)
    proc = _run(script, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "README-OK 10 " in proc.stdout


# -- printed outputs: a fragment that shows what the library returns must match it ------


def _fragment_after(page: Path, marker: str) -> Any:
    """The first ```python fragment block after ``marker`` on ``page``, evaluated
    as a literal (``...`` stands for a shortened list)."""
    text = page.read_text()
    start = text.index(marker)
    info, code = next(
        (m.group(1).strip(), m.group(2)) for m in BLOCK.finditer(text) if m.start() > start
    )
    assert "fragment" in info.split(), (page.name, marker)
    return ast.literal_eval(code)


def _shorten(rng: list[Any]) -> list[Any]:
    """A shuffle's generator state as the docs print it: three ints, ..., the last."""
    version, ints, gauss = rng
    return [version, [*ints[:3], ..., ints[-1]], gauss]


def test_concepts_checkpoint_is_the_real_one() -> None:
    """The checkpoint printed in docs/concepts.md is, key for key and value for
    value, the one its text says it comes from (generator state shortened)."""
    printed = _fragment_after(ROOT / "docs" / "concepts.md", "A real checkpoint.")
    pipe = cp.Pipeline.from_iterable(range(20)).shuffle(4).count("seen").batch(3)
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=0, buffer_size=4, chunk_size=2))
    with cp.Loader(pipe.dispatch().collate(), config) as loader:
        it = iter(loader)
        assert next(it).tolist() == [0, 4, 3]
        real = loader.state_dict()
    real["central"]["shuffle_1"]["rng"] = _shorten(real["central"]["shuffle_1"]["rng"])
    assert printed == real


def _shape(value: Any) -> Any:
    """The keys of nested dicts (what a printed example must not get wrong)."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    return type(value).__name__ if isinstance(value, (list, bool)) else "value"


def test_concepts_metrics_have_the_real_keys() -> None:
    """The metrics printed in docs/concepts.md have exactly the keys of a real
    run of the quickstart pipeline with the config the text names, and its
    config-given values (timing-dependent counts differ from run to run)."""
    printed = _fragment_after(ROOT / "docs" / "concepts.md", "## Metrics")
    pipe = (
        cp.Pipeline.from_iterable(range(1000))
        .shuffle(100)
        .count("seen")
        .batch(8)
        .dispatch()
        .collate()
    )
    workers = cp.WorkerConfig(num_workers=2, buffer_size=64, chunk_size=4, start_method="fork")
    with cp.Loader(pipe, cp.LoaderConfig(workers=workers)) as loader:
        it = iter(loader)
        for _ in range(48):
            next(it)
        real = loader.metrics()
    assert _shape(printed) == _shape(real)
    fixed = ("num_workers", "delivered", "buffer_size", "buffer_bytes", "chunk_size", "skipped")
    for d in (printed["dispatch"], real["dispatch"]):
        assert d["buffered"] == d["dispatched"] - d["delivered"]
        assert d["delivered"] <= sum(d["items_per_worker"]) <= d["dispatched"]
    assert {k: printed["dispatch"][k] for k in fixed} == {k: real["dispatch"][k] for k in fixed}


def test_api_metrics_lists_the_real_keys() -> None:
    """docs/api.md's row for metrics() names exactly the dispatch and transport keys."""
    row = next(
        line
        for line in (ROOT / "docs" / "api.md").read_text().splitlines()
        if line.startswith("| `metrics() ")
    )
    dispatch_part = row.split('"dispatch": {', 1)[1].split("}", 1)[0]
    transport_part = row.split('`"transport"`', 1)[1].split("}", 1)[0]
    pipe = cp.Pipeline.from_iterable(range(8)).dispatch().map(str)
    workers = cp.WorkerConfig(num_workers=1, start_method="fork")
    with cp.Loader(pipe, cp.LoaderConfig(workers=workers)) as loader:
        list(loader)
        real = loader.metrics()["dispatch"]
    assert re.findall(r'"(\w+)"', dispatch_part) == list(real)
    assert re.findall(r'"(\w+)"', transport_part) == list(real["transport"])

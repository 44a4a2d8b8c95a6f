"""Every script in ``examples/`` runs and does what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TOKEN_BUCKETS = EXAMPLES / "token_buckets.py"
RUN_TIMEOUT_S = 120

#: Examples run with arguments by a dedicated test below (file name -> test).
COVERED = {
    "token_buckets.py": "test_token_buckets_resumes_exactly",
    "make_corpus.py": "test_make_corpus_writes_the_committed_corpus",
    "packed_pretraining.py": "test_packed_pretraining_reports_fill_and_resumes",
}


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )


def _resumed_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if "resumed exactly:" in line]


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--workers", "2"], id="2workers"),
        pytest.param(["--workers", "0", "--buffer-size", "unlimited"], id="inline-unlimited"),
        pytest.param(["--workers", "2", "--buffer-size", "unlimited"], id="2workers-unlimited"),
        pytest.param(["--workers", "2", "--central", "node"], id="2workers-node"),
    ],
)
def test_token_buckets_resumes_exactly(args: list[str], tmp_path: Path) -> None:
    """The motivating pipeline checkpoints half-way, resumes from the file and
    matches the uninterrupted run."""
    ckpt = tmp_path / "ckpt.pt"
    proc = _run(TOKEN_BUCKETS, *args, "--checkpoint", ckpt)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = _resumed_lines(proc.stdout)
    assert line.startswith("resumed exactly: ")
    assert f"(rank 0/1, {args[1]} workers)" in line
    assert "checkpoint: saved at batch " in proc.stdout
    assert ckpt.stat().st_size > 0


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--workers", "2"], id="best_fit-2workers"),
    ],
)
def test_packed_pretraining_reports_fill_and_resumes(args: list[str]) -> None:
    """The mixed, packed pre-training example reports fill rate and totals, resumes
    exactly, and resumes under new weights losing and repeating nothing."""
    proc = _run(EXAMPLES / "packed_pretraining.py", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fill rate " in proc.stdout and "known totals: lines web 3600, books 4400" in proc.stdout
    (line,) = _resumed_lines(proc.stdout)
    assert line.startswith("resumed exactly: ") and f"({args[1]} workers)" in line
    assert "every sequence of both corpora delivered once" in proc.stdout


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_make_corpus_writes_the_committed_corpus(tmp_path: Path) -> None:
    """``make_corpus.py`` is deterministic: it rewrites examples/data byte for byte."""
    proc = _run(EXAMPLES / "make_corpus.py", "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    committed = sorted(p.name for p in (EXAMPLES / "data").glob("*.txt"))
    written = sorted(p.name for p in tmp_path.glob("*.txt"))
    assert written == committed
    for name in written:
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), name


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs_without_arguments(script: str) -> None:
    """Each example not run by a dedicated test runs with no arguments."""
    if script in COVERED:
        pytest.skip(f"run with arguments by {COVERED[script]}")
    proc = _run(EXAMPLES / script)
    assert proc.returncode == 0, proc.stdout + proc.stderr

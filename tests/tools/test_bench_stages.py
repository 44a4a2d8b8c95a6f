"""The ``stages`` section of ``python -m centralpipe bench`` (mix and pack costs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from centralpipe.tools import bench_stages

REPO = Path(__file__).resolve().parents[2]
BENCH_TIMEOUT_S = 120


def test_measure_reports_every_stage_and_target() -> None:
    """measure() gives a cost per item for mix and both pack strategies, and two targets."""
    stages = bench_stages.measure(scale=100)
    assert set(stages) == {"mix", "pack_best_fit", "pack_first_fit"}
    assert all(r["items"] > 0 and r["cost_s"] >= 0 for r in stages.values())
    lines = bench_stages.report_lines(stages)
    assert any("Pipeline.mix of 3" in line for line in lines)
    assert [t[0] for t in bench_stages.targets(stages)] == [
        "mix of 3 sources: < 2 µs per item",
        "pack(buffer_size=10_000), best_fit: < 20 µs per item",
    ]
    assert bench_stages.report_lines({}) == [] and bench_stages.targets({}) == []


@pytest.mark.timeout(BENCH_TIMEOUT_S + 30)
def test_bench_only_stages_prints_the_section() -> None:
    """`bench --scale 100 --only stages` prints the central-stage table and its targets."""
    proc = subprocess.run(
        [sys.executable, "-m", "centralpipe", "bench", "--scale", "100", "--only", "stages"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "## Central stages (main-process cost per item)" in proc.stdout
    assert "| mix of 3 sources: < 2 µs per item |" in proc.stdout

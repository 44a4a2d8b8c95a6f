"""The bench's start-up part: first-item rows per start method and function,
the cold epoch's two functions, and their targets (never asserting a speed)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from centralpipe.config import START_METHODS
from centralpipe.tools import bench, bench_report, bench_transport
from centralpipe.tools.bench_transport import FUNCTIONS, INLINE, NO_TORCH_IN_SERVER


def test_startup_child_times_a_first_and_a_later_loader() -> None:
    """The fresh process the startup section runs (here with the option that
    keeps torch out of the server) prints two positive times."""
    _assert_child_times(["fork", "0", FUNCTIONS[NO_TORCH_IN_SERVER], "light"])


def test_startup_rows_and_targets() -> None:
    """Each (method, function, gap) gets a row; every start method's first
    Loader gets the 150 ms and 1.5 s targets for both functions as a user
    gets them, judged as stated; the options are reported, not judged."""
    startup = {
        ("fork", "no torch", 0.0): (0.02, 0.01),
        ("spawn", "torch module", 1.5): (0.1, 0.2),
        ("forkserver", INLINE, 0.0): (2.0, 0.03),
        ("forkserver", "no torch", 0.0): (0.6, 0.03),
        ("forkserver", "no torch", 1.5): (0.004, 0.003),
        ("forkserver", "torch module", 0.0): (2.0, 0.03),
        ("forkserver", "torch module", 1.5): (0.4, 0.003),
        ("forkserver", NO_TORCH_IN_SERVER, 1.5): (0.9, 0.8),
    }
    lines = bench_transport.report_lines(startup)
    assert "| forkserver | torch module | 1.5 | 400 | 3 |" in lines
    assert f"| forkserver | {NO_TORCH_IN_SERVER} | 1.5 | 900 | 800 |" in lines
    got = {name: ok for name, _, ok in bench_transport.targets(startup)}
    assert got == {
        "first item, first Loader, fork, no torch, no gap: <= 1.5 s": True,
        "first item, first Loader, spawn, torch module, after 1.5 s of work: <= 150 ms": True,
        "first item, first Loader, forkserver, no torch, after 1.5 s of work: <= 150 ms": True,
        "first item, first Loader, forkserver, no torch, no gap: <= 1.5 s": True,
        "first item, first Loader, forkserver, torch module, after 1.5 s of work: <= 150 ms": (
            False
        ),
        "first item, first Loader, forkserver, torch module, no gap: <= 1.5 s": False,
    }
    assert bench_transport.report_lines({}) == [] and bench_transport.targets({}) == []


def test_cold_epoch_rows_for_both_functions() -> None:
    """The cold cpu epoch reports the torch-free function, the torch module's
    and that one with the opt-in inline warm start; both defaults are targets."""
    res = bench.Results()
    res.cold = bench_transport.ColdEpoch(4000, 2, serial_s=4.0, first_s=0.2, total_s=2.5)
    res.cold_torch = bench_transport.ColdEpoch(
        4000, 2, serial_s=4.0, first_s=1.2, total_s=3.5, fn="torch module", inline_items=0
    )
    res.cold_torch_inline = bench_transport.ColdEpoch(
        4000, 2, serial_s=4.0, first_s=0.01, total_s=3.9, fn=INLINE, inline_items=900
    )
    text = bench.report(res)
    assert "| no torch | 4.00 | 2.50 | 1.60x | 200 | - |" in text
    assert "| torch module | 4.00 | 3.50 | 1.14x | 1200 | 0 |" in text
    assert f"| {INLINE} | 4.00 | 3.90 | 1.03x | 10 | 900 |" in text
    got = {name: ok for name, _, ok in bench_report._targets(res)}
    cold = [k for k in got if k.startswith("cpu, 2 workers, a process's first Loader")]
    assert [got[k] for k in cold] == [True, False]
    assert "(torch module)" in cold[1]


def test_startup_section_measures_every_start_method_first_and_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`bench --only startup` measures fork, forkserver and spawn, each in a
    fresh process per gap, and reports a first and a later Loader for each
    (children faked here: the plumbing, not the timings)."""
    runs: list[list[str]] = []

    def child(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        runs.append(cmd[3:])
        return subprocess.CompletedProcess(cmd, 0, stdout="0.250000 0.020000\n", stderr="")

    monkeypatch.setattr(bench_transport.subprocess, "run", child)
    startup = bench_transport.measure_startup(START_METHODS)
    assert set(START_METHODS) == {"fork", "forkserver", "spawn"}
    assert {method for method, _, _ in startup} == {"fork", "forkserver", "spawn"}
    assert {gap for _, _, gap in startup} == set(bench_transport.GAPS_S)
    assert len(runs) == len(startup)  # one fresh process per row
    lines = bench_transport.report_lines(startup)
    for method in START_METHODS:
        assert f"| {method} | no torch | 0 | 250 | 20 |" in lines


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_startup_child_runs_for_the_other_start_methods(method: str) -> None:
    """The startup section's fresh process times a first and a later Loader
    under forkserver and spawn too."""
    _assert_child_times([method, "0", "builtins:abs", "auto"])


def _assert_child_times(args: list[str]) -> None:
    """The startup section's child, run with ``args``, prints two positive times."""
    done = subprocess.run(
        [sys.executable, "-c", bench_transport._CHILD, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, later = (float(x) for x in done.stdout.split())
    assert first > 0 and later > 0

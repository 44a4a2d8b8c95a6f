"""Start-up in the bench: time to the first item, and a whole cold epoch.

Each measurement runs in a fresh interpreter, so the first ``Loader`` of a
process really is the first (no forkserver running, nothing imported).

- ``--only startup``: a Loader with 2 workers, optionally ``gap_s`` of other
  work (as a program building a model would), then ``next(iter(loader))``
  timed; then the same with a second Loader in the same process.
- ``--only cpu``: one whole epoch of the ``cpu`` workload with 2 workers by a
  process's first Loader, from creating it to the last item (forkserver and
  workers' start-up included), against a serial loop in the same process.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "GAPS_S",
    "ColdEpoch",
    "measure_cold_epoch",
    "measure_startup",
    "report_lines",
    "targets",
]

#: Work between ``Loader(...)`` and ``iter()``: none, and a model build.
GAPS_S = (0.0, 1.5)

_CHILD = """
import sys, time
import centralpipe as cp


def main():
    method, gap = sys.argv[1], float(sys.argv[2])
    out = []
    for _ in range(2):
        pipe = cp.Pipeline.from_iterable(range(8)).dispatch().map(abs)
        config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=2, start_method=method))
        loader = cp.Loader(pipe, config)
        deadline = time.perf_counter() + gap
        while time.perf_counter() < deadline:  # busy, as model building is
            pass
        t0 = time.perf_counter()
        next(iter(loader))
        out.append(time.perf_counter() - t0)
        loader.close()
    print(" ".join(f"{x:.6f}" for x in out))

if __name__ == "__main__":
    main()
"""


_COLD_CHILD = """
import sys, time
import centralpipe as cp
from centralpipe.bench_workloads import Spin


def main():
    method = None if sys.argv[1] == "default" else sys.argv[1]
    spin, n, workers = Spin(int(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
    t0 = time.perf_counter()
    for i in range(n):
        spin(i)
    serial = time.perf_counter() - t0
    pipe = cp.Pipeline.from_iterable(range(n)).dispatch().map(spin)
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=workers, start_method=method))
    t0 = time.perf_counter()
    with cp.Loader(pipe, config) as loader:
        it = iter(loader)
        next(it)
        first = time.perf_counter() - t0
        count = 1 + sum(1 for _ in it)
        total = time.perf_counter() - t0
    assert count == n, count
    print(serial, first, total)

if __name__ == "__main__":
    main()
"""


class ColdEpoch(NamedTuple):
    """One cold epoch: serial loop, first item and whole epoch, in seconds."""

    n: int
    workers: int
    serial_s: float
    first_s: float
    total_s: float


def measure_cold_epoch(
    iterations: int, n: int, workers: int, start_method: str | None
) -> ColdEpoch:
    """A fresh process times ``n`` ``Spin(iterations)`` items serially, then
    through its first Loader (``workers`` workers), start-up included."""
    args = [start_method or "default", str(iterations), str(n), str(workers)]
    done = subprocess.run(
        [sys.executable, "-c", _COLD_CHILD, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    serial, first, total = (float(x) for x in done.stdout.split())
    return ColdEpoch(n, workers, serial, first, total)


def cold_lines(cold: ColdEpoch | None) -> list[str]:
    if cold is None:
        return []
    return [
        "",
        "## cpu, a cold epoch",
        "",
        f"A fresh process: {cold.n:,} `cpu` items in a serial loop, then the same items "
        f"through its first Loader with {cold.workers} workers, timed from creating the "
        "Loader to the last item (forkserver and worker start-up included).",
        "",
        "| serial s | centralpipe s | / serial | start-up (first item) ms |",
        "|--:|--:|--:|--:|",
        f"| {cold.serial_s:.2f} | {cold.total_s:.2f} | {cold.serial_s / cold.total_s:.2f}x "
        f"| {cold.first_s * 1e3:.0f} |",
    ]


def cold_targets(cold: ColdEpoch | None) -> list[tuple[str, str, bool]]:
    if cold is None:
        return []
    r = cold.serial_s / cold.total_s
    return [
        (
            f"cpu, {cold.workers} workers, a process's first Loader, whole epoch incl. "
            "start-up: >= 1.3x serial",
            f"{r:.2f}x (start-up {cold.first_s * 1e3:.0f} ms)",
            r >= 1.3,
        )
    ]


def measure_startup(
    methods: Sequence[str], gaps_s: Sequence[float] = GAPS_S
) -> dict[tuple[str, float], tuple[float, float]]:
    """``(method, gap) -> (first loader, later loader)`` seconds from ``iter()``
    to the first item, each pair from one fresh process."""
    out: dict[tuple[str, float], tuple[float, float]] = {}
    for method in methods:
        for gap in gaps_s:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, method, str(gap)],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            first, later = (float(x) for x in done.stdout.split())
            out[(method, gap)] = (first, later)
    return out


#: Targets for the first item of a process's first Loader (forkserver, the default).
FIRST_ITEM_AFTER_GAP_S = 0.150
FIRST_ITEM_ANY_S = 1.5


def report_lines(startup: dict[tuple[str, float], tuple[float, float]]) -> list[str]:
    if not startup:
        return []
    lines = [
        "",
        "## First item",
        "",
        "ms from `iter()` to the first item, 2 workers, each row a fresh process: its "
        "first Loader, then a second one. Gap: CPU work between `Loader(...)` and `iter()`.",
        "",
        "| start method | gap s | first Loader ms | later Loader ms |",
        "|---|--:|--:|--:|",
    ]
    for (method, gap), (first, later) in startup.items():
        lines.append(f"| {method} | {gap:g} | {first * 1e3:.0f} | {later * 1e3:.0f} |")
    return lines


def targets(startup: dict[tuple[str, float], tuple[float, float]]) -> list[tuple[str, str, bool]]:
    out = []
    after = startup.get(("forkserver", GAPS_S[-1]))
    if after is not None:
        out.append(
            (
                f"first item, first Loader, forkserver, after {GAPS_S[-1]:g} s of work: <= 150 ms",
                f"{after[0] * 1e3:.0f} ms",
                after[0] <= FIRST_ITEM_AFTER_GAP_S,
            )
        )
    cold = startup.get(("forkserver", GAPS_S[0]))
    if cold is not None:
        out.append(
            (
                "first item, first Loader, forkserver, no gap: <= 1.5 s",
                f"{cold[0] * 1e3:.0f} ms",
                cold[0] <= FIRST_ITEM_ANY_S,
            )
        )
    return out

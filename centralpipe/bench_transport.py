"""``python -m centralpipe bench --only startup``: time to the first item.

Each measurement runs in a fresh interpreter, so the first ``Loader`` of a
process really is the first (no forkserver running, nothing imported): it
creates a Loader with 2 workers, optionally spends ``gap_s`` on other work
(as a program building a model would), then times ``next(iter(loader))``;
then it does the same with a second Loader in the same process.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

__all__ = ["GAPS_S", "measure_startup", "report_lines", "targets"]

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

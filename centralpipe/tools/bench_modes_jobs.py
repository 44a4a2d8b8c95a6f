"""``bench_modes_job --all``: the whole-job CPU comparison of the central modes.

One torchrun launch per row (:mod:`centralpipe.tools.bench_modes_job`), in
rounds of three rows in a fixed order — 1-rank ``process``, 2-rank
``process``, 2-rank ``node`` — so that a change of the machine's load
between minutes lands in one round rather than in one mode. After the rows,
each round's ratios: the job CPU of 2 ranks against 1 in each mode (the
issue's target: ``node`` at most 1.15x), and the per-rank lines/s of
``node`` against ``process`` at 2 ranks (target: at least 1x).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

__all__ = ["ROWS", "Row", "parse_row", "run_all"]

#: ``(central, ranks)`` of each round's rows, in launch order.
ROWS = (("process", 1), ("process", 2), ("node", 2))
HEADER = (
    "| `central` | tokenize | ranks | job CPU s / epoch | lines/s per rank | wall s / epoch "
    "| `query()` ms |\n|---|---|--:|--:|--:|--:|--:|"
)


@dataclass
class Row:
    """One row that ``bench_modes_job`` printed."""

    central: str
    ranks: int
    cpu: float
    rates: list[float]
    wall: float
    query_ms: float


def parse_row(line: str) -> Row:
    """The fields of one row that ``bench_modes_job`` printed."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    rates = [float(x.replace(",", "")) for x in cells[4].split(", ")]
    return Row(cells[0], int(cells[2]), float(cells[3]), rates, float(cells[5]), float(cells[6]))


def _launch(central: str, ranks: int, epochs: int, repeat: int, workers: int) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        "--nnodes=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--rdzv-id=bench-{uuid.uuid4().hex}",
        "-m",
        "centralpipe.tools.bench_modes_job",
        f"--central={central}",
        f"--epochs={epochs}",
        f"--repeat={repeat}",
        f"--workers={workers}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return rows[-1]


def run_all(rounds: int, epochs: int, repeat: int, workers: int) -> None:
    """Print the rows, then each round's ratios and their medians."""
    print(HEADER, flush=True)
    results: list[dict[tuple[str, int], Row]] = []
    for _ in range(rounds):
        got: dict[tuple[str, int], Row] = {}
        for central, ranks in ROWS:
            started = time.strftime("%H:%M:%S", time.gmtime())
            row = _launch(central, ranks, epochs, repeat, workers)
            print(f"{row} <!-- {started} UTC -->", flush=True)
            got[(central, ranks)] = parse_row(row.split(" <!--")[0])
        results.append(got)
    print()
    print(
        "| round | process 2 / 1 ranks, CPU | node 2 ranks / process 1, CPU "
        "| node / process lines/s per rank, 2 ranks |"
    )
    print("|--:|--:|--:|--:|")
    cpu_p, cpu_n, rate = [], [], []
    for i, got in enumerate(results, 1):
        one = got[("process", 1)].cpu
        cpu_p.append(got[("process", 2)].cpu / one)
        cpu_n.append(got[("node", 2)].cpu / one)
        rate.append(min(got[("node", 2)].rates) / min(got[("process", 2)].rates))
        print(f"| {i} | {cpu_p[-1]:.2f}x | {cpu_n[-1]:.2f}x | {rate[-1]:.2f}x |")
    print(
        f"| median | {statistics.median(cpu_p):.2f}x | {statistics.median(cpu_n):.2f}x "
        f"| {statistics.median(rate):.2f}x |",
        flush=True,
    )

"""The results of ``python -m centralpipe bench`` and its markdown report.

:class:`Results` holds what a run of :mod:`centralpipe.tools.bench` measured;
:func:`report` renders it: the machine and start methods, the throughput
table (items/s and ratios to ``serial`` and the peers), the transport table,
each other section's lines, and whether each target was met.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torchdata

import centralpipe as cp
from centralpipe.tools import (
    bench_modes,
    bench_seed,
    bench_sources,
    bench_stages,
    bench_state,
    bench_transport,
)
from centralpipe.tools.bench_contenders import STOCK_SOCKET_BUFFER_BYTES, Timing

__all__ = ["CAPPED", "LIMIT", "NOISY_SHARE", "Results", "report"]

#: A throughput cell is measured again when other processes used more than
#: this share of the machine meanwhile.
NOISY_SHARE = 0.10
CAPPED = "centralpipe, capped socket buffers"
LIMIT = "slot-pool limit"


@dataclass
class Results:
    sizes: dict[str, str] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    forkserver_boot_s: float | None = None
    socket_bytes: int | None = None
    serial: dict[str, Timing] = field(default_factory=dict)
    # (workload, workers) -> contender -> Timing
    cells: dict[tuple[str, int], dict[str, Timing]] = field(default_factory=dict)
    cold: bench_transport.ColdEpoch | None = None
    #: The cold epoch again, its function from a module that imports torch.
    cold_torch: bench_transport.ColdEpoch | None = None
    #: That one with ``start_inline=True``: the opt-in inline warm start.
    cold_torch_inline: bench_transport.ColdEpoch | None = None
    state: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Any] = field(default_factory=dict)
    startup: bench_transport.Startup = field(default_factory=dict)
    seed: list[bench_seed.TokenizerResult] = field(default_factory=list)
    modes: bench_modes.ModesResult | None = None
    elapsed_s: float = 0.0
    repeat: int = 1
    retries: int = 1
    # share of the machine other processes used: whole run, and per throughput cell
    others: float | None = None
    cell_others: dict[tuple[str, int], float | None] = field(default_factory=dict)
    cell_attempt: dict[tuple[str, int], int] = field(default_factory=dict)


# -- the report -----------------------------------------------------------------------


def _rate(x: float) -> str:
    return f"{x:,.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _attempt(res: Results, wname: str, k: int) -> str:
    n = res.cell_attempt.get((wname, k), 1)
    return "" if n == 1 else f" (try {n})"


def _header(res: Results, argv: Sequence[str]) -> list[str]:
    m = res.methods
    boot = (
        f" (server start-up {res.forkserver_boot_s * 1e3:.0f} ms, once per process, before "
        "the timings)"
        if res.forkserver_boot_s is not None
        else ""
    )
    sock = (
        f"{res.socket_bytes:,} bytes (`--socket-buffer`)"
        if res.socket_bytes is not None
        else "the library's request (4 MiB, capped by the host's `net.core.wmem_max`)"
    )
    lines = [
        "# centralpipe bench",
        "",
        f"- command: `python -m centralpipe bench{' ' if argv else ''}{' '.join(argv)}`",
        f"- machine: {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"torchdata {torchdata.__version__}, centralpipe {cp.__version__}",
        f"- start methods: centralpipe `{m.get('centralpipe')}`{boot}; DataLoader "
        f"`{m.get('DataLoader')}`; ParallelMapper `{m.get('ParallelMapper')}`; serial: a plain "
        "loop in the main process",
        f"- centralpipe's worker pipes: socket buffers of {sock}",
        f"- other processes' CPU use during the run: {_share(res.others)} of the machine"
        " (from psutil; when it is high, they took CPU time from the contenders)",
    ]
    lines += [f"- `{name}`: {size}" for name, size in res.sizes.items()]
    return lines


def _throughput(res: Results) -> list[str]:
    if not res.cells:
        return []
    lines = [
        "",
        "## Throughput",
        "",
        "items/s: one whole epoch, from creating the loader to its last item, worker "
        "start-up included"
        + (f" (best of {res.repeat} epochs)" if res.repeat > 1 else "")
        + ". first item: ms from creating the loader to the first item. others' CPU: the "
        "share of the machine that processes outside this benchmark used meanwhile; a "
        f"cell above {NOISY_SHARE:.0%} is measured again (up to {res.retries} more "
        "time(s)) and the quietest try is shown.",
        "",
        "| workload | workers | serial items/s | centralpipe items/s | DataLoader items/s "
        "| ParallelMapper items/s | cp / DL | cp / PM | cp / serial "
        "| first item ms (cp / DL / PM) | others' CPU |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for (wname, k), cell in res.cells.items():
        c, d, p = cell["centralpipe"], cell["DataLoader"], cell["ParallelMapper"]
        s = res.serial[wname]
        firsts = " / ".join(f"{t.first_s * 1e3:.0f}" for t in (c, d, p))
        lines.append(
            f"| {wname} | {k} | {_rate(s.rate)} | {_rate(c.rate)} | {_rate(d.rate)} "
            f"| {_rate(p.rate)} | {_ratio(c.rate, d.rate)} | {_ratio(c.rate, p.rate)} "
            f"| {_ratio(c.rate, s.rate)} | {firsts} "
            f"| {_share(res.cell_others.get((wname, k)))}{_attempt(res, wname, k)} |"
        )
    return lines


def _transport(res: Results) -> list[str]:
    rows = [(key, cell) for key, cell in res.cells.items() if CAPPED in cell]
    if not rows:
        return []
    lines = [
        "",
        "## Transport",
        "",
        "centralpipe on the large-buffer workloads, its worker pipes asking for the default "
        f"socket buffers and for a stock kernel's limit ({STOCK_SOCKET_BUFFER_BYTES:,} bytes), "
        "in the same cell. slot-pool limit: a minimal loader that only moves the same "
        "tensors through a pool of shared-memory slots, in order (`bench_limit`): what the "
        "machine allows at the time. shared memory: the share of the result bytes that came "
        "through the workers' shared-memory rings (the rest went through the pipes).",
        "",
        "| workload | workers | items/s | capped items/s | capped / default | capped / DL "
        "| slot-pool limit items/s | cp / limit | shared memory (default / capped) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for (wname, k), cell in rows:
        c, cap, d = cell["centralpipe"], cell[CAPPED], cell["DataLoader"]
        lim = cell.get(LIMIT)
        limit = f"| {_rate(lim.rate)} | {_ratio(c.rate, lim.rate)} " if lim else "| — | — "
        lines.append(
            f"| {wname} | {k} | {_rate(c.rate)} | {_rate(cap.rate)} | {_ratio(cap.rate, c.rate)} "
            f"| {_ratio(cap.rate, d.rate)} {limit}"
            f"| {_share(c.shm_share)} / {_share(cap.shm_share)} |"
        )
    return lines


def report(res: Results, *, argv: Sequence[str] = ()) -> str:
    """The results as markdown."""
    lines = _header(res, argv) + _throughput(res) + _transport(res)
    lines += bench_transport.cold_lines(res.cold, res.cold_torch, res.cold_torch_inline)
    lines += bench_state.report_lines(res.state)
    lines += bench_stages.report_lines(res.stages)
    lines += bench_sources.report_lines(res.sources)
    lines += bench_transport.report_lines(res.startup)
    lines += bench_seed.report_lines(res.seed)
    lines += bench_modes.report_lines(res.modes)
    targets = _targets(res)
    if targets:
        lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {v} | {'yes' if ok else '**no**'} |" for t, v, ok in targets]
    lines += ["", f"Total bench time: {res.elapsed_s:.0f} s."]
    return "\n".join(lines)


#: The tensor targets: items/s (70 % of a minimal shared-memory loader on the
#: development machine) and the ratio to DataLoader.
TENSOR_RATE = 25_000
TENSOR_VS_DL = 15.0


def _targets(res: Results) -> list[tuple[str, str, bool]]:
    out = []
    cell = res.cells.get(("tiny", 2))
    if cell:
        r = cell["centralpipe"].rate / cell["DataLoader"].rate
        out.append(("tiny, 2 workers: >= 100x DataLoader", f"{r:.0f}x", r >= 100))
    cell = res.cells.get(("cpu", 2))
    if cell:
        c = cell["centralpipe"].rate
        r = c / res.serial["cpu"].rate
        peers = max(cell["DataLoader"].rate, cell["ParallelMapper"].rate)
        out.append(("cpu, 2 workers: >= 1.5x serial", f"{r:.2f}x", r >= 1.5))
        out.append(
            (
                "cpu, 2 workers: ahead of DataLoader and ParallelMapper",
                f"{c / peers:.2f}x the best peer",
                c > peers,
            )
        )
    out += bench_transport.cold_targets(res.cold)
    out += bench_transport.cold_targets(res.cold_torch)
    cell = res.cells.get(("tensor", 2))
    if cell:
        dl = cell["DataLoader"].rate
        for label, name in (("", "centralpipe"), (", socket buffers capped", CAPPED)):
            rate = cell[name].rate
            out.append(
                (
                    f"tensor, 2 workers{label}: >= {TENSOR_RATE:,} items/s",
                    f"{rate:,.0f}",
                    rate >= TENSOR_RATE,
                )
            )
            out.append(
                (
                    f"tensor, 2 workers{label}: >= {TENSOR_VS_DL:g}x DataLoader",
                    f"{rate / dl:.2f}x",
                    rate / dl >= TENSOR_VS_DL,
                )
            )
            if LIMIT in cell:
                r = rate / cell[LIMIT].rate
                out.append(
                    (
                        f"tensor, 2 workers{label}: >= 70 % of the slot-pool limit, same run",
                        f"{r:.0%}",
                        r >= 0.7,
                    )
                )
    arrays = res.cells.get(("numpy", 2))
    if cell and arrays:
        r = arrays["centralpipe"].rate / cell["centralpipe"].rate
        out.append(("numpy, 2 workers: within 10 % of tensor", f"{r:.2f}x tensor", r >= 0.9))
    out += bench_state.targets(res.state)
    out += bench_stages.targets(res.stages)
    out += bench_sources.targets(res.sources)
    out += bench_transport.targets(res.startup)
    out += bench_seed.targets(res.seed)
    out += bench_modes.targets(res.modes)
    return out

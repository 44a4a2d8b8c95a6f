"""``bench --only modes``: a training loop fed by each central mode.

Each step of the simulated loop runs ``P`` ms of pure-Python work (the
step's own Python: the model's forward in eager mode, logging, the
optimizer's bookkeeping) and then sleeps ``G`` ms (the device's time, during
which a real loop waits with the GIL released). The loader feeds it the
``seed`` pipeline's batches (pure-Python tokenizer ``parallel=True`` →
``bucket_by_max_tokens`` → ``count`` → ``shard`` → ``dispatch`` → pad). A loop
that the loader does not slow takes ``steps * (P + G)``; the *loss* is how
much longer it took, in percent, and the step's Python time at the 90th
percentile against its time alone shows the GIL the loop shares.

Contenders, each for the same number of steps after one warm-up step:
precomputed batches (a list: the floor), torch's ``DataLoader`` (2 workers,
each tokenizing and bucketing every second line), and centralpipe with
``central="process"`` and ``central="service"``. Two runs each, interleaved;
the report keeps both (``--scale`` above 1: one run, on a share of the corpus).
"""

from __future__ import annotations

import glob
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import centralpipe as cp
from centralpipe.tools.bench_seed import (
    BUFFER,
    CORPUS_GLOB,
    MAX_TOKENS,
    PEER_START_METHOD,
    WORKERS,
    TokenBuckets,
    pad,
    train_py_tokenizer,
)
from centralpipe.tools.bench_spin import Spin, calibrate_spin

__all__ = ["GPU_MS", "PY_MS", "ModesResult", "measure", "report_lines", "targets"]

#: Python time and device time of one simulated step, ms.
PY_MS = 4.0
GPU_MS = 20.0
#: Steps timed per run (one more is the warm-up), and runs per contender.
STEPS = 150
RUNS = 2


@dataclass
class LoopRun:
    steps: int
    wall_s: float
    py_p90_s: float

    def loss(self, ideal_s: float) -> float:
        return self.wall_s / ideal_s - 1.0


@dataclass
class ModesResult:
    steps: int = 0
    py_alone_s: float = 0.0
    runs: dict[str, list[LoopRun]] = field(default_factory=dict)

    @property
    def ideal_s(self) -> float:
        return self.steps * (PY_MS + GPU_MS) / 1e3


def _loop(batches: Iterator[Any], spin: Spin, steps: int) -> LoopRun:
    """Run the simulated step over ``steps`` batches after one warm-up batch."""
    next(batches)
    py: list[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        next(batches)
        s0 = time.perf_counter()
        spin(0)
        py.append(time.perf_counter() - s0)
        time.sleep(GPU_MS / 1e3)
    wall = time.perf_counter() - t0
    return LoopRun(steps, wall, statistics.quantiles(py, n=10)[-1])


def _pipe(lines: list[str], tok: Callable[[str], list[int]]) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(lines)
        .map(tok, parallel=True)
        .bucket_by_max_tokens(MAX_TOKENS, buffer_size=BUFFER, min_len=1)
        .count("pre_shard", weight_fn=len)
        .shard()
        .dispatch()
        .map(pad)
    )


def _centralpipe(central: str) -> Callable[[list[str], Any, Spin, int], LoopRun]:
    def run(lines: list[str], tok: Any, spin: Spin, steps: int) -> LoopRun:
        config = cp.LoaderConfig(
            workers=cp.WorkerConfig(num_workers=WORKERS, start_method="fork"), central=central
        )
        with cp.Loader[torch.Tensor](_pipe(lines, tok), config) as loader:
            return _loop(iter(loader), spin, steps)

    return run


def _dataloader(lines: list[str], tok: Any, spin: Spin, steps: int) -> LoopRun:
    loader = DataLoader(
        TokenBuckets(lines, tok),
        batch_size=None,
        num_workers=WORKERS,
        multiprocessing_context=PEER_START_METHOD,
    )
    it = iter(loader)
    try:
        return _loop(it, spin, steps)
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


def _precomputed(lines: list[str], tok: Any, spin: Spin, steps: int) -> LoopRun:
    batches = list(TokenBuckets(lines, tok))
    return _loop(iter(batches), spin, steps)


CONTENDERS: tuple[tuple[str, Callable[[list[str], Any, Spin, int], LoopRun]], ...] = (
    ("precomputed batches", _precomputed),
    (f"DataLoader, {WORKERS} workers", _dataloader),
    (f'centralpipe central="process", {WORKERS} workers', _centralpipe("process")),
    (f'centralpipe central="service", {WORKERS} workers', _centralpipe("service")),
)


def measure(scale: int, log: Callable[[str], None]) -> ModesResult:
    corpus = [
        line
        for path in sorted(glob.glob(CORPUS_GLOB))
        for line in Path(path).read_text(encoding="utf-8").split("\n")
    ]
    if not corpus:
        raise RuntimeError(f"modes: no corpus at {CORPUS_GLOB} (it ships with the source tree).")
    if scale > 1:  # a smoke run: a share of the corpus, one run per contender
        corpus = corpus[: max(1000, len(corpus) // scale)]
    tok = train_py_tokenizer(corpus)
    spin = calibrate_spin(PY_MS / 1e3)
    steps = max(10, STEPS // scale)
    per_corpus = sum(1 for _ in TokenBuckets(corpus, tok))
    lines = corpus * (-(-(steps + 2) // per_corpus))  # enough batches for the steps
    res = ModesResult(steps=steps)
    alone = []
    for _ in range(50):
        t0 = time.perf_counter()
        spin(0)
        alone.append(time.perf_counter() - t0)
    res.py_alone_s = statistics.quantiles(alone, n=10)[-1]
    for attempt in range(RUNS if scale == 1 else 1):
        for name, fn in CONTENDERS:
            log(f"modes: {name}, run {attempt + 1}")
            res.runs.setdefault(name, []).append(fn(lines, tok, spin, steps))
    return res


def report_lines(res: ModesResult | None) -> list[str]:
    if res is None:
        return []
    out = [
        "",
        f"## modes: a training loop ({PY_MS:g} ms of Python, then {GPU_MS:g} ms of sleep a step)",
        "",
        f"{res.steps} steps after one warm-up; ideal {res.ideal_s:.2f} s. loss: wall over "
        "ideal, in percent; step Python p90: the step's own Python at the 90th percentile, "
        f"against {res.py_alone_s * 1e3:.2f} ms alone. One line per run.",
        "",
        "| contender | wall s | loss | step Python p90 ms | / alone |",
        "|---|--:|--:|--:|--:|",
    ]
    for name, runs in res.runs.items():
        for r in runs:
            out.append(
                f"| {name} | {r.wall_s:.2f} | {r.loss(res.ideal_s):.1%} | "
                f"{r.py_p90_s * 1e3:.2f} | {r.py_p90_s / res.py_alone_s:.2f}x |"
            )
    return out


def targets(res: ModesResult | None) -> list[tuple[str, str, bool]]:
    if res is None:
        return []
    best = {n: min(r.loss(res.ideal_s) for r in runs) for n, runs in res.runs.items()}
    service = best[CONTENDERS[3][0]]
    peer = best[CONTENDERS[1][0]]
    return [
        (
            'modes: central="service" loses within 1 point of the DataLoader',
            f"{service:.1%} against {peer:.1%}",
            service <= peer + 0.01,
        )
    ]

"""``python -m centralpipe bench``: throughput and checkpoint latency, measured.

One process runs every contender on the same workloads, one after another, and
prints a markdown report:

- **throughput** of centralpipe, torch's ``DataLoader`` (an ``IterableDataset``
  sharded by ``get_worker_info()``, ``batch_size=None``) and
  ``torchdata.nodes.ParallelMapper(method="process")`` with 1, 2, 4 workers,
  against a plain loop in the main process (``serial``). Items/s cover a whole
  epoch, from creating the loader to its last item, worker start-up included;
  the time to the first item is reported beside it.
- **state_dict()** latency mid-epoch with 4 workers, its cost to throughput,
  and its latency early, midway and late in a long ``num_workers=0`` epoch.

Workload functions live at module level so forkserver and spawn workers can
unpickle them. Sizes suit a 2-core machine; ``--quick`` divides them by ten.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
import torchdata
import torchdata.nodes as tn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import centralpipe as cp
from centralpipe import bench_seed, bench_stages, bench_transport
from centralpipe.config import START_METHODS

__all__ = ["add_arguments", "main", "run"]

WORKLOADS = ("tiny", "cpu", "tensor", "numpy")
SECTIONS = (*WORKLOADS, "state", "stages", "startup", "seed")
#: Start method of the DataLoader and ParallelMapper workers.
PEER_START_METHOD = "fork"
#: Items per tensor: 65536 float32 = 256 KiB.
TENSOR_NUMEL = 65536
CPU_ITEM_S = 0.001
STATE_WORKERS = 4
STATE_CALLS = 200
LONG_EPOCH_POINTS = (0.01, 0.5, 0.99)
LONG_EPOCH_SAMPLES = 50
THROUGHPUT_REPEATS = 2
#: A throughput cell is measured again when other processes used more than
#: this share of the machine meanwhile.
NOISY_SHARE = 0.10


# -- workload functions (module level: picklable) -----------------------------------


def inc(x: int) -> int:
    return x + 1


def full_tensor(i: int) -> torch.Tensor:
    return torch.full((TENSOR_NUMEL,), float(i))


def full_array(i: int) -> Any:
    import numpy as np

    return np.full(TENSOR_NUMEL, float(i), dtype=np.float32)


def _spin(iterations: int) -> int:
    x = 0
    for i in range(iterations):
        x = (x * 31 + i) & 0xFFFF
    return x


class Spin:
    """About ``CPU_ITEM_S`` of pure-Python integer arithmetic per item; the
    iteration count is calibrated once and travels with the object."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations

    def __call__(self, item: int) -> int:
        return item + _spin(self.iterations)


def calibrate_spin(target_s: float = CPU_ITEM_S) -> Spin:
    """A :class:`Spin` taking ``target_s`` per call here (best of 5)."""
    n = 1000
    while True:
        best = min(_time_call(_spin, n) for _ in range(3))
        if best > 2e-4:
            break
        n *= 2
    n = max(1, int(n * target_s / best))
    best = min(_time_call(_spin, n) for _ in range(5))
    return Spin(max(1, int(n * target_s / best)))


def _time_call(fn: Callable[[int], Any], arg: int) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def token_len(x: int) -> int:
    return 1 + x % 64


# -- timing -------------------------------------------------------------------------


@dataclass
class Timing:
    """One epoch: items delivered, time to the first and to the last item."""

    items: int
    first_s: float
    total_s: float

    @property
    def rate(self) -> float:
        return self.items / self.total_s if self.total_s > 0 else float("inf")


def _consume(it: Iterator[Any], t0: float) -> Timing:
    try:
        next(it)
    except StopIteration:
        now = time.perf_counter() - t0
        return Timing(0, now, now)
    first = time.perf_counter() - t0
    n = 1
    for _ in it:
        n += 1
    return Timing(n, first, time.perf_counter() - t0)


def _check(name: str, timing: Timing, expected: int) -> Timing:
    if timing.items != expected:
        raise RuntimeError(f"{name} delivered {timing.items} items, expected {expected}.")
    return timing


@dataclass(frozen=True)
class Workload:
    name: str
    n: int
    fn: Callable[[int], Any]
    what: str


def run_serial(w: Workload) -> Timing:
    fn = w.fn
    t0 = time.perf_counter()
    return _consume((fn(i) for i in range(w.n)), t0)


def run_centralpipe(w: Workload, workers: int, start_method: str | None) -> Timing:
    pipe = cp.Pipeline.from_iterable(range(w.n)).dispatch().map(w.fn)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method=start_method)
    )
    t0 = time.perf_counter()
    with cp.Loader[Any](pipe, config) as loader:
        return _consume(iter(loader), t0)


class ShardedRange(IterableDataset[Any]):
    """``fn(i)`` for ``i < n``, each DataLoader worker taking every k-th ``i``."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n = n
        self.fn = fn

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        fn = self.fn
        return (fn(i) for i in range(start, self.n, step))


def run_dataloader(w: Workload, workers: int) -> Timing:
    t0 = time.perf_counter()
    loader = DataLoader(
        ShardedRange(w.n, w.fn),
        batch_size=None,
        num_workers=workers,
        persistent_workers=False,
        multiprocessing_context=PEER_START_METHOD if workers else None,
    )
    it = iter(loader)
    try:
        return _consume(it, t0)
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        del it


def run_parallel_mapper(w: Workload, workers: int) -> Timing:
    node = tn.ParallelMapper(
        tn.IterableWrapper(range(w.n)),
        w.fn,
        num_workers=workers,
        method="process",
        multiprocessing_context=PEER_START_METHOD,
    )
    t0 = time.perf_counter()
    try:
        return _consume(iter(tn.Loader(node)), t0)
    finally:
        _shutdown_nodes(node)


def _shutdown_nodes(node: Any) -> None:
    """Stop a torchdata.nodes graph's threads and processes now.

    torchdata.nodes has no public ``close()``: its mapper iterators stop in
    ``_shutdown()`` (also called from ``__del__``). Doing it here, before the
    next contender forks, keeps their threads out of the next measurement."""
    stack, seen = [node], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        shutdown = getattr(obj, "_shutdown", None)
        if callable(shutdown):
            shutdown()
        stack.append(getattr(obj, "_it", None))
        stack.append(getattr(obj, "source", None))


def _settle() -> None:
    """Between contenders: collect garbage (and what it holds) before forking."""
    gc.collect()
    time.sleep(0.05)


# -- what else ran ---------------------------------------------------------------------


class CpuMeter:
    """CPU time used by processes outside this process tree (``psutil``).

    Busy time of all CPUs minus this tree's own (user + system time of this
    process and its live descendants, plus that of the children they reaped,
    which covers workers a forkserver started and reaped). Read it between
    measurements, when every worker of the last one has exited. Without
    ``psutil`` (``pip install 'centralpipe[bench]'``) it reads nothing.
    """

    def __init__(self) -> None:
        self.ncpu = os.cpu_count() or 1

    def read(self) -> tuple[float, float, float] | None:
        try:
            import psutil
        except ImportError:
            return None
        t = psutil.cpu_times()
        busy = (
            t.user
            + t.system
            + sum(getattr(t, name, 0.0) for name in ("nice", "irq", "softirq", "steal"))
        )
        return time.perf_counter(), busy, self._tree()

    def _tree(self) -> float:
        import psutil

        me = psutil.Process()
        total = 0.0
        for proc in (me, *me.children(recursive=True)):
            try:
                c = proc.cpu_times()
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
            total += c.user + c.system + c.children_user + c.children_system
        return total

    def others(self, start: tuple[float, float, float] | None) -> float | None:
        """Share of the machine (0..1) others used since ``start``."""
        end = self.read()
        if start is None or end is None or end[0] <= start[0]:
            return None
        seconds = (end[1] - start[1]) - (end[2] - start[2])
        return max(0.0, seconds / ((end[0] - start[0]) * self.ncpu))


# -- state_dict() -----------------------------------------------------------------------


@dataclass
class StateRun:
    timing: Timing
    latencies_s: list[float] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)


def _state_run(pipe: cp.Pipeline, workers: int, every: int, start_method: str | None) -> StateRun:
    """Iterate one epoch, calling ``state_dict()`` after every ``every``-th item."""
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method=start_method)
    )
    lat: list[float] = []
    flight: list[int] = []
    clock = time.perf_counter
    t0 = clock()
    with cp.Loader[Any](pipe, config) as loader:
        it = iter(loader)
        n = 0
        first = 0.0
        for _ in it:
            n += 1
            if n == 1:
                first = clock() - t0
            if n % every == 0:
                s = clock()
                sd = loader.state_dict()
                lat.append(clock() - s)
                flight.append(sum(len(f["items"]) for f in sd["in_flight"].values()))
        total = clock() - t0
    return StateRun(Timing(n, first, total), lat, flight)


def tiny_pipe(n: int) -> cp.Pipeline:
    return cp.Pipeline.from_iterable(range(n)).dispatch().map(inc)


def bucket_pipe(n: int) -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(n))
        .shuffle(1000)
        .bucket_by_max_tokens(256, len_fn=token_len, buffer_size=1000)
        .dispatch()
        .map(len)
    )


def long_epoch_latency(n: int) -> dict[float, list[float]]:
    """``state_dict()`` latencies around fractions of an ``n``-item epoch
    (``num_workers=0``): ``LONG_EPOCH_SAMPLES`` consecutive calls per point."""
    pipe = cp.Pipeline.from_iterable(range(n)).map(inc)
    out: dict[float, list[float]] = {}
    clock = time.perf_counter
    with cp.Loader[Any](pipe) as loader:
        it = iter(loader)
        pos = 0
        for frac in LONG_EPOCH_POINTS:
            start = max(pos, int(frac * n) - LONG_EPOCH_SAMPLES // 2)
            deque(islice(it, start - pos), maxlen=0)
            pos = start
            lat = []
            for _ in range(LONG_EPOCH_SAMPLES):
                next(it)
                pos += 1
                s = clock()
                loader.state_dict()
                lat.append(clock() - s)
            out[frac] = lat
    return out


# -- the run --------------------------------------------------------------------------


@dataclass
class Results:
    sizes: dict[str, str] = field(default_factory=dict)
    methods: dict[str, str] = field(default_factory=dict)
    forkserver_boot_s: float | None = None
    serial: dict[str, Timing] = field(default_factory=dict)
    # (workload, workers) -> contender -> Timing
    cells: dict[tuple[str, int], dict[str, Timing]] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    stages: dict[str, Any] = field(default_factory=dict)
    startup: dict[tuple[str, float], tuple[float, float]] = field(default_factory=dict)
    seed: list[bench_seed.TokenizerResult] = field(default_factory=list)
    elapsed_s: float = 0.0
    repeat: int = 1
    retries: int = 1
    # share of the machine other processes used: whole run, and per throughput cell
    others: float | None = None
    cell_others: dict[tuple[str, int], float | None] = field(default_factory=dict)
    cell_attempt: dict[tuple[str, int], int] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(
    *,
    quick: bool,
    workers: Sequence[int],
    only: Sequence[str],
    start_method: str | None,
    repeat: int = 1,
    retries: int = 1,
) -> Results:
    """Run the selected sections; progress goes to stderr.

    Each contender's figure is the best of ``repeat`` epochs. A throughput cell
    (all contenders for one workload and worker count) during which other
    processes used more than ``NOISY_SHARE`` of the machine is measured again,
    up to ``retries`` times; the report keeps the quietest attempt."""
    started = time.perf_counter()
    scale = 10 if quick else 1
    res = Results(repeat=repeat, retries=retries)
    meter = CpuMeter()
    run_start = meter.read()
    method = cp.WorkerConfig(start_method=start_method).resolved_start_method()
    res.methods = {
        "centralpipe": method,
        "DataLoader": PEER_START_METHOD,
        "ParallelMapper": PEER_START_METHOD,
    }
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    torch.set_num_threads(1)  # as in the workers; the main process only moves data
    if method == "forkserver":
        # The server starts (and imports torch) once per process; the first
        # loader pays it. Start it here so every cell measures the same thing.
        t = run_centralpipe(Workload("boot", 1, inc, ""), 1, start_method)
        res.forkserver_boot_s = t.total_s
    workloads: list[Workload] = []
    if "tiny" in only:
        workloads.append(Workload("tiny", 200_000 // scale, inc, "x + 1 on ints"))
    if "cpu" in only:
        spin = calibrate_spin()
        ms = _time_call(spin, 0) * 1e3
        workloads.append(
            Workload(
                "cpu", 4_000 // scale, spin, f"{spin.iterations} loop iterations, ~{ms:.2f} ms"
            )
        )
    if "tensor" in only:
        workloads.append(
            Workload("tensor", 2_000 // scale, full_tensor, "a fresh 256 KiB float32 tensor")
        )
    if "numpy" in only:
        workloads.append(
            Workload("numpy", 2_000 // scale, full_array, "a fresh 256 KiB float32 numpy array")
        )
    for w in workloads:
        res.sizes[w.name] = f"{w.n:,} items: {w.what}"
        _log(f"{w.name}: serial")
        res.serial[w.name] = max(
            (_check("serial", run_serial(w), w.n) for _ in range(repeat)), key=lambda t: t.rate
        )
        for k in workers:
            key = (w.name, k)
            for attempt in range(1, retries + 2):
                _settle()
                cell_start = meter.read()
                cell = _measure_cell(w, k, start_method, repeat)
                others = meter.others(cell_start)
                best = res.cell_others.get(key)
                if attempt == 1 or (others is not None and (best is None or others < best)):
                    res.cells[key], res.cell_others[key] = cell, others
                    res.cell_attempt[key] = attempt
                if others is None or others <= NOISY_SHARE or attempt > retries:
                    break
                _log(f"{w.name}, {k} worker(s): other processes used {others:.0%}; measuring again")
    if "state" in only:
        _state_section(res, scale, start_method)
    if "stages" in only:
        _log("stages: mix and pack, main-process cost per item")
        res.stages = bench_stages.measure(scale)
    if "startup" in only:
        _log("startup: first item, fresh processes")
        res.startup = bench_transport.measure_startup(START_METHODS)
    if "seed" in only:
        res.seed = bench_seed.measure(scale, _log)
    res.elapsed_s = time.perf_counter() - started
    res.others = meter.others(run_start)
    return res


def _measure_cell(w: Workload, k: int, start_method: str | None, repeat: int) -> dict[str, Timing]:
    """One epoch of each contender (best of ``repeat``), back to back."""
    cell: dict[str, Timing] = {}
    for name, fn in (
        ("centralpipe", lambda: run_centralpipe(w, k, start_method)),
        ("DataLoader", lambda: run_dataloader(w, k)),
        ("ParallelMapper", lambda: run_parallel_mapper(w, k)),
    ):
        _log(f"{w.name}: {name}, {k} worker(s)")
        runs = []
        for _ in range(repeat):
            _settle()
            runs.append(_check(name, fn(), w.n))
        cell[name] = max(runs, key=lambda t: t.rate)
    return cell


def _state_section(res: Results, scale: int, start_method: str | None) -> None:
    n = 200_000 // scale
    every = max(1, n // STATE_CALLS)
    _log(f"state: tiny, {STATE_WORKERS} workers, state_dict() every {every} items")
    quiet, calling = [], []
    for _ in range(THROUGHPUT_REPEATS):  # interleaved, best of each: the machine is noisy
        _settle()
        quiet.append(_state_run(tiny_pipe(n), STATE_WORKERS, n + 1, start_method))
        _settle()
        calling.append(_state_run(tiny_pipe(n), STATE_WORKERS, every, start_method))
    res.state["tiny_every"] = every
    res.state["tiny_quiet"] = max(quiet, key=lambda r: r.timing.rate)
    res.state["tiny_calling"] = max(calling, key=lambda r: r.timing.rate)
    res.state["tiny_latency"] = [x for r in calling for x in r.latencies_s]
    res.state["tiny_flight"] = [x for r in calling for x in r.in_flight]
    with cp.Loader[Any](bucket_pipe(n)) as loader:
        outputs = sum(1 for _ in loader)
    b_every = max(1, outputs // STATE_CALLS)
    _log(f"state: shuffle+bucket, {STATE_WORKERS} workers, every {b_every} batches")
    _settle()
    run_b = _state_run(bucket_pipe(n), STATE_WORKERS, b_every, start_method)
    res.state["bucket"] = run_b
    res.state["bucket_every"] = b_every
    long_n = 1_000_000 // scale
    _log(f"state: {long_n:,}-item epoch, num_workers=0")
    res.state["long_n"] = long_n
    res.state["long"] = long_epoch_latency(long_n)


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


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs"


def _p99(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def report(res: Results, *, argv: Sequence[str] = ()) -> str:
    """The results as markdown."""
    m = res.methods
    lines = [
        "# centralpipe bench",
        "",
        f"- command: `python -m centralpipe bench{' ' if argv else ''}{' '.join(argv)}`",
        f"- machine: {os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"torchdata {torchdata.__version__}, centralpipe {cp.__version__}",
        f"- start methods: centralpipe `{m.get('centralpipe')}`"
        + (
            f" (server start-up {res.forkserver_boot_s * 1e3:.0f} ms, once per process, before "
            "the timings)"
            if res.forkserver_boot_s is not None
            else ""
        )
        + f"; DataLoader `{m.get('DataLoader')}`; ParallelMapper `{m.get('ParallelMapper')}`;"
        " serial: a plain loop in the main process",
        f"- other processes' CPU use during the run: {_share(res.others)} of the machine"
        " (from psutil; when it is high, they took CPU time from the contenders)",
    ]
    for name, size in res.sizes.items():
        lines.append(f"- `{name}`: {size}")
    if res.cells:
        lines += [
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
    st = res.state
    if st:
        lat, flight = st["tiny_latency"], st["tiny_flight"]
        b: StateRun = st["bucket"]
        lines += [
            "",
            "## state_dict()",
            "",
            "Latency of `loader.state_dict()` called from the consuming loop.",
            "",
            "| pipeline | workers | calls | median | p99 | in-flight items (median) |",
            "|---|--:|--:|--:|--:|--:|",
            f"| tiny, every {st['tiny_every']:,} items | {STATE_WORKERS} | {len(lat)} "
            f"| {_us(statistics.median(lat))} | {_us(_p99(lat))} "
            f"| {statistics.median(flight):,.0f} |",
            f"| shuffle(1000) + bucket_by_max_tokens(buffer_size=1000), every "
            f"{st['bucket_every']:,} batches | {STATE_WORKERS} | {len(b.latencies_s)} "
            f"| {_us(statistics.median(b.latencies_s))} | {_us(_p99(b.latencies_s))} "
            f"| {statistics.median(b.in_flight):,.0f} |",
        ]
        for frac, xs in st["long"].items():
            lines.append(
                f"| `from_iterable(range({st['long_n']:_})).map(f)`, at {frac:.0%} of the epoch "
                f"| 0 | {len(xs)} | {_us(statistics.median(xs))} | {_us(_p99(xs))} | 0 |"
            )
        q, c = st["tiny_quiet"].timing, st["tiny_calling"].timing
        lines += [
            "",
            f"Throughput of `tiny` with {STATE_WORKERS} workers (best of "
            f"{THROUGHPUT_REPEATS} runs each, interleaved):",
            "",
            "| state_dict() calls | items/s | relative |",
            "|---|--:|--:|",
            f"| none | {_rate(q.rate)} | 1.00 |",
            f"| every {st['tiny_every']:,} items | {_rate(c.rate)} | {c.rate / q.rate:.2f} |",
        ]
    lines += bench_stages.report_lines(res.stages)
    lines += bench_transport.report_lines(res.startup)
    lines += bench_seed.report_lines(res.seed)
    targets = _targets(res)
    if targets:
        lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {v} | {'yes' if ok else '**no**'} |" for t, v, ok in targets]
    lines += ["", f"Total bench time: {res.elapsed_s:.0f} s."]
    return "\n".join(lines)


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
    cell = res.cells.get(("tensor", 2))
    if cell:
        r = cell["centralpipe"].rate / cell["DataLoader"].rate
        out.append(("tensor, 2 workers: >= 5x DataLoader", f"{r:.2f}x", r >= 5))
    if res.state:
        for label, xs in (
            ("tiny", res.state["tiny_latency"]),
            ("shuffle+bucket", res.state["bucket"].latencies_s),
        ):
            med = statistics.median(xs)
            out.append(
                (
                    f"state_dict() median < 1 ms, {STATE_WORKERS} workers, {label}",
                    _us(med),
                    med < 1e-3,
                )
            )
    out += bench_stages.targets(res.stages)
    out += bench_transport.targets(res.startup)
    out += bench_seed.targets(res.seed)
    return out


# -- command line -----------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of ints, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"worker counts must be >= 1, got {text!r}")
    return values


def _sections(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [v for v in values if v not in SECTIONS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(unknown) or text!r}; choose from {','.join(SECTIONS)}"
        )
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="sizes divided by 10 (for tests)")
    parser.add_argument(
        "--workers",
        type=_int_list,
        default=[1, 2, 4],
        metavar="N,N,...",
        help="worker counts for the throughput table (default: 1,2,4)",
    )
    parser.add_argument(
        "--only",
        type=_sections,
        default=list(SECTIONS),
        metavar="SECTION,...",
        help=f"sections to run, from {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="best of N epochs per throughput cell, for every contender (default: 1)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=1,
        metavar="N",
        help=f"measure a throughput cell again, up to N times, when other processes used more "
        f"than {NOISY_SHARE:.0%}% of the machine meanwhile (default: 1)",
    )
    parser.add_argument(
        "--start-method",
        choices=START_METHODS,
        default=None,
        help="centralpipe's start method (default: the library default, forkserver)",
    )


def main(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    if args.repeat < 1 or args.retries < 0:
        print(
            f"bench: --repeat must be >= 1 and --retries >= 0, got {args.repeat} and "
            f"{args.retries}.",
            file=sys.stderr,
        )
        return 2
    res = run(
        quick=args.quick,
        workers=args.workers,
        only=args.only,
        start_method=args.start_method,
        repeat=args.repeat,
        retries=args.retries,
    )
    print(report(res, argv=argv), flush=True)
    return 0

"""``python -m centralpipe bench``: throughput, transport and checkpoint latency, measured.

One process runs every contender on the same workloads, one after another, and
prints a markdown report:

- **throughput** of centralpipe, torch's ``DataLoader`` and
  ``torchdata.nodes.ParallelMapper`` (:mod:`centralpipe.tools.bench_contenders`)
  with 1, 2, 4 workers, against a plain loop in the main process
  (``serial``), on the workloads of :mod:`centralpipe.tools.bench_workloads`.
  Items/s cover a whole epoch, from creating the loader to its last item,
  worker start-up included; the time to the first item is reported beside it.
- **transport**: for the tensor and array workloads, centralpipe again with its
  worker pipes' socket buffers capped at a stock kernel's 212,992 bytes, and
  the share of result bytes that came through shared memory.
- a **cold epoch** of ``cpu``: a fresh process's first Loader, start-up included
  (:mod:`centralpipe.tools.bench_transport`);
- **state_dict()** latency (:mod:`centralpipe.tools.bench_state`), the central
  stages' cost (:mod:`centralpipe.tools.bench_stages`), first-item latency
  (:mod:`centralpipe.tools.bench_transport`), the ``seed`` workload
  (:mod:`centralpipe.tools.bench_seed`) and a training loop fed by each
  central mode (:mod:`centralpipe.tools.bench_modes`).

The report is rendered by :mod:`centralpipe.tools.bench_report`. Sizes suit a
2-core machine; ``--quick`` divides them by ten, ``--scale N`` by N (the
tests use a large N: they check the report's shape, not its figures).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Sequence

import torch

import centralpipe as cp
from centralpipe.config import START_METHODS
from centralpipe.tools import (
    bench_limit,
    bench_modes,
    bench_seed,
    bench_sources,
    bench_stages,
    bench_state,
    bench_transport,
    bench_workloads,
)
from centralpipe.tools.bench_contenders import (
    PEER_START_METHOD,
    STOCK_SOCKET_BUFFER_BYTES,
    Timing,
    check,
    run_centralpipe,
    run_dataloader,
    run_parallel_mapper,
    run_serial,
    settle,
)
from centralpipe.tools.bench_report import CAPPED, LIMIT, NOISY_SHARE, Results, report
from centralpipe.tools.bench_workloads import Workload, calibrate_spin, full_array, full_tensor, inc

__all__ = ["add_arguments", "full_array", "full_tensor", "inc", "main", "run"]

WORKLOADS = ("tiny", "cpu", "tensor", "numpy", "tensor4m", "mixed")
#: Workloads whose items are large buffers: measured with capped socket buffers too.
TRANSPORT_WORKLOADS = ("tensor", "numpy", "tensor4m", "mixed")
#: What ``--quick`` divides every size by.
QUICK_SCALE = 10
SECTIONS = (*WORKLOADS, "state", "stages", "sources", "startup", "seed", "modes")
#: Workers of the cold ``cpu`` epoch.
COLD_WORKERS = 2
#: Workloads also run through the minimal slot-pool loader (bench_limit): item bytes.
LIMIT_WORKLOADS = {
    "tensor": bench_workloads.TENSOR_NUMEL * 4,
    "tensor4m": bench_workloads.LARGE_NUMEL * 4,
}


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


# -- the run --------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run(
    *,
    quick: bool = False,
    scale: int | None = None,
    workers: Sequence[int],
    only: Sequence[str],
    start_method: str | None,
    repeat: int = 1,
    retries: int = 1,
    socket_bytes: int | None = None,
    seed_corpus: str = "bundled",
) -> Results:
    """Run the selected sections; progress goes to stderr.

    Each contender's figure is the best of ``repeat`` epochs. A throughput cell
    (all contenders for one workload and worker count) during which other
    processes used more than ``NOISY_SHARE`` of the machine is measured again,
    up to ``retries`` times; the report keeps the quietest attempt.
    ``socket_bytes``: centralpipe's worker pipes ask for socket buffers of that
    size (default: the library's own request)."""
    started = time.perf_counter()
    if scale is None:
        scale = QUICK_SCALE if quick else 1
    res = Results(repeat=repeat, retries=retries, socket_bytes=socket_bytes)
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
    if "cpu" in only:
        spin = calibrate_spin()
        _log(f"cpu: a cold epoch, {COLD_WORKERS} workers, in a fresh process")
        res.cold = bench_transport.measure_cold_epoch(
            spin.iterations, 4_000 // scale, COLD_WORKERS, start_method
        )
        _log("cpu: the cold epoch again, the function from a module that imports torch")
        res.cold_torch = bench_transport.measure_cold_epoch(
            spin.iterations, 4_000 // scale, COLD_WORKERS, start_method, "torch module"
        )
        _log("cpu: the same, the main process running items while they start (start_inline)")
        res.cold_torch_inline = bench_transport.measure_cold_epoch(
            spin.iterations, 4_000 // scale, COLD_WORKERS, start_method, bench_transport.INLINE
        )
    if method == "forkserver":
        # The server starts once per process; the first loader pays it. Start
        # it here so every cell measures the same thing. `inc`'s module
        # imports torch, so the server preloads torch (dispatch.preload), as
        # the tensor workloads' workers need.
        t = run_centralpipe(Workload("boot", 1, inc, ""), 1, start_method)
        res.forkserver_boot_s = t.total_s
    for w in bench_workloads.workloads(only, scale):
        res.sizes[w.name] = f"{w.n:,} items: {w.what}"
        _log(f"{w.name}: serial")
        res.serial[w.name] = max(
            (check("serial", run_serial(w), w.n) for _ in range(repeat)), key=lambda t: t.rate
        )
        for k in workers:
            key = (w.name, k)
            for attempt in range(1, retries + 2):
                settle()
                cell_start = meter.read()
                cell = _measure_cell(w, k, start_method, repeat, socket_bytes)
                others = meter.others(cell_start)
                best = res.cell_others.get(key)
                if attempt == 1 or (others is not None and (best is None or others < best)):
                    res.cells[key], res.cell_others[key] = cell, others
                    res.cell_attempt[key] = attempt
                if others is None or others <= NOISY_SHARE or attempt > retries:
                    break
                _log(f"{w.name}, {k} worker(s): other processes used {others:.0%}; measuring again")
    if "state" in only:
        res.state = bench_state.measure(scale, start_method, _log)
    if "stages" in only:
        _log("stages: mix and pack, main-process cost per item")
        res.stages = bench_stages.measure(scale)
    if "sources" in only:
        res.sources = bench_sources.measure(scale, _log)
    if "startup" in only:
        _log("startup: first item, fresh processes")
        res.startup = bench_transport.measure_startup(START_METHODS)
    if "seed" in only:
        res.seed = bench_seed.measure(scale, _log, seed_corpus)
    if "modes" in only:
        res.modes = bench_modes.measure(scale, _log)
    res.elapsed_s = time.perf_counter() - started
    res.others = meter.others(run_start)
    return res


def _measure_cell(
    w: Workload, k: int, start_method: str | None, repeat: int, socket_bytes: int | None
) -> dict[str, Timing]:
    """One epoch of each contender (best of ``repeat``), back to back."""
    contenders = [
        ("centralpipe", lambda: run_centralpipe(w, k, start_method, socket_bytes)),
        ("DataLoader", lambda: run_dataloader(w, k)),
        ("ParallelMapper", lambda: run_parallel_mapper(w, k)),
    ]
    if w.name in TRANSPORT_WORKLOADS:
        capped = STOCK_SOCKET_BUFFER_BYTES
        contenders.insert(1, (CAPPED, lambda: run_centralpipe(w, k, start_method, capped)))
    if w.name in LIMIT_WORKLOADS:
        nbytes = LIMIT_WORKLOADS[w.name]

        def limit() -> Timing:
            total = bench_limit.run_slot_pool(w.fn, w.n, k, nbytes)
            return Timing(w.n, 0.0, total)

        contenders.insert(2, (LIMIT, limit))
    cell: dict[str, Timing] = {}
    for name, fn in contenders:
        _log(f"{w.name}: {name}, {k} worker(s)")
        runs = []
        for _ in range(repeat):
            settle()
            runs.append(check(name, fn(), w.n))
        cell[name] = max(runs, key=lambda t: t.rate)
    return cell


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
    parser.add_argument(
        "--quick", action="store_true", help=f"sizes divided by {QUICK_SCALE} (a short run)"
    )
    parser.add_argument(
        "--scale",
        type=int,
        default=None,
        metavar="N",
        help="sizes divided by N (overrides --quick; the tests run a large N to check the "
        "tables, not the figures)",
    )
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
        "--socket-buffer",
        type=int,
        default=None,
        metavar="BYTES",
        help="centralpipe's worker pipes ask for socket buffers of BYTES (e.g. 212992, a stock "
        "kernel's limit; default: the library's request). Large-buffer workloads are also "
        "measured capped at 212992 in any case.",
    )
    parser.add_argument(
        "--seed-corpus",
        choices=bench_seed.CORPORA,
        default="bundled",
        help="the seed section's lines: the bundled text files (default) or the .py files of "
        "this Python's standard library",
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
    if args.scale is not None and args.scale < 1:
        print(f"bench: --scale must be >= 1, got {args.scale}.", file=sys.stderr)
        return 2
    if args.socket_buffer is not None and args.socket_buffer < 4096:
        print(f"bench: --socket-buffer must be >= 4096, got {args.socket_buffer}.", file=sys.stderr)
        return 2
    res = run(
        quick=args.quick,
        scale=args.scale,
        workers=args.workers,
        only=args.only,
        start_method=args.start_method,
        repeat=args.repeat,
        retries=args.retries,
        socket_bytes=args.socket_buffer,
        seed_corpus=args.seed_corpus,
    )
    print(report(res, argv=argv), flush=True)
    return 0

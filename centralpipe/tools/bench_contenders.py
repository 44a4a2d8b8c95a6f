"""The bench's contenders and how one epoch is timed.

centralpipe, torch's ``DataLoader`` (an ``IterableDataset`` sharded by
``get_worker_info()``, ``batch_size=None``), ``torchdata.nodes``'
``ParallelMapper(method="process")`` and a plain loop in the main process
(``serial``), each given the same per-item function. An epoch's time runs
from creating the loader to its last item, worker start-up included.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torchdata.nodes as tn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import centralpipe as cp
from centralpipe.dispatch.executors import procpool
from centralpipe.tools.bench_workloads import Workload

__all__ = [
    "PEER_START_METHOD",
    "STOCK_SOCKET_BUFFER_BYTES",
    "ShardedRange",
    "Timing",
    "check",
    "consume",
    "run_centralpipe",
    "run_dataloader",
    "run_parallel_mapper",
    "run_serial",
    "settle",
    "shutdown_nodes",
    "socket_buffers",
]

#: Start method of the DataLoader and ParallelMapper workers.
PEER_START_METHOD = "fork"
#: ``net.core.wmem_max`` / ``rmem_max`` of a stock Linux kernel: what a
#: request for larger socket buffers gets there.
STOCK_SOCKET_BUFFER_BYTES = 212_992


@dataclass
class Timing:
    """One epoch: items delivered, time to the first and to the last item."""

    items: int
    first_s: float
    total_s: float
    #: centralpipe: share of the large result bytes that came through shared memory.
    shm_share: float | None = None

    @property
    def rate(self) -> float:
        return self.items / self.total_s if self.total_s > 0 else float("inf")


def consume(it: Iterator[Any], t0: float) -> Timing:
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


def check(name: str, timing: Timing, expected: int) -> Timing:
    if timing.items != expected:
        raise RuntimeError(f"{name} delivered {timing.items} items, expected {expected}.")
    return timing


@contextlib.contextmanager
def socket_buffers(nbytes: int | None) -> Iterator[None]:
    """centralpipe's worker pipes ask for ``nbytes`` socket buffers meanwhile
    (``None``: its default), as on a host whose limit is ``nbytes``."""
    if nbytes is None:
        yield
        return
    saved = procpool.SOCKET_BUFFER_BYTES
    procpool.SOCKET_BUFFER_BYTES = nbytes
    try:
        yield
    finally:
        procpool.SOCKET_BUFFER_BYTES = saved


def run_serial(w: Workload) -> Timing:
    fn = w.fn
    t0 = time.perf_counter()
    return consume((fn(i) for i in range(w.n)), t0)


def run_centralpipe(
    w: Workload, workers: int, start_method: str | None, socket_bytes: int | None = None
) -> Timing:
    pipe = cp.Pipeline.from_iterable(range(w.n)).dispatch().map(w.fn)
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method=start_method)
    )
    with socket_buffers(socket_bytes):
        t0 = time.perf_counter()
        with cp.Loader[Any](pipe, config) as loader:
            timing = consume(iter(loader), t0)
            moved = loader.metrics()["dispatch"].get("transport")
    if moved:
        total = moved["shared_memory_bytes"] + moved["pipe_bytes"]
        timing.shm_share = moved["shared_memory_bytes"] / total if total else None
    return timing


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
        return consume(it, t0)
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
        return consume(iter(tn.Loader(node)), t0)
    finally:
        shutdown_nodes(node)


def shutdown_nodes(node: Any) -> None:
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


def settle() -> None:
    """Between contenders: collect garbage (and what it holds) before forking."""
    gc.collect()
    time.sleep(0.05)

"""Latency of ``query()``, ``metrics()`` and a progress bar's read, per rank and central mode.

``python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1
--master_port=29641 -m centralpipe.tools.bench_query --central node``

Every local rank iterates the ``seed`` pipeline with its tokenizer as a plain
central ``map`` (so the central chain is busy for the whole epoch: the
chain lock is held most of the time) → ``bucket_by_max_tokens`` →
``count("pre_shard")`` → ``shard(equalize="drop_last")`` → ``dispatch`` →
pad, 2 workers, over the bundled corpus. After each batch it times one of
each: a live ``query("pre_shard")``, ``metrics()`` and
``query("pre_shard", delivered=True)`` (what :func:`centralpipe.progress`
reads), in an order rotated batch by batch (the first call after a batch
meets the busiest service), ``--samples`` of each. Rank 0 prints one markdown row per rank and
call: mean, p50, p90 and max in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

import centralpipe as cp
from centralpipe.tools.bench_modes_job import job

__all__ = ["CALLS", "main", "summary"]

#: The calls timed, in the order each batch runs them.
CALLS = ("query", "metrics", "progress")
HEADER = (
    "| `central` | rank | call | mean ms | p50 ms | p90 ms | max ms |\n"
    "|---|--:|---|--:|--:|--:|--:|"
)


def summary(samples_ms: list[float]) -> tuple[float, float, float, float]:
    """``(mean, p50, p90, max)`` of ``samples_ms`` (``ValueError`` if empty)."""
    if not samples_ms:
        raise ValueError("no samples: the epoch ended before the first batch was timed.")
    ordered = sorted(samples_ms)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return statistics.fmean(ordered), statistics.median(ordered), p90, ordered[-1]


def _timed(loader: cp.Loader[Any], samples: int, epochs: int) -> dict[str, list[float]]:
    calls: dict[str, Callable[[], Any]] = {
        "query": lambda: loader.query("pre_shard"),
        "metrics": loader.metrics,
        "progress": lambda: loader.query("pre_shard", delivered=True),
    }
    out: dict[str, list[float]] = {c: [] for c in CALLS}
    turn = 0
    for _ in range(epochs):
        for _batch in loader:  # every rank passes whole epochs (node mode: together)
            if len(out["query"]) >= samples:
                continue
            turn += 1
            for name in CALLS[turn % 3 :] + CALLS[: turn % 3]:
                t0 = time.perf_counter()
                calls[name]()
                out[name].append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--central", choices=("process", "service", "node"), default="node")
    parser.add_argument("--samples", type=int, default=300, help="of each call, per rank")
    parser.add_argument("--epochs", type=int, default=2, help="after one warm-up epoch")
    parser.add_argument("--repeat", type=int, default=2, help="copies of the corpus")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    pipe, config, _ = job(args.repeat, False, args.workers, args.central)
    with cp.Loader[Any](pipe, config) as loader:
        sum(1 for _ in loader)  # warm-up: the workers (and the service) are up
        dist.barrier()
        mine = _timed(loader, args.samples, args.epochs)
    out: list[dict[str, list[float]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(out, mine)
    if dist.get_rank() == 0:
        print(HEADER)
        for rank, timed in enumerate(out):
            for name in CALLS:
                if not timed[name]:
                    continue
                mean, p50, p90, top = summary(timed[name])
                print(
                    f"| {args.central} | {rank} | {name} | {mean:.3f} | {p50:.3f} "
                    f"| {p90:.3f} | {top:.2f} |",
                    flush=True,
                )
        print(f"({len(out[0]['query'])} samples of each call per rank)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

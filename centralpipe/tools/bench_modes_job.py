"""CPU time of a whole job per epoch, by central mode: one rank of it, under torchrun.

``python -m torch.distributed.run --nproc_per_node=N --master_addr=127.0.0.1
--master_port=P -m centralpipe.tools.bench_modes_job --central MODE [--tokenize central]``

Every rank runs the ``seed`` pipeline (pure-Python tokenizer ``parallel=True``
→ ``bucket_by_max_tokens`` → ``count`` → ``shard(equalize="drop_last")`` →
``dispatch`` → pad, 2 workers) over the bundled corpus repeated ``--repeat``
times; ``--tokenize central`` runs the tokenizer as a plain central ``map``
instead. In ``central="node"`` the ``--workers`` are the node's: the shared
tokenizer has them all, and each local rank's dispatch stream its share.
One warm-up epoch, then ``--epochs`` timed epochs. Each rank reads the CPU
time (user + system) of its own process tree (itself, its workers, its
service, and what they reaped) from ``/proc`` (``psutil``) around the timed
epochs, then times ``query()`` mid-epoch (a live and a delivered one, 200
each); rank 0 prints one markdown row: the job's CPU seconds per epoch (the
ranks' sum), the lines per second of each rank, the wall time and the
slowest rank's mean ``query()`` round trip.

``python -m centralpipe.tools.bench_modes_job --all`` runs the comparison the
docs report, one torchrun launch per row, interleaved: 1-rank ``process``,
2-rank ``process`` and 2-rank ``node``, three rounds, then the ratios of
each round (:mod:`centralpipe.tools.bench_modes_jobs`).
"""

from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import centralpipe as cp
from centralpipe.tools.bench import CpuMeter
from centralpipe.tools.bench_seed import BUFFER, CORPUS_GLOB, MAX_TOKENS, pad, train_py_tokenizer

__all__ = ["job", "main"]


def _tree_cpu_s(meter: CpuMeter) -> float:
    reading = meter.read()
    if reading is None:
        raise RuntimeError("bench_modes_job needs psutil: pip install 'centralpipe[bench]'.")
    return reading[2]


def _query_ms(loader: cp.Loader[Any], n: int = 200) -> float:
    """Mean ms of ``query("pre_shard")``, live and delivered, mid-epoch. Each
    rank reads up to 5 batches first: the ranks of a node pass their epochs
    together, and a rank that ran to the end would wait for the others."""
    it = iter(loader)
    for _ in range(5):
        next(it)
    t0 = time.perf_counter()
    for _ in range(n):
        loader.query("pre_shard")
        loader.query("pre_shard", delivered=True)
    mean = (time.perf_counter() - t0) / (2 * n) * 1e3
    dist.barrier()  # every rank timed its queries before any leaves the epoch
    return mean


def job(
    repeat: int, parallel: bool, workers: int, central: str
) -> tuple[cp.Pipeline, cp.LoaderConfig, int]:
    """One rank's seed pipeline over the bundled corpus ``repeat`` times (the
    tokenizer ``parallel`` or a central map), its config and its number of
    lines, after joining the gloo process group: what every torchrun bench
    of the modes runs."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    corpus = [
        line
        for path in sorted(glob.glob(CORPUS_GLOB))
        for line in Path(path).read_text(encoding="utf-8").split("\n")
    ]
    tok = train_py_tokenizer(corpus)
    pipe = (
        cp.Pipeline.from_iterable(corpus * repeat)
        .map(tok, parallel=parallel)
        .bucket_by_max_tokens(MAX_TOKENS, buffer_size=BUFFER, min_len=1)
        .count("pre_shard", weight_fn=len)
        .shard(equalize="drop_last")
        .dispatch()
        .map(pad)
    )
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=workers, start_method="fork"),
        distributed=cp.DistributedConfig.from_env(),
        central=central,
    )
    return pipe, config, len(corpus) * repeat


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--central", choices=("process", "service", "node"), default="process")
    parser.add_argument("--tokenize", choices=("parallel", "central"), default="parallel")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="copies of the corpus")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--all", action="store_true", help="run the docs' comparison")
    parser.add_argument("--rounds", type=int, default=3, help="with --all: rounds of rows")
    args = parser.parse_args(argv)
    if args.all:
        from centralpipe.tools.bench_modes_jobs import run_all

        run_all(args.rounds, args.epochs, args.repeat, args.workers)
        return
    pipe, config, lines = job(args.repeat, args.tokenize == "parallel", args.workers, args.central)
    meter = CpuMeter()
    with cp.Loader[Any](pipe, config) as loader:
        sum(1 for _ in loader)  # warm-up: the workers (and the service) are up
        dist.barrier()
        cpu0, t0 = _tree_cpu_s(meter), time.perf_counter()
        for _ in range(args.epochs):
            sum(1 for _ in loader)
        wall, cpu = time.perf_counter() - t0, _tree_cpu_s(meter) - cpu0
        query_ms = _query_ms(loader)
    rate = lines * args.epochs / wall  # central lines passed per second, this rank
    out: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(out, [cpu, rate, wall, query_ms])
    if dist.get_rank() == 0:
        job_cpu = sum(r[0] for r in out) / args.epochs
        rates = ", ".join(f"{r[1]:,.0f}" for r in out)
        walls = max(r[2] for r in out) / args.epochs
        query = max(r[3] for r in out)
        print(
            f"| {args.central} | {args.tokenize} | {dist.get_world_size()} | {job_cpu:.2f} "
            f"| {rates} | {walls:.2f} | {query:.3f} |",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

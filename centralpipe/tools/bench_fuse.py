"""``python -m centralpipe.tools.bench_fuse``: two parallel maps, fused or not.

``read_lines`` of a synthetic file → ``map(split, parallel=True)`` →
``map(word_lengths, parallel=True)`` (an int32 array per line) on 2 worker
processes, three ways: unfused (``WorkerConfig(fuse_parallel=False)``: two
streams, the words cross back and out again), fused (the default: one
segment, the workers read the ranges and run both maps), and one stage of
the combined function. Rounds are interleaved (unfused, fused, combined,
unfused, ...) so a change in the machine's load hits all three alike. The
figure is the main process's CPU time (``time.process_time()``, every
thread of it; the workers are other processes) per line over one epoch,
start and close of the Loader included.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence

import numpy as np

import centralpipe as cp

__all__ = ["main", "measure"]

WORKERS = 2
VARIANTS = ("unfused", "fused", "combined")


def split(line: str) -> list[str]:
    return line.split()


def word_lengths(words: list[str]) -> np.ndarray:
    return np.fromiter(map(len, words), dtype=np.int32, count=len(words))


def split_lengths(line: str) -> np.ndarray:
    return word_lengths(split(line))


def _write_lines(path: str, n: int) -> None:
    words = ["alpha", "be", "gamma", "delta", "epsilon", "z", "kappa", "lambda"]
    with open(path, "w", encoding="utf-8") as out:
        for i in range(n):
            out.write(" ".join(words[(i + k) % len(words)] for k in range(4 + i % 9)))
            out.write("\n")


def _pipeline(path: str, variant: str) -> cp.Pipeline:
    lines = cp.Pipeline.from_files([path]).read_lines()
    if variant == "combined":
        return lines.map(split_lengths, parallel=True)
    return lines.map(split, parallel=True).map(word_lengths, parallel=True)


def measure(path: str, variant: str, n: int) -> float:
    """Main-process CPU µs per line of one epoch of ``variant``."""
    config = cp.LoaderConfig(
        workers=cp.WorkerConfig(num_workers=WORKERS, fuse_parallel=variant != "unfused")
    )
    start = time.process_time()
    loader: cp.Loader[np.ndarray] = cp.Loader(_pipeline(path, variant), config)
    with loader:
        count = sum(1 for _ in loader)
    used = time.process_time() - start
    if count != n:
        msg = f"{variant}: expected {n} lines, got {count}."
        raise RuntimeError(msg)
    return used / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=200_000, help="lines in the file")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    args = parser.parse_args(argv)
    if args.lines < 1 or args.rounds < 1:
        parser.error(f"--lines and --rounds must be >= 1, got {args.lines}, {args.rounds}.")
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lines.txt")
        _write_lines(path, args.lines)
        for _ in range(args.rounds):
            for variant in VARIANTS:
                results[variant].append(measure(path, variant, args.lines))
    print(f"{args.lines} lines, {WORKERS} workers, main-process CPU µs per line")
    print("| variant | " + " | ".join(f"round {i + 1}" for i in range(args.rounds)) + " | min |")
    print("|---|" + "---|" * (args.rounds + 1))
    for variant in VARIANTS:
        cells = " | ".join(f"{x:.2f}" for x in results[variant])
        print(f"| {variant} | {cells} | {min(results[variant]):.2f} |")
    base = min(results["unfused"])
    print(f"fused / unfused (min): {min(results['fused']) / base:.2f}")
    print(f"combined / unfused (min): {min(results['combined']) / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The ``cpu`` workload's function: pure-Python integer arithmetic.

It lives apart from :mod:`centralpipe.tools.bench_workloads`, in a module that does
not import torch, as a pure-Python user function would: workers that run it
need no torch, and the forkserver does not preload it
(:mod:`centralpipe.dispatch.executors.preload`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["CPU_ITEM_S", "Spin", "calibrate_spin", "time_call"]

CPU_ITEM_S = 0.001


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
        best = min(time_call(_spin, n) for _ in range(3))
        if best > 2e-4:
            break
        n *= 2
    n = max(1, int(n * target_s / best))
    best = min(time_call(_spin, n) for _ in range(5))
    return Spin(max(1, int(n * target_s / best)))


def time_call(fn: Callable[[int], Any], arg: int) -> float:
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0

"""The bench's workloads: per-item functions and their sizes.

Every function lives at module level so that forkserver and spawn workers can
unpickle it; each makes its item from the index alone, so every contender
produces the same items. Sizes suit a 2-core machine; ``--quick`` divides
them by ten.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "TENSOR_NUMEL",
    "Spin",
    "Workload",
    "calibrate_spin",
    "full_array",
    "full_tensor",
    "inc",
    "large_tensor",
    "mixed_tensor",
    "token_len",
    "workloads",
]

#: Items per tensor: 65536 float32 = 256 KiB.
TENSOR_NUMEL = 65536
#: Items per large tensor: 1048576 float32 = 4 MiB.
LARGE_NUMEL = 1048576
#: Element counts of the mixed workload, float32: 1 KiB to 4 MiB.
MIXED_NUMELS = (256, 2048, 16384, 65536, 262144, 1048576)
CPU_ITEM_S = 0.001


@dataclass(frozen=True)
class Workload:
    name: str
    n: int
    fn: Callable[[int], Any]
    what: str


def inc(x: int) -> int:
    return x + 1


def full_tensor(i: int) -> torch.Tensor:
    return torch.full((TENSOR_NUMEL,), float(i))


def full_array(i: int) -> Any:
    import numpy as np

    return np.full(TENSOR_NUMEL, float(i), dtype=np.float32)


def large_tensor(i: int) -> torch.Tensor:
    return torch.full((LARGE_NUMEL,), float(i))


def mixed_tensor(i: int) -> torch.Tensor:
    """1 KiB, 8 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB in turn (about 0.9 MiB on average)."""
    return torch.full((MIXED_NUMELS[i % len(MIXED_NUMELS)],), float(i))


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


def workloads(only: Sequence[str], scale: int) -> list[Workload]:
    """The throughput workloads among ``only``, sizes divided by ``scale``."""
    out: list[Workload] = []
    if "tiny" in only:
        out.append(Workload("tiny", 200_000 // scale, inc, "x + 1 on ints"))
    if "cpu" in only:
        spin = calibrate_spin()
        ms = _time_call(spin, 0) * 1e3
        what = f"{spin.iterations} loop iterations, ~{ms:.2f} ms"
        out.append(Workload("cpu", 4_000 // scale, spin, what))
    if "tensor" in only:
        what = "a fresh 256 KiB float32 tensor"
        out.append(Workload("tensor", 20_000 // scale, full_tensor, what))
    if "numpy" in only:
        what = "a fresh 256 KiB float32 numpy array"
        out.append(Workload("numpy", 20_000 // scale, full_array, what))
    if "tensor4m" in only:
        what = "a fresh 4 MiB float32 tensor"
        out.append(Workload("tensor4m", 2_000 // scale, large_tensor, what))
    if "mixed" in only:
        what = "fresh float32 tensors of 1 KiB, 8 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB in turn"
        out.append(Workload("mixed", 4_000 // scale, mixed_tensor, what))
    return out

"""The bench's workloads: per-item functions and their sizes.

Every function lives at module level so that forkserver and spawn workers can
unpickle it; each makes its item from the index alone, so every contender
produces the same items. Sizes suit a 2-core machine; ``--quick`` divides
them by ten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Re-exported: the cpu workload's function lives in a torch-free module, as a
# pure-Python user function would (dispatch.preload reads what workers import).
from centralpipe.tools.bench_spin import CPU_ITEM_S, Spin, calibrate_spin, time_call

__all__ = [
    "CPU_ITEM_S",
    "TENSOR_NUMEL",
    "Spin",
    "SpinBesideTorch",
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


class SpinBesideTorch(Spin):
    """:class:`Spin` from a module that imports torch: its workers need torch,
    so the forkserver preloads it (the bench's cold epoch shows both)."""


def token_len(x: int) -> int:
    return 1 + x % 64


def workloads(only: Sequence[str], scale: int) -> list[Workload]:
    """The throughput workloads among ``only``, sizes divided by ``scale``."""
    out: list[Workload] = []
    if "tiny" in only:
        out.append(Workload("tiny", 200_000 // scale, inc, "x + 1 on ints"))
    if "cpu" in only:
        spin = calibrate_spin()
        ms = time_call(spin, 0) * 1e3
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

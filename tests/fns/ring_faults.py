"""Worker-stage functions for the shared-memory ring tests.

In their own module so that every start method can import them. A marker
file makes each fault happen once: the first worker to reach the item
creates it and misbehaves; a replacement worker finds it and behaves.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import torch

from tests.fns.faulty import _first_time

#: Written over the first half of a ring buffer by a worker that dies mid-write.
TORN_BYTE = 0xAB


def tensor_of(x: int, numel: int = 65536) -> torch.Tensor:
    """A fresh float32 tensor of ``numel`` elements, all ``x`` (256 KiB by default)."""
    return torch.full((numel,), float(x))


def _tear_next_write(marker: str) -> None:
    """In this worker: the next ring write (of a result as it is made, or of
    a message) stops halfway through its bytes (the first half garbage, the
    rest as it was), then SIGKILL."""
    from centralpipe.dispatch.wire import ringreader, ringwriter

    def tear(self: Any, n: int) -> None:
        start = self._alloc(ringreader.aligned(n))
        if start >= 0:
            half = n // 2
            self._view[start : start + half] = bytes([TORN_BYTE]) * half
        with open(marker + ".torn", "w") as f:
            f.write(str(start))
        os.kill(os.getpid(), signal.SIGKILL)

    def reserve(self: Any, size: int) -> int:
        tear(self, size)
        return -1  # pragma: no cover - killed above

    def place(self: Any, buf: memoryview) -> int:
        tear(self, buf.nbytes)
        return -1  # pragma: no cover - killed above

    ringwriter.RingWriter.reserve = reserve  # type: ignore[method-assign]
    ringwriter.RingWriter.place = place  # type: ignore[method-assign]


def tear_once(x: int, *, at: int, marker: str) -> torch.Tensor:
    """A 256 KiB tensor; the first worker to reach item ``at`` dies while
    writing that chunk's result into its ring."""
    if x == at and _first_time(marker):
        _tear_next_write(marker)
    return tensor_of(x)


def kill_each_and_tensor(x: int, *, every: int, marker_dir: str) -> dict[str, Any]:
    """SIGKILL this worker the first time each multiple of ``every`` arrives;
    else a dict with a 64 KiB tensor, a view of it and a 32 KiB numpy array."""
    if x % every == 0 and _first_time(os.path.join(marker_dir, f"m{x}")):
        os.kill(os.getpid(), signal.SIGKILL)
    t = tensor_of(x, 16384)
    return {"t": t, "view": t[::2], "a": np.full(8192, x, dtype=np.float32)}


def sized(x: int) -> torch.Tensor:
    """Mixed sizes: 1 KiB to 4 MiB float32 tensors (by ``x``), all ``x``."""
    numel = (256, 4096, 16384, 65536, 262144, 1048576)[x % 6]
    return tensor_of(x, numel)

"""Worker-stage functions from a module that imports torch, for the start-up
tests (the forkserver preloads torch for them)."""

from __future__ import annotations

import sys

import torch


def torch_loaded(x: int) -> bool:
    """Whether this worker has imported torch (``x`` is ignored)."""
    return "torch" in sys.modules


def scale(x: int) -> float:
    return float(torch.tensor(float(x)).mul(2.0))

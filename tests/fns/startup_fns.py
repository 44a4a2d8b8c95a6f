"""Worker-stage functions from a module that does not import torch, for the
start-up tests: they report what their worker has imported."""

from __future__ import annotations

import sys


def torch_loaded(x: int) -> bool:
    """Whether this worker has imported torch (``x`` is ignored)."""
    return "torch" in sys.modules


def torch_threads(x: int) -> int:
    """Import torch here, late, and return its intra-op thread count."""
    import torch

    return int(torch.get_num_threads())

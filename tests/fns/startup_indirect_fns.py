"""A worker-stage function from a module that does not import torch itself,
but uses a module that does: its workers need torch all the same."""

from __future__ import annotations

from tests.fns import startup_torch_fns


def double(x: int) -> float:
    return startup_torch_fns.scale(x)

"""A torch-free module inside a package whose ``__init__`` imports torch: its
workers need torch all the same (importing it runs the package first)."""

from __future__ import annotations


def triple(x: int) -> int:
    return 3 * x

"""A package whose ``__init__`` imports torch, for the start-up tests: a
worker importing any of its modules imports torch first."""

from __future__ import annotations

import torch

__all__ = ["torch"]

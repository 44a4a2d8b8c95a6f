"""Deterministic seeds from ``(seed, epoch, …)`` that do not depend on the
process, the worker or ``PYTHONHASHSEED``."""

from __future__ import annotations

import zlib

__all__ = ["derive_seed"]

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed mixing every part (ints, or strings by CRC32)."""
    h = 0
    for part in parts:
        value = zlib.crc32(part.encode()) if isinstance(part, str) else part
        h = _splitmix64(h ^ (value & _MASK))
    return h >> 1

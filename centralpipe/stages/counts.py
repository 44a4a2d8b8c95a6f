"""Per-file item counts for known totals, cached while a file is unchanged.

``loader.total()`` and ``len(loader)`` ask a file reader how many items each
of its files holds (:func:`centralpipe.stages.totals.chain_totals`). Counting
reads the file (``read_jsonl``) or its footer (``read_parquet``), so a count
is kept per file and what was counted, and used again while the file has the
same size and mtime (local) or size (fsspec URLs, whose mtime not every
filesystem reports).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable

from centralpipe.stages.fs import file_size, is_url

__all__ = ["cached_count"]

_counts: dict[tuple[str, Hashable], tuple[tuple[int, int], int]] = {}
_lock = threading.Lock()


def _stamp(path: str) -> tuple[str, tuple[int, int]]:
    if is_url(path):
        return path, (file_size(path, "counting items"), 0)
    real = os.path.realpath(path)
    info = os.stat(real)
    return real, (info.st_size, info.st_mtime_ns)


def cached_count(path: str, what: Hashable, count: Callable[[str], int]) -> int:
    """``count(path)``, or its cached value for ``(path, what)`` while the file
    is unchanged. ``OSError`` if the file cannot be read."""
    key, stamp = _stamp(path)
    with _lock:
        cached = _counts.get((key, what))
    if cached is not None and cached[0] == stamp:
        return cached[1]
    n = count(path)
    if _stamp(path)[1] == stamp:  # not written to while counting
        with _lock:
            _counts[(key, what)] = (stamp, n)
    return n

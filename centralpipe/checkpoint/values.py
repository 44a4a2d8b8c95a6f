"""The checkpoint's value checks: what a count, a stamp and a byte range are.

Small attrs validators (composed from :mod:`centralpipe.validators`) that the
model's classes (:mod:`centralpipe.checkpoint.model`) put on their fields, and
the words their errors use. They check one value each and know nothing of
where in the checkpoint it sits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import attrs
from attrs import validators as v

from centralpipe.validators import NUMBER, FieldError, checked, int_in, sequence_of

__all__ = [
    "INT64_END",
    "IS_MAPPING",
    "RANGE",
    "RANGE_TEXT",
    "SEED_END",
    "STAMP",
    "STAMP_TEXT",
    "count",
]

#: Counts, seqs and indexes fit an int64 (tensors, torch.distributed.checkpoint).
INT64_END = 2**63
#: Seeds are mixed as 64-bit values: larger ones would repeat smaller ones' streams.
SEED_END = 2**64


def count(name: str = "an int >= 0") -> Any:
    """An int in ``[0, 2**63)``; errors say ``name``."""
    return checked(FieldError, name, int_in(0, INT64_END))


def _is_stamp_entry(_inst: Any, _attr: attrs.Attribute[Any], value: Any) -> None:
    # A shard stamps its index (int), or [index, *count totals the item
    # arrived with] when counts precede it; a count stamps (items, weight).
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < INT64_END:
            raise ValueError(value)
        return
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(value)
    if all(isinstance(x, (list, tuple)) for x in value[1:]):  # a shard's [index, *counts]
        int_in(0, INT64_END)(_inst, _attr, value[0])
        for pair in value[1:]:
            _is_stamp_entry(_inst, _attr, pair)
        return
    if len(value) != 2:
        raise TypeError(value)
    items, weight = value
    int_in(0, INT64_END)(_inst, _attr, items)
    NUMBER(_inst, _attr, weight)


#: A stamp: one entry per stamped stage (``count`` totals, ``shard`` index).
STAMP = sequence_of(_is_stamp_entry)
IS_MAPPING: Any = v.instance_of(cast(type, Mapping))
STAMP_TEXT = "a list of shard indexes (int >= 0) and count totals ([items, weight])"


def _is_range(_inst: Any, _attr: attrs.Attribute[Any], value: Any) -> None:
    # [at, file name, start byte, end byte, lines, lines before the in-flight ones]
    if not isinstance(value, (list, tuple)) or len(value) != 6:
        raise TypeError(value)
    at, name, start, end, lines, skip = value
    for n in (at, start, end, lines, skip):
        int_in(0, INT64_END)(_inst, _attr, n)
    if not isinstance(name, str) or not name or not start < end or not skip < lines:
        raise ValueError(value)


#: A byte range of in-flight lines: ``[at, file, start, end, lines, skip]``.
RANGE = _is_range
RANGE_TEXT = (
    "a list of [at, file, start, end, lines, skip] (ints >= 0 but the file's name; "
    "start < end, skip < lines)"
)

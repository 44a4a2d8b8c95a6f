"""The numbers users' functions return to central stages: lengths and weights.

``len_fn`` (``bucket_by_max_tokens``, ``pack``) and ``weight_fn`` (``count``)
may return any numeric type a user's code naturally makes — a Python number,
a numpy scalar, a one-element tensor (``x["mask"].sum()``). The stages keep
what they get in their state, which must hold only builtins (so a checkpoint
loads with ``torch.load(weights_only=True)`` and is checked as it was
written) and must not share a tensor that an in-place ``+=`` would change
under every stamp taken from it. So each value becomes a Python number here,
or is refused at once with a :class:`~centralpipe.PipelineError` naming the
stage:

- a **length** is an ``int >= 0``: a Python or numpy integer, or a one-element
  integer tensor (whatever ``operator.index`` takes, except ``bool``). Floats
  are refused even when integral (``3.0``), as are ``nan``, ``inf``, strings
  and booleans: a length counts tokens, and a float one is most often a bug
  (a mean for a sum); return ``int(...)``.
- a **weight** is a finite real number: an int, a float, a numpy integer or
  float, or a one-element integer or float tensor (made a Python ``int`` or
  ``float``). ``nan``, ``inf``, booleans, complex numbers and strings are
  refused.

The stages call these only off their fast path (a value that is already a
Python ``int``, or a finite ``float`` weight, is used as it is): they run per
item in the main process.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

import torch

from centralpipe.errors import PipelineError

__all__ = ["as_length", "as_weight"]


def _got(raw: Any) -> str:
    text = repr(raw)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = type(raw)
    module = "" if kind.__module__ == "builtins" else f"{kind.__module__}."
    return f"{text} ({module}{kind.__qualname__})"


def _is_bool(raw: Any) -> bool:
    if isinstance(raw, torch.Tensor):
        return raw.dtype == torch.bool
    return isinstance(raw, bool)  # numpy's bool is neither an index nor a number


def as_length(raw: Any, stage: str) -> int:
    """``len_fn``'s ``raw`` result as a Python ``int >= 0``; else a
    ``PipelineError`` naming ``stage`` (see the module docstring)."""
    n = -1
    if not _is_bool(raw):
        try:
            n = operator.index(raw)
        except (TypeError, ValueError, RuntimeError):
            n = -1
    if n < 0:
        msg = (
            f"stage '{stage}': len_fn must return an int >= 0 (a Python or numpy integer, or a "
            f"one-element integer tensor), got {_got(raw)}; return the item's length in "
            "tokens, e.g. int(...)."
        )
        raise PipelineError(msg)
    return n


def as_weight(raw: Any, stage: str, at: int | None = None) -> int | float:
    """``weight_fn``'s ``raw`` result as a Python ``int`` or finite ``float``;
    else a ``PipelineError`` naming ``stage`` (and the item's index ``at`` in
    the stage's input this epoch; see the module docstring)."""
    value: Any = None
    if isinstance(raw, torch.Tensor):
        if raw.numel() == 1 and raw.dtype != torch.bool and not raw.is_complex():
            value = raw.item()
    elif isinstance(raw, float):  # numpy's float64 too
        value = float(raw)
    elif not isinstance(raw, bool):
        try:
            value = operator.index(raw)  # numpy integers (not numpy's bool)
        except TypeError:
            if isinstance(raw, numbers.Real):  # other numpy floats, Fraction
                value = float(raw)
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return value
    where = "" if at is None else f" for item {at} of this epoch"
    msg = (
        f"stage '{stage}': weight_fn must return a finite number (an int or float, a numpy "
        f"number, or a one-element tensor), got {_got(raw)}{where}."
    )
    raise PipelineError(msg)

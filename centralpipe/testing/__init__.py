"""Helpers for testing pipelines: the exact-resume check.

:func:`assert_resumes_exactly` states the invariant every centralpipe pipeline
keeps: for any point ``k``, the first ``k`` items plus the items after resuming
from ``state_dict()`` at ``k`` equal the uninterrupted run — no loss, no
duplicates, same order. Use it in your own tests for your own pipelines::

    from centralpipe.testing import assert_resumes_exactly

    def test_my_pipeline_resumes():
        assert_resumes_exactly(build_my_pipeline(), ks=[0, 10, 1000])

:func:`checkpoint_after` is the step it repeats, for tests that look inside a
checkpoint or damage one: the first ``k`` items of a fresh Loader and its
``state_dict()`` right after them. :func:`items_until_interrupt` collects what
an iterator yields until a ``KeyboardInterrupt`` (an injected Ctrl-C) ends it::

    head, state = checkpoint_after(pipe, 3)
    assert state["central"]["read_lines_1"]["offset"] == 18

:mod:`centralpipe.testing.faults` is the deterministic fault injection the
soak and the interrupt tests use (interrupts inside a call, damaged
checkpoints).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from typing import Any, NamedTuple

import torch

from centralpipe.config import LoaderConfig
from centralpipe.loader import Loader
from centralpipe.plan.pipeline import Pipeline

__all__ = [
    "Checkpoint",
    "assert_resumes_exactly",
    "checkpoint_after",
    "collect",
    "items_until_interrupt",
]

#: Above this many items the default ``ks`` is a spread instead of every k.
EVERY_K_MAX = 200
#: Roughly how many ks the spread holds.
SPREAD_KS = 60


def _equal(a: Any, b: Any) -> bool:
    """Structural equality that understands tensors.

    Tensors are equal when dtype, shape and values match (``torch.equal``);
    lists, tuples and dicts are compared element by element and must be of the
    same container type; anything else uses ``==``.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return (
            isinstance(a, Mapping)
            and isinstance(b, Mapping)
            and a.keys() == b.keys()
            and all(_equal(a[key], b[key]) for key in a)
        )
    return bool(a == b)


def collect(loader: Iterable[Any]) -> list[Any]:
    """All items of one pass over ``loader`` (one epoch, or the rest of one)."""
    return list(loader)


class Checkpoint(NamedTuple):
    """What :func:`checkpoint_after` returns: the items delivered, and the
    ``state_dict()`` taken right after the last of them."""

    items: list[Any]
    state: dict[str, Any]


def checkpoint_after(
    pipeline: Pipeline, k: int, config: LoaderConfig | None = None, *, epochs: int = 1
) -> Checkpoint:
    """The first ``k`` items of a fresh :class:`Loader` (built with ``config``)
    and its ``state_dict()`` right after the ``k``-th, the Loader then closed.

    ``k`` counts items across ``epochs`` consecutive passes; fewer than ``k``
    items come back when the run ends before (the state is then the end's).
    Raises ``ValueError`` for a negative ``k`` or ``epochs < 1``."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"`k` must be an int >= 0, got {k!r}.")
    if epochs < 1:
        raise ValueError(f"`epochs` must be >= 1, got {epochs}.")
    loader: Loader[Any]
    with Loader(pipeline, config) as loader:
        head = _take(loader, k, epochs)
        return Checkpoint(head, loader.state_dict())


def items_until_interrupt(iterator: Iterable[Any]) -> list[Any]:
    """The items ``iterator`` yields before a ``KeyboardInterrupt`` ends it.

    For tests that inject a Ctrl-C: the iterator (e.g. ``iter(loader)``) can
    be used again afterwards. Raises ``AssertionError`` if it ends without one."""
    got: list[Any] = []
    try:
        for item in iterator:
            got.append(item)
    except KeyboardInterrupt:
        return got
    raise AssertionError(f"no KeyboardInterrupt: the iterator ended after {len(got)} items.")


def _torch_roundtrip(state_dict: Mapping[str, Any]) -> Any:
    """``state_dict`` after ``torch.save`` / ``torch.load`` through memory, as a
    checkpoint written to disk and read back would be."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _default_ks(n: int) -> list[int]:
    """Every ``k`` in ``0..n``, or for ``n > EVERY_K_MAX`` about ``SPREAD_KS``
    of them spread evenly, always including ``0``, ``1``, ``n - 1`` and ``n``."""
    if n <= EVERY_K_MAX:
        return list(range(n + 1))
    spread = {round(i * n / (SPREAD_KS - 1)) for i in range(SPREAD_KS)}
    return sorted(spread | {0, 1, n - 1, n})


def _run_epochs(
    pipeline: Pipeline, config: LoaderConfig | None, epochs: int, max_items: int | None
) -> list[Any]:
    loader: Loader[Any]
    with Loader(pipeline, config) as loader:
        if max_items is not None:
            return list(islice(loader, max_items))
        out: list[Any] = []
        for _ in range(epochs):
            out.extend(loader)
    return out


def _take(loader: Loader[Any], k: int, epochs: int) -> list[Any]:
    """The first ``k`` items of ``epochs`` consecutive passes, without running
    past the ``k``-th (so the checkpoint is taken right after it)."""
    head: list[Any] = []
    it = iter(loader)
    passes = 1
    while len(head) < k:
        try:
            head.append(next(it))
        except StopIteration:
            if passes >= epochs:
                break
            it = iter(loader)
            passes += 1
    return head


def _first_difference(expected: Sequence[Any], got: Sequence[Any]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, got)):
        if not _equal(a, b):
            return i
    if len(expected) != len(got):
        return min(len(expected), len(got))
    return None


def _show(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def assert_resumes_exactly(
    pipeline: Pipeline,
    config: LoaderConfig | None = None,
    *,
    resume_config: LoaderConfig | None = None,
    ks: Iterable[int] | None = None,
    epochs: int = 1,
    max_items: int | None = None,
) -> list[Any]:
    """Check that resuming from a checkpoint at any ``k`` loses and repeats nothing.

    First runs ``epochs`` epochs uninterrupted in a fresh :class:`Loader`
    (``full``). Then, for every ``k`` in ``ks``: takes the first ``k`` items
    from a fresh Loader (built with ``config``), takes ``state_dict()``, sends
    it through ``torch.save``/``torch.load``, loads it into another fresh Loader
    (built with ``resume_config``, default ``config``) and iterates that one to
    the end of epoch ``epochs``. Asserts ``head + rest == full`` (tensors
    compared with ``torch.equal``).

    Args:
        pipeline: the pipeline to check; built into a new Loader each time.
        config: config of the uninterrupted run and of the interrupted one.
        resume_config: config of the resumed loader, e.g. another ``num_workers``.
        ks: the checkpoint positions, counted in items across epochs; default
            every ``k`` in ``0..len(full)`` (a spread of about 60 above 200 items).
        epochs: how many consecutive epochs the run covers.
        max_items: compare only the first ``max_items`` items of one epoch
            (for endless pipelines, e.g. ``Pipeline.mix(..., stop="never")``).

    Returns:
        ``full``, the uninterrupted output, for further checks.

    Raises:
        AssertionError: naming ``k``, the first differing index, and the
            expected and resumed values there.
    """
    if epochs < 1:
        raise ValueError(f"`epochs` must be >= 1, got {epochs}.")
    if max_items is not None and (max_items < 0 or epochs != 1):
        raise ValueError(f"`max_items` must be >= 0 and used with epochs=1, got {max_items}.")
    if resume_config is None:
        resume_config = config
    full = _run_epochs(pipeline, config, epochs, max_items)
    n = len(full)
    for k in _default_ks(n) if ks is None else ks:
        if not 0 <= k <= n:
            raise ValueError(f"k={k} is outside 0..{n} (the uninterrupted run has {n} items).")
        loader: Loader[Any]
        resumed: Loader[Any]
        with Loader(pipeline, config) as loader:
            head = _take(loader, k, epochs)
            state = _torch_roundtrip(loader.state_dict())
        with Loader(pipeline, resume_config) as resumed:
            resumed.load_state_dict(state)
            if max_items is not None:
                rest: list[Any] = list(islice(resumed, max_items - k))
            else:
                rest = list(resumed)
                while resumed.epoch < epochs:
                    rest.extend(resumed)
        got = head + rest
        i = _first_difference(full, got)
        if i is not None:
            where = "before the checkpoint" if i < k else f"{i - k} after the resume"
            expected = _show(full[i]) if i < n else "<end of run>"
            actual = _show(got[i]) if i < len(got) else "<end of run>"
            msg = (
                f"resume from a checkpoint at k={k} is not exact: first difference at index "
                f"{i} ({where}): expected {expected}, got {actual}; the uninterrupted run has "
                f"{n} items, head + resumed rest has {len(got)}."
            )
            raise AssertionError(msg)
    return full

"""A ``tqdm`` progress bar over a ``count`` stage: pre-shard progress, per rank.

Because the central stages run in the caller's process, the bar reads the
count stage's totals as of the last delivered item
(``loader.query(stage, delivered=True)``) — exact even when the feeder runs far
ahead with an unlimited buffer. Placed before ``shard()``, the count sees the
whole central stream, which every rank runs identically, so rank 0 alone can
show the progress of the whole job without any cross-rank communication.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from typing import Any, TypeVar

from tqdm.auto import tqdm

from centralpipe.loader import Loader

__all__ = ["progress"]

T = TypeVar("T")

ITEMS_KEY = "items"
WEIGHT_KEY = "weight"


def progress(
    loader: Loader[T],
    stage: str = "pre_shard",
    total: float | None = None,
    unit: str = "samples",
    *,
    rank: int | None = None,
    desc: str | None = None,
    min_interval_s: float = 0.1,
    **tqdm_kwargs: Any,
) -> Generator[T, None, None]:
    """Iterate ``loader`` (one epoch, or the rest of a resumed one) with a bar
    whose value is the ``weight`` of count stage ``stage`` as delivered, and
    whose postfix is the stage's ``items`` count.

    With ``.count("pre_shard", weight_fn=len)`` on batches before ``shard()``,
    the value is the number of samples consumed by all ranks together. The bar
    starts at the checkpoint's value when the loader was resumed.

    Args:
        loader: the loader to iterate; ``iter(loader)`` is called once.
        stage: name of a ``count`` stage.
        total: the value at the end of the epoch (e.g. the corpus's sample
            count), or ``None`` when unknown.
        unit: tqdm's unit label.
        rank: the rank this process shows the bar for; the bar is shown only
            for rank 0. Default: ``loader.config.distributed.rank``. Other
            ranks iterate without a bar (``disable=True``) and query nothing
            after the start.
        desc: tqdm's description (prefix).
        min_interval_s: the bar (and so the query) is updated at most this
            often; the clock is read once per item. The value is made exact
            once more when iteration ends, stops early, or raises.
        **tqdm_kwargs: passed to ``tqdm`` (``file``, ``leave``,
            ``dynamic_ncols``, ``disable`` …).

    Returns:
        An iterator over the loader's items; the bar is closed when it ends,
        is closed, or is garbage collected.

    Raises:
        KeyError: ``stage`` is not a central stage of the loader.
        ValueError: ``stage`` is not a ``count`` stage, or ``min_interval_s < 0``.

    Example::

        pipe = (
            cp.Pipeline.from_files("data/*.txt")
            .read_lines()
            .map(tokenize)
            .bucket_by_max_tokens(4096, len_fn=len, buffer_size=50_000)
            .count("pre_shard", weight_fn=len)  # sequences before sharding
            .shard(equalize="drop_last")
            .dispatch()
            .map(collate_pad)
        )
        with cp.Loader(pipe, config) as loader:
            for batch in cp.progress(loader, total=num_sequences, unit="seq"):
                train_step(batch)
    """
    if not isinstance(min_interval_s, (int, float)) or min_interval_s < 0:
        msg = f"`min_interval_s` must be a number >= 0, got {min_interval_s!r}."
        raise ValueError(msg)
    # Raises KeyError for an unknown stage and ValueError for a non-count stage
    # now, at the call, rather than at the first ``next()``.
    loader.query(stage, delivered=True)
    if rank is None:
        rank = loader.config.distributed.rank
    tqdm_kwargs.setdefault("disable", rank != 0)
    tqdm_kwargs.setdefault("mininterval", min_interval_s)
    return _iterate(loader, stage, total, unit, desc, min_interval_s, tqdm_kwargs)


def _iterate(
    loader: Loader[T],
    stage: str,
    total: float | None,
    unit: str,
    desc: str | None,
    min_interval_s: float,
    tqdm_kwargs: dict[str, Any],
) -> Generator[T, None, None]:
    # Start the pass first (this generator is itself lazy): starting a new
    # epoch resets the count stage, and a resumed loader reports the
    # checkpoint's totals only from here on.
    it = loader._iter_started()
    state = loader.query(stage, delivered=True)
    bar = tqdm(
        total=total,
        initial=state[WEIGHT_KEY],
        unit=unit,
        desc=desc,
        postfix={ITEMS_KEY: state[ITEMS_KEY]},
        **tqdm_kwargs,
    )
    try:
        if bar.disable:
            yield from it
            return
        monotonic = time.monotonic
        last = monotonic()
        try:
            for item in it:
                now = monotonic()
                if now - last >= min_interval_s:
                    last = now
                    _show(bar, loader.query(stage, delivered=True))
                yield item
        except GeneratorExit:  # the consumer stopped early: show where it stopped
            _show(bar, loader.query(stage, delivered=True))
            raise
        except BaseException:
            with contextlib.suppress(Exception):  # keep the loader's error, not ours
                _show(bar, loader.query(stage, delivered=True))
            raise
        _show(bar, loader.query(stage, delivered=True))
    finally:
        bar.close()


def _show(bar: Any, state: dict[str, Any]) -> None:
    """Set the bar to ``state["weight"]`` (tqdm counts the increment for its rate)."""
    bar.set_postfix({ITEMS_KEY: state[ITEMS_KEY]}, refresh=False)
    bar.update(state[WEIGHT_KEY] - bar.n)

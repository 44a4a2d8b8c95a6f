"""A ``tqdm`` progress bar over a ``count`` stage: pre-shard progress, per rank.

Because the central stages run in the caller's process, the bar reads the
count stage's totals as of the last delivered item
(``loader.query(stage, delivered=True)``) — exact even when the feeder runs far
ahead with an unlimited buffer. Placed before ``shard()``, the count sees the
whole central stream, which every rank runs identically, so rank 0 alone can
show the progress of the whole job without any cross-rank communication.

The bar's end (tqdm's ``total``) is the ``total`` given, or else the weight
the stage reaches at the end of the epoch when the pipeline tells it exactly
(``loader.total(stage, weight=True)``: e.g. ``weight_fn=len`` on the batches
of a ``batch``, ``bucket_by_max_tokens`` or ``pack`` over a source of known
length); an upper bound or an unknown weight gives a bar without an end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from tqdm.auto import tqdm

from centralpipe.loader import Loader

__all__ = ["progress"]

T = TypeVar("T")

ITEMS_KEY = "items"
WEIGHT_KEY = "weight"
#: No item is held (see ``_Progress.__next__``).
_NOTHING: Any = object()


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
) -> Iterator[T]:
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
            count). ``None``: the exact weight total the pipeline tells
            (``loader.total(stage, weight=True)``), if any; else the bar has
            no end.
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
        raises, is closed, or is garbage collected. After a Ctrl-C
        (``KeyboardInterrupt``) in ``next()`` the bar stays open and the same
        iterator gives the remaining items.

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

    Without ``min_len`` the bucket keeps every line, so the total is known
    (the lines of the files) and ``total`` can be left out.
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
    # Lazy, as a generator would be: the pass starts at the first ``next()``
    # (starting a new epoch resets the count stage, and a resumed loader
    # reports the checkpoint's totals only from there on).
    return _Bar(loader, stage, total, unit, desc, min_interval_s, tqdm_kwargs)


class _Bar(Iterator[T]):
    """The iterator ``progress`` returns.

    A class, not a generator: an exception raised through a generator ends
    it, so a Ctrl-C landing in the loader's ``next()`` would end the loop's
    iterator although the loader's own iterator goes on. Here a
    ``KeyboardInterrupt`` (or ``SystemExit``) shows the bar where it stands
    and leaves both open: the next ``next()`` gives exactly the remaining
    items. Any other exception, the end of the pass, ``close()`` or garbage
    collection closes the bar, exact.
    """

    def __init__(
        self,
        loader: Loader[T],
        stage: str,
        total: float | None,
        unit: str,
        desc: str | None,
        min_interval_s: float,
        tqdm_kwargs: dict[str, Any],
    ) -> None:
        self._loader = loader
        self._stage = stage
        self._bar_args = (total, unit, desc, tqdm_kwargs)
        #: An item taken from the loader but not yet returned (``_NOTHING``: none).
        self._held: Any = _NOTHING
        self._min_interval_s = min_interval_s
        self._it: Iterator[T] | None = None
        self._bar: Any = None
        self._done = False
        self._last = 0.0

    def __iter__(self) -> _Bar[T]:
        return self

    def _start(self) -> None:
        it = self._loader._iter_started()
        state = self._loader.query(self._stage, delivered=True)
        total, unit, desc, tqdm_kwargs = self._bar_args
        if total is None:
            known = self._loader.total(self._stage, weight=True)
            total = known.items if known is not None and known.exact else None
        self._bar = tqdm(
            total=total,
            initial=state[WEIGHT_KEY],
            unit=unit,
            desc=desc,
            postfix={ITEMS_KEY: state[ITEMS_KEY]},
            **tqdm_kwargs,
        )
        self._it = it
        self._last = time.monotonic()

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        held = self._held
        if held is not _NOTHING:  # taken by a next() that a Ctrl-C cut short
            self._held = _NOTHING
            return held
        if self._it is None:
            self._start()  # an interrupted start is started again next time
        assert self._it is not None
        try:
            # A method call, not ``next()``: CPython may handle a Ctrl-C as
            # that builtin returns, dropping the item.
            item = self._it.__next__()
        except StopIteration:
            self.close()
            raise
        except Exception:
            self.close()  # shows the value where the loader stopped
            raise
        except BaseException:  # Ctrl-C: the pass goes on at the next ``next()``
            self._refresh()
            raise
        # Kept (no call in between) until it is returned: a Ctrl-C in the
        # bar's update hands it out at the next ``next()``, not never.
        self._held = item
        if not self._bar.disable:
            now = time.monotonic()
            if now - self._last >= self._min_interval_s:
                self._last = now
                self._refresh()
        self._held = _NOTHING
        return item

    def _refresh(self) -> None:
        if self._bar is not None and not self._bar.disable:
            with contextlib.suppress(Exception):  # keep the loader's error, not ours
                _show(self._bar, self._loader.query(self._stage, delivered=True))

    def close(self) -> None:
        """Show the exact value and close the bar (the loader stays open)."""
        if self._done:
            return
        self._done = True
        self._refresh()
        if self._bar is not None:
            self._bar.close()

    def __del__(self) -> None:  # the consumer stopped early and dropped it
        with contextlib.suppress(Exception):
            self.close()


def _show(bar: Any, state: dict[str, Any]) -> None:
    """Set the bar to ``state["weight"]`` (tqdm counts the increment for its rate)."""
    bar.set_postfix({ITEMS_KEY: state[ITEMS_KEY]}, refresh=False)
    bar.update(state[WEIGHT_KEY] - bar.n)

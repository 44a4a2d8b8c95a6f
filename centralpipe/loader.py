"""The Loader: epochs, checkpoints, queries, metrics, and the workers' lifetime.

Each pass over the loader is one epoch (or the rest of the epoch a checkpoint
was taken in); it starts at the iterator's first ``next()``, not at
``iter()``. Everything central (the central stages, the worker pool, the
current run, the pending checkpoint) sits behind one object,
:class:`~centralpipe.dispatch.central.Central`, the only part of
``dispatch/`` the Loader knows. With the default ``central="process"`` it
lives in the caller's process; with ``central="service"`` in one helper
process, the Loader keeping a thin client of the same surface
(:mod:`centralpipe.dispatch.service`). The worker processes are kept across
epochs (with ``forkserver`` and ``spawn`` they
start in the background when the Loader is created, so the first pass only
sends them work; ``fork`` workers start at the first pass).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from centralpipe.config import LoaderConfig
from centralpipe.dispatch.central import open_central
from centralpipe.errors import PipelineError
from centralpipe.launchers import warn_if_duplicating
from centralpipe.plan.pipeline import Pipeline
from centralpipe.stages.totals import Total

__all__ = ["Loader"]

T = TypeVar("T")


class Loader(Generic[T]):
    """Iterate a :class:`~centralpipe.Pipeline`; see the module docstring.

    ``with Loader(pipe, config) as loader: for item in loader: ...``
    """

    def __init__(self, pipeline: Pipeline, config: LoaderConfig | None = None) -> None:
        if not isinstance(pipeline, Pipeline):
            msg = f"Loader needs a centralpipe.Pipeline, got {type(pipeline).__name__}."
            raise PipelineError(msg)
        if config is None:
            config = LoaderConfig()
        if not isinstance(config, LoaderConfig):
            msg = f"`config` must be a centralpipe.LoaderConfig, got {type(config).__name__}."
            raise PipelineError(msg)
        self._pipe = pipeline
        self._config = config
        warn_if_duplicating(config.distributed.world_size)
        self._iters = 0
        self._closed = False
        self._central = open_central(pipeline, config)

    @property
    def config(self) -> LoaderConfig:
        return self._config

    @property
    def pipeline(self) -> Pipeline:
        return self._pipe

    @property
    def epoch(self) -> int:
        """Epochs started so far (after ``load_state_dict``, the checkpoint's)."""
        return self._central.epoch

    # -- iteration -------------------------------------------------------------

    def __iter__(self) -> Iterator[T]:
        # Cheap: nothing starts until the first next(), so a caller that only
        # probes iter() (as Lightning does) starts no epoch and no worker. A
        # newer iter() supersedes any earlier iterator at once.
        self._check_open()
        self._central.stop()
        self._iters += 1
        return _Pass(self, self._iters, None)

    def _iter_started(self) -> Iterator[T]:
        """``iter()`` that starts the pass now: for wrappers that are lazy
        themselves and read the pass's starting state (``progress``)."""
        iter(self)
        return _Pass(self, self._iters, self._central.start())

    def _set_next_epoch(self, epoch: int) -> None:
        """Make the next pass start epoch ``epoch`` from its start, dropping a
        pending checkpoint and the unread rest of the current epoch (as a new
        pass drops it). For adapters of frameworks that count epochs themselves
        (``centralpipe.lightning``)."""
        self._check_open()
        self._central.set_next_epoch(epoch)

    def total(self, stage: str | None = None, *, weight: bool = False) -> Total | None:
        """Items one whole epoch yields, known without iterating: a
        :class:`~centralpipe.Total` (``items``, and ``exact=False`` when it is
        only an upper bound, e.g. after a ``filter``), or ``None`` when unknown.

        ``stage=None``: this loader's output (this rank's, after the worker
        stages). A stage name: the items that stage yields (e.g. the ``count``
        a progress bar shows, before ``shard()``: every rank's items). May count
        the lines of ``read_lines`` files (once per file, cached).

        ``weight=True`` (``count`` stages): the ``weight`` the stage reaches at
        the end of the epoch instead, in ``Total.items``, where the pipeline
        tells it: without a ``weight_fn`` its item total, with
        ``weight_fn=len`` on the lists of a ``batch``, ``bucket_by_max_tokens``
        or ``pack`` the items going into that stage; otherwise ``None``
        (:func:`~centralpipe.stages.totals.weight_total`)."""
        if not isinstance(weight, bool):
            raise TypeError(f"`weight` must be a bool, got {weight!r}.")
        return self._central.total(stage, weight=weight)

    def __len__(self) -> int:
        return self._central.length()

    # -- checkpoints -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the last item delivered; builtins and tensors only.

        Call it from the thread that iterates. It never iterates the pipeline
        and never asks a worker anything. It waits for a central ``next()`` in
        progress (the feeder's), at most
        :data:`centralpipe.config.CENTRAL_WAIT_S` (60 s), then raises
        ``TimeoutError`` naming the stage: never an inexact state."""
        self._check_open()
        return self._central.state("state_dict()")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the checkpoint's position at the next ``iter()``.

        The whole checkpoint is checked first, against the typed model
        (:mod:`centralpipe.checkpoint`) and against this pipeline: a damaged
        checkpoint or one of another pipeline raises ``CheckpointError`` naming
        the key and leaves the loader exactly as it was (a live iterator keeps
        going, an earlier loaded checkpoint stays pending). Like
        ``state_dict()`` it waits at most :data:`~centralpipe.config.CENTRAL_WAIT_S` for a central
        ``next()`` in progress (``TimeoutError``, the loader unchanged)."""
        self._check_open()
        self._central.load(state_dict)

    # -- queries -----------------------------------------------------------------

    def query(self, name: str, *, delivered: bool = False) -> dict[str, Any]:
        """A copy of central stage ``name``'s live state; with ``delivered=True``
        (``count`` stages) its totals as of the last item the consumer received."""
        return self._central.query(name, delivered=delivered)

    def metrics(self) -> dict[str, Any]:
        """Per central stage items in/out and own time; ``"dispatch"``: buffer,
        skipped items, worker restarts, items per worker and waiting times.
        Never waits (see :mod:`centralpipe.metrics`)."""
        return self._central.metrics()

    def worker_states(self) -> list[dict[str, Any]]:
        """``state_dict()`` of each worker's stateful worker-stage callables, one
        dict per worker (inline: one). Never needed for exact resume."""
        self._check_open()
        return self._central.worker_states()

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty before the first iteration
        and with ``num_workers=0``), e.g. for monitoring."""
        return self._central.worker_pids()

    # -- lifetime ------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers and the feeder, close files; idempotent. A
        ``close()`` cut short by Ctrl-C is finished by the next one (or, at
        the latest, by the finalizer)."""
        self._closed = True
        self._central.close()

    def __enter__(self) -> Loader[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Loader is closed.")


class _Pass(Iterator[T]):
    """One pass's iterator. It holds the Loader, not only the pass's outputs:
    ``for x in Loader(...)`` must keep the Loader (and so its workers) alive
    while it iterates. Not a generator, so a Ctrl-C inside ``next()`` ends
    nothing: an interrupted start is started again by the next ``next()``,
    an interrupted delivery goes on where it was."""

    def __init__(self, loader: Loader[T], ticket: int, outputs: Iterator[Any] | None) -> None:
        self._loader = loader
        self._ticket = ticket
        self._outputs = outputs

    def __iter__(self) -> _Pass[T]:
        return self

    def __next__(self) -> T:
        outputs = self._outputs
        if outputs is None:
            loader = self._loader
            if self._ticket != loader._iters:
                raise RuntimeError(
                    "this iterator was superseded before it started: iter(loader) was "
                    "called again; iterate the newest iterator."
                )
            loader._check_open()
            # Kept as soon as it is started (no call in between): a Ctrl-C
            # after this point must not start the pass a second time.
            outputs = self._outputs = loader._central.start()
        # A method call, not ``next(outputs)``: a Ctrl-C handled as that
        # builtin returns would drop the output it got (see Stream.next_output).
        return outputs.__next__()

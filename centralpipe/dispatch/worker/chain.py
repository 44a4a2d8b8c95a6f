"""The worker stages of a pipeline, run over a chunk of dispatched items.

The same :class:`WorkerChain` runs inside each worker process and inline in
the main process (``num_workers=0``), so output does not depend on where it ran.
Output depends only on ``(item, seed, epoch, seq)``: ``map(fn, with_rng=True)``
gets a ``torch.Generator`` seeded from those and the stage name. How each
stage applies to an input's values is its kind's
(:class:`~centralpipe.plan.kinds.WorkerKind`).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from centralpipe.dispatch.wire.protocol import (
    ChunkResult,
    StageFailure,
    exception_text,
    status_begin,
    status_idle,
    status_stage,
)
from centralpipe.plan.kinds import WorkerKind
from centralpipe.plan.specs import StageSpec
from centralpipe.seeding import derive_seed

__all__ = ["WorkerChain", "is_stateful"]


def is_stateful(fn: Any) -> bool:
    """A worker-stage callable with ``state_dict``/``load_state_dict``."""
    return callable(getattr(fn, "state_dict", None)) and callable(
        getattr(fn, "load_state_dict", None)
    )


class WorkerChain:
    """Runs the worker stages (``map``/``filter``/``flat_map``/``collate``)."""

    def __init__(self, specs: Sequence[StageSpec], seed: int, flat_arrays: bool = True) -> None:
        self.specs = tuple(specs)
        self.seed = seed
        #: Lists of 1-D arrays cross as one buffer plus offsets (``wire.tokens``):
        #: a chunk's outputs on the way back, and each item on the way in.
        self.flat_arrays = flat_arrays
        self._stages = [(s.item_kind, s.name, s.fn, s.item_options.with_rng) for s in specs]
        # 1:1 chains (only maps/collates) skip the per-input output counts.
        self.one_to_one = all(kind.outputs == "one" for kind, *_ in self._stages)
        #: Indexes of the batched maps (``fn(list of items) -> list``).
        self._batched = frozenset(i for i, (k, *_) in enumerate(self._stages) if k.batched)
        # Maps without rng run in a tight loop until one raises.
        plain = self.one_to_one and not any(rng for *_, rng in self._stages) and not self._batched
        self._plain_maps = [fn for _, _, fn, _ in self._stages] if plain else None
        #: Applied to each final output as it is made (a worker process sets
        #: it to move large outputs into its ring: ``dispatch.stash``).
        self.keep: Callable[[Any], Any] | None = None

    def _run_plain(
        self, stream: int, first_seq: int, items: Sequence[Any], outputs: list[Any], status: Any
    ) -> StageFailure | None:
        """Run plain map stages over ``items`` into ``outputs`` until one
        raises; that failure is returned (its item is ``len(outputs)``) so no
        stage runs twice on an item."""
        fns = self._plain_maps
        assert fns is not None
        keep = self.keep
        append = outputs.append
        k = 0
        try:
            if status is None and len(fns) == 1:
                (fn,) = fns
                if keep is None:
                    for item in items:
                        append(fn(item))
                else:
                    for item in items:
                        append(keep(fn(item)))
            elif status is None:
                for item in items:
                    for k, fn in enumerate(fns):  # noqa: B007 - k is read by the except
                        item = fn(item)
                    append(item if keep is None else keep(item))
            else:
                single = len(fns) == 1
                for i, item in enumerate(items):
                    status_begin(status, stream, first_seq + i, 0)
                    if single:
                        item = fns[0](item)
                    else:
                        for k, fn in enumerate(fns):
                            if k:
                                status_stage(status, k)
                            item = fn(item)
                    append(item if keep is None else keep(item))
        except Exception as exc:
            name = self._stages[k][1]
            return StageFailure(
                len(outputs), name, type(exc).__name__, exception_text(exc), traceback.format_exc()
            )
        return None

    def run_chunk(
        self,
        epoch: int,
        first_seq: int,
        items: Sequence[Any],
        skip: frozenset[int] = frozenset(),
        status: Any = None,
        stream: int = 0,
        rng_key: tuple[int, int] | None = None,
    ) -> ChunkResult:
        """Run every input of a chunk; a failing input is recorded, not raised."""
        key0, step = rng_key if rng_key is not None else (first_seq, 1)
        start = time.perf_counter()
        outputs: list[Any] = []
        counts: list[int] = []
        failures: list[StageFailure] = []
        begin = 0
        if self._batched:
            result = self._run_stagewise(epoch, first_seq, items, skip, status, stream, key0, step)
            return result._replace(elapsed_s=time.perf_counter() - start)
        if self._plain_maps is not None and not skip:
            failure = self._run_plain(stream, first_seq, items, outputs, status)
            if failure is None:
                if status is not None:
                    status_idle(status)
                return ChunkResult(outputs, None, None, time.perf_counter() - start)
            # Item ``failure.at`` raised: record it and go on item by item.
            failures.append(failure)
            counts = [1] * failure.at + [0]
            begin = failure.at + 1
        stages = self._stages
        for i in range(begin, len(items)):
            item = items[i]
            seq = first_seq + i
            if status is not None:
                status_begin(status, stream, seq, 0)
            if i in skip:
                counts.append(0)
                continue
            values = [item]
            for stage_index, (kind, name, fn, with_rng) in enumerate(stages):
                if status is not None and stage_index:
                    status_stage(status, stage_index)
                try:
                    rng = self.make_rng(epoch, key0 + i * step, name) if with_rng else None
                    values = kind.apply(fn, values, rng)
                except Exception as exc:
                    failures.append(
                        StageFailure(
                            i, name, type(exc).__name__, exception_text(exc), traceback.format_exc()
                        )
                    )
                    values = []
                    break
            outputs.extend(values if self.keep is None else map(self.keep, values))
            counts.append(len(values))
        if status is not None:
            status_idle(status)
        return ChunkResult(
            outputs,
            counts,
            failures or None,
            time.perf_counter() - start,
        )

    def _run_stagewise(
        self,
        epoch: int,
        first_seq: int,
        items: Sequence[Any],
        skip: frozenset[int],
        status: Any,
        stream: int,
        key0: int,
        step: int,
    ) -> ChunkResult:
        """A chunk through a chain with batched maps: stage by stage, each
        batched map called once with the values of every live input."""
        groups: list[list[Any]] = [[] if i in skip else [x] for i, x in enumerate(items)]
        failed: dict[int, StageFailure] = {}
        if status is not None and items:
            status_begin(status, stream, first_seq, 0)
        for stage_index, (kind, name, fn, with_rng) in enumerate(self._stages):
            if status is not None and stage_index:
                status_stage(status, stage_index)
            live = [i for i in range(len(groups)) if i not in failed and groups[i]]
            if stage_index in self._batched:
                self._call_batched(kind, name, fn, groups, live, failed)
                continue
            for i in live:
                try:
                    rng = self.make_rng(epoch, key0 + i * step, name) if with_rng else None
                    groups[i] = kind.apply(fn, groups[i], rng)
                except Exception as exc:
                    failed[i] = _failure(i, name, exc)
                    groups[i] = []
        if status is not None:
            status_idle(status)
        keep = self.keep
        outputs = [v if keep is None else keep(v) for g in groups for v in g]
        counts = [len(g) for g in groups]
        failures = [failed[i] for i in sorted(failed)] or None
        return ChunkResult(outputs, counts, failures, 0.0)

    @staticmethod
    def _call_batched(
        kind: WorkerKind,
        name: str,
        fn: Any,
        groups: list[list[Any]],
        live: list[int],
        failed: dict[int, StageFailure],
    ) -> None:
        """``fn`` over the values of the ``live`` inputs in one call; if it
        raises (or returns the wrong number of outputs), input by input."""
        values = [v for i in live for v in groups[i]]
        try:
            outs = kind.apply(fn, values, None)
        except Exception:
            for i in live:
                try:
                    groups[i] = kind.apply(fn, groups[i], None)
                except Exception as exc:
                    failed[i] = _failure(i, name, exc)
                    groups[i] = []
            return
        pos = 0
        for i in live:
            n = len(groups[i])
            groups[i] = outs[pos : pos + n]
            pos += n

    def make_rng(self, epoch: int, seq: int, stage: str) -> Any:
        import torch

        rng = torch.Generator()
        rng.manual_seed(derive_seed(self.seed, epoch, seq, stage))
        return rng

    @property
    def stateful(self) -> bool:
        """Some stage's callable keeps state (``worker_states()`` reads it)."""
        return any(is_stateful(fn) for _, _, fn, _ in self._stages)

    def states(self) -> dict[str, Any]:
        """``state_dict()`` of each stateful worker-stage callable, by stage name."""
        return {name: fn.state_dict() for _, name, fn, _ in self._stages if is_stateful(fn)}


def _failure(i: int, stage: str, exc: Exception) -> StageFailure:
    return StageFailure(i, stage, type(exc).__name__, exception_text(exc), traceback.format_exc())

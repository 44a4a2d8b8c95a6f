"""The immutable pipeline builder.

A :class:`Pipeline` is a tuple of frozen :class:`StageSpec` s. Every builder
method validates its arguments (:mod:`centralpipe.plan.checks`; the sources'
in :mod:`centralpipe.plan.sources`, ``mix``'s in :mod:`centralpipe.plan.mix`)
and returns a *new* pipeline; building never starts a process or touches a
file. ``dispatch()`` splits the plan: stages
before it are *central* (run in the main process, stateful, checkpointed);
stages after it are *worker* stages (stateless per-item functions run in worker
processes, or inline with ``num_workers=0``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from torchdata.nodes import BaseNode

from centralpipe.errors import PipelineError
from centralpipe.plan.checks import (
    bucket_options,
    check_callable,
    check_count,
    check_equalize,
    check_int,
    check_name,
    check_placement,
    item_options,
    pack_options,
    read_jsonl_options,
    read_lines_options,
    read_parquet_options,
)
from centralpipe.plan.kinds import WORKER_KINDS, ItemOptions
from centralpipe.plan.mix import inner_specs, mix_spec
from centralpipe.plan.options import BatchOptions, NoOptions, Options, ShardOptions, ShuffleOptions
from centralpipe.plan.sources import dataset_spec, files_spec, iterable_spec, node_spec
from centralpipe.plan.specs import Placement, Plan, StageSpec, plan_repr

__all__ = ["WORKER_KINDS", "Pipeline", "StageSpec"]


class Pipeline:
    """An immutable plan of stages; see the module docstring.

    Build with a source classmethod, chain stages, and hand it to
    :class:`~centralpipe.Loader`::

        pipe = Pipeline.from_iterable(range(10)).map(f).dispatch().map(g)
    """

    __slots__ = ("_specs",)

    def __init__(self, specs: tuple[StageSpec, ...]) -> None:
        if not specs or specs[0].placement != "source":
            msg = "a Pipeline starts with a source: use Pipeline.from_iterable/from_files/..."
            raise PipelineError(msg)
        self._specs = specs

    # -- sources -------------------------------------------------------------

    @classmethod
    def from_iterable(cls, iterable: Any, /, *, name: str = "source") -> Pipeline:
        """Items of a re-iterable: a sequence (resumes by index), a zero-argument
        callable returning a fresh iterator, or an object whose ``iter()`` gives
        a fresh iterator each time (both resume by skipping forward).

        An object with ``state_dict()`` and ``load_state_dict()`` (a Hugging
        Face ``datasets.IterableDataset``) is checkpointed through them, never
        by skipping forward; one that says it cannot resume exactly (a shuffle
        buffer) is refused when the Loader starts.

        A one-shot iterator (a generator, ``iter(x)``) cannot start a second
        epoch and is refused; wrap it in a function instead.
        """
        return cls((iterable_spec(iterable, name),))

    @classmethod
    def from_files(
        cls,
        paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        /,
        *,
        name: str = "files",
    ) -> Pipeline:
        """File paths: a glob (matches sorted; resolved when the Loader starts) or
        a sequence of paths kept in the given order. Yields ``str`` paths."""
        return cls((files_spec(paths, name),))

    @classmethod
    def from_dataset(cls, dataset: Any, /, *, name: str = "dataset") -> Pipeline:
        """``dataset[i]`` for ``i`` in ``range(len(dataset))``, resuming by index."""
        return cls((dataset_spec(dataset, name),))

    @classmethod
    def from_node(cls, node: BaseNode[Any], /, *, name: str = "node") -> Pipeline:
        """Any ``torchdata.nodes.BaseNode``; its own ``state_dict`` is checkpointed."""
        return cls((node_spec(node, name),))

    @classmethod
    def mix(
        cls,
        pipelines: Mapping[str, Pipeline],
        /,
        weights: Mapping[str, float],
        *,
        stop: Literal["first_exhausted", "all_exhausted", "never"] = "all_exhausted",
        name: str = "mix",
    ) -> Pipeline:
        """Items drawn from several sub-pipelines (central stages only) with
        probability proportional to ``weights``, seeded by ``(seed, epoch,
        name)``. ``stop``: ``"first_exhausted"`` ends the epoch when a drawn
        source ends; ``"all_exhausted"`` drops ended sources and renormalises;
        ``"never"`` restarts an ended source (its next pass, re-seeded). A
        sub-pipeline stage ``s`` of source ``key`` is named ``name/key/s``. A
        checkpoint resumes under changed weights."""
        plans: Any = pipelines
        if isinstance(pipelines, Mapping):
            plans = {k: Plan(p.stages) if isinstance(p, Pipeline) else p for k, p in plans.items()}
        return cls((mix_spec(plans, weights, stop, name),))

    # -- central stages ------------------------------------------------------

    def read_lines(
        self, *, encoding: str = "utf-8", errors: str = "strict", name: str | None = None
    ) -> Pipeline:
        """Paths in, lines out (``str``, without ``\\n`` or a trailing ``\\r``);
        resumes by (file, byte offset) without re-reading. ``errors`` is
        ``open()``'s: ``"strict"`` (a line that does not decode raises, naming
        file and offset), ``"replace"``, ``"ignore"``, ``"backslashreplace"``
        or ``"surrogateescape"``."""
        options = read_lines_options(encoding, errors, name or self._default_name("read_lines"))
        return self._add("read_lines", name, "central", options=options)

    def read_jsonl(
        self,
        *,
        field: str | Callable[[Any], Any] | None = None,
        errors: Literal["strict", "skip"] = "strict",
        name: str | None = None,
    ) -> Pipeline:
        """Paths in, one item per JSON line out: the record, ``record[field]``
        (a str) or ``field(record)`` (a callable). Plain, ``.gz`` and ``.zst``
        files; resumes by (file, position) without replaying. A malformed line
        raises ``ValueError`` naming file and line; ``errors="skip"`` skips
        and counts it (``skipped`` in ``Loader.query(name)``)."""
        stage = name or self._default_name("read_jsonl")
        options = read_jsonl_options(field, errors, stage)
        return self._add("read_jsonl", name, "central", options=options)

    def read_parquet(
        self,
        *,
        columns: Sequence[str] | None = None,
        batch_rows: int | None = None,
        name: str | None = None,
    ) -> Pipeline:
        """Paths in, Parquet rows out: a dict per row of the chosen ``columns``
        (all when ``None``), or with ``batch_rows`` a ``pyarrow.RecordBatch``
        of up to that many rows of one row group. Reads one row group at a
        time; resumes at (file, row group, row). Needs ``centralpipe[parquet]``."""
        stage = name or self._default_name("read_parquet")
        options = read_parquet_options(columns, batch_rows, stage)
        return self._add("read_parquet", name, "central", options=options)

    def map(
        self,
        fn: Callable[..., Any],
        /,
        *,
        parallel: bool = False,
        with_rng: bool = False,
        batched: bool = False,
        name: str | None = None,
    ) -> Pipeline:
        """``fn(item)`` for each item. After ``dispatch()`` it runs in workers.
        Before it, ``parallel=True`` runs it in the workers too, its outputs
        re-entering the central chain in order. In workers (either way)
        ``with_rng=True`` calls ``fn(item, rng)`` with a ``torch.Generator``
        seeded from ``(seed, epoch, index of the item in this stage's input)``.

        ``batched=True`` (in workers: after ``dispatch()`` or with
        ``parallel=True``) calls ``fn(items)`` once per chunk with the list of
        its items and takes the list it returns, one output per item in
        order (e.g. ``tokenizer.encode_batch``, which releases the GIL: the
        way to make ``executor="thread"`` pay). Items, outputs, state and
        checkpoints are those of the per-item map; when a call raises, each
        item is tried on its own (``fn([item])``) so only the failing ones fail."""
        options = self._item_options("map", name, parallel, with_rng, batched)
        return self._add("map", name, self._placement_for("map"), fn=fn, options=options)

    def filter(
        self, pred: Callable[[Any], bool], /, *, parallel: bool = False, name: str | None = None
    ) -> Pipeline:
        """Keep the items for which ``pred(item)`` is true (``parallel``: see ``map``)."""
        options = self._item_options("filter", name, parallel)
        return self._add("filter", name, self._placement_for("filter"), fn=pred, options=options)

    def flat_map(
        self,
        fn: Callable[[Any], Iterable[Any]],
        /,
        *,
        parallel: bool = False,
        name: str | None = None,
    ) -> Pipeline:
        """Each item becomes the items of the iterable ``fn(item)`` (``parallel``: see ``map``)."""
        options = self._item_options("flat_map", name, parallel)
        placement = self._placement_for("flat_map")
        return self._add("flat_map", name, placement, fn=fn, options=options)

    def _item_options(
        self,
        kind: str,
        name: str | None,
        parallel: Any,
        with_rng: Any = False,
        batched: Any = False,
    ) -> ItemOptions:
        return item_options(
            kind,
            name or self._default_name(kind),
            central=self._dispatch_index() is None,
            dispatch_name=self.dispatch_name,
            parallel=parallel,
            with_rng=with_rng,
            batched=batched,
        )

    def batch(
        self, batch_size: int, /, *, drop_last: bool = False, name: str | None = None
    ) -> Pipeline:
        """Lists of ``batch_size`` items (the last may be shorter unless ``drop_last``)."""
        stage = name or self._default_name("batch")
        check_int(batch_size, "batch_size", stage, 1)
        return self._add(
            "batch",
            name,
            "central",
            options=BatchOptions(batch_size=batch_size, drop_last=bool(drop_last)),
        )

    def bucket_by_max_tokens(
        self,
        max_tokens: int,
        /,
        *,
        len_fn: Callable[[Any], int] = len,
        buffer_size: int | None = 1000,
        min_len: int = 0,
        max_len: int | None = None,
        include_padding: bool = False,
        name: str | None = None,
    ) -> Pipeline:
        """Batches whose total length (or ``longest * size`` with
        ``include_padding``) is at most ``max_tokens``, made from a buffer of
        ``buffer_size`` items (``None``: the whole epoch) popped shortest first,
        as torchdata's ``MaxTokenBucketizer``. Items whose length is outside
        ``[min_len, max_len]`` are dropped; one longer than ``max_tokens`` is
        emitted alone. Equal lengths keep arrival order."""
        stage = name or self._default_name("bucket_by_max_tokens")
        options = bucket_options(
            max_tokens, len_fn, buffer_size, min_len, max_len, include_padding, stage
        )
        return self._add("bucket_by_max_tokens", name, "central", fn=len_fn, options=options)

    def pack(
        self,
        max_tokens: int,
        /,
        *,
        len_fn: Callable[[Any], int] = len,
        strategy: Literal["first_fit", "best_fit"] = "best_fit",
        buffer_size: int = 1000,
        oversize: Literal["raise", "drop"] = "raise",
        name: str | None = None,
    ) -> Pipeline:
        """Lists of items whose summed ``len_fn`` is at most ``max_tokens``,
        packed online into open groups (``"first_fit"``: the oldest group the
        item fits in; ``"best_fit"``: the one it fills most). A group leaves
        when full, or oldest first once the open groups hold more than
        ``buffer_size`` items. An item longer than ``max_tokens`` raises
        ``PipelineError`` at iteration (``oversize="raise"``) or is dropped and
        counted (``"drop"``). ``query(name)`` reports the fill rate so far."""
        stage = name or self._default_name("pack")
        options = pack_options(max_tokens, len_fn, strategy, buffer_size, oversize, stage)
        return self._add("pack", name, "central", fn=len_fn, options=options)

    def shuffle(self, buffer_size: int, /, *, name: str | None = None) -> Pipeline:
        """Buffered shuffle seeded by ``(seed, epoch)``; the buffer and the
        generator state are checkpointed."""
        stage = name or self._default_name("shuffle")
        check_int(buffer_size, "buffer_size", stage, 1)
        options = ShuffleOptions(buffer_size=buffer_size)
        return self._add("shuffle", name, "central", options=options)

    def count(
        self, name: str | None = None, *, weight_fn: Callable[[Any], float] | None = None
    ) -> Pipeline:
        """Pass items through, counting them: state ``{"items": n, "weight": w}``
        where ``w`` sums ``weight_fn(item)`` (or counts items)."""
        check_count(name, weight_fn, self._default_name("count"))
        return self._add("count", name, "central", fn=weight_fn)

    def shard(
        self, *, equalize: Literal["drop_last", "pad"] | None = None, name: str | None = None
    ) -> Pipeline:
        """Keep central index ``i`` when ``i % world_size == rank``. ``equalize``
        gives every rank the same count: ``"drop_last"`` drops the last
        incomplete round, ``"pad"`` completes it with that round's items."""
        check_equalize(equalize, name or self._default_name("shard"))
        return self._add("shard", name, "central", options=ShardOptions(equalize=equalize))

    def dispatch(self, *, name: str = "dispatch") -> Pipeline:
        """The round-robin boundary: stages after it run in worker processes."""
        if self._dispatch_index() is not None:
            msg = (
                f"stage '{name}': dispatch() was already called "
                f"('{self._specs[self._dispatch_index() or 0].name}'); a pipeline has at most one."
            )
            raise PipelineError(msg)
        return self._add("dispatch", name, "dispatch")

    # -- worker stages ---------------------------------------------------------

    def collate(
        self, fn: Callable[[Any], Any] | None = None, /, *, name: str | None = None
    ) -> Pipeline:
        """Worker stage: ``fn(item)`` (default ``torch.utils.data.default_collate``)
        on each item, typically a list made by ``batch()``."""
        check_placement(
            "collate", name or self._default_name("collate"), "worker", self.dispatch_name
        )
        if fn is None:
            from torch.utils.data import default_collate

            fn = default_collate
        return self._add("collate", name, "worker", fn=fn)

    # -- introspection -------------------------------------------------------

    @property
    def stages(self) -> tuple[StageSpec, ...]:
        """All stage specs in order."""
        return self._specs

    @property
    def central_stages(self) -> tuple[StageSpec, ...]:
        """Source and central stages (before ``dispatch()``)."""
        idx = self._dispatch_index()
        return self._specs if idx is None else self._specs[:idx]

    @property
    def worker_stages(self) -> tuple[StageSpec, ...]:
        """Stages after ``dispatch()`` (empty without one)."""
        idx = self._dispatch_index()
        return () if idx is None else self._specs[idx + 1 :]

    @property
    def dispatch_name(self) -> str | None:
        idx = self._dispatch_index()
        return None if idx is None else self._specs[idx].name

    def fingerprint(self) -> list[list[str]]:
        """``[[name, kind], ...]`` of every stage: what a checkpoint must match."""
        return [[s.name, s.kind] for s in self._all_specs()]

    def describe(self) -> str:
        return "\n".join(s.describe() for s in self._specs)

    def __repr__(self) -> str:
        return plan_repr(self._specs)

    # -- internals -------------------------------------------------------------

    def _all_specs(self) -> list[StageSpec]:
        """Every stage, with those inside ``mix`` sources after their mix."""
        return [x for s in self._specs for x in (s, *inner_specs(s))]

    def _dispatch_index(self) -> int | None:
        for i, spec in enumerate(self._specs):
            if spec.placement == "dispatch":
                return i
        return None

    def _default_name(self, kind: str) -> str:
        return f"{kind}_{len(self._specs)}"

    def _placement_for(self, kind: str) -> Placement:
        return "central" if self._dispatch_index() is None else "worker"

    def _add(
        self,
        kind: str,
        name: str | None,
        placement: Placement,
        *,
        fn: Any = None,
        options: Options | None = None,
    ) -> Pipeline:
        stage = self._default_name(kind) if name is None else name
        check_name(stage)
        check_placement(kind, stage, placement, self.dispatch_name)
        if fn is not None or kind in WORKER_KINDS:
            check_callable(fn, "the function", stage)
        taken = {s.name for s in self._all_specs()}
        if stage in taken:
            msg = f"stage name '{stage}' is already used in this pipeline; pass a unique name=."
            raise PipelineError(msg)
        if options is None:
            options = NoOptions()
        spec = StageSpec(kind, stage, placement, fn=fn, options=options)
        return Pipeline((*self._specs, spec))

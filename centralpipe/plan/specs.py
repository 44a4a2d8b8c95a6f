"""What a pipeline is made of: frozen stage specs.

A :class:`StageSpec` is kind, name, placement, function and options. The
options of a per-item kind (``map``, ``filter``, ``flat_map``, ``collate``)
are typed (:class:`~centralpipe.plan.kinds.ItemOptions`, their kind's home
is :mod:`centralpipe.plan.kinds`), and so are a central kind's
(:mod:`centralpipe.plan.options`, read by its node class in
:mod:`centralpipe.stages`). A :class:`Plan` is a
sub-pipeline as a ``mix`` spec records it. The values some options may take
are named here, for the builder's checks and the node classes alike.

The specs are also what a worker receives (pickled): this module imports
neither the builder nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import attrs

from centralpipe.plan.kinds import WORKER_KINDS, ItemOptions, WorkerKind, kind_of
from centralpipe.plan.options import CENTRAL_OPTIONS, EQUALIZE, OVERSIZE, STRATEGIES, Options

__all__ = [
    "EQUALIZE",
    "OVERSIZE",
    "STOP_MODES",
    "STRATEGIES",
    "WORKER_KINDS",
    "Placement",
    "Plan",
    "StageSpec",
    "WorkerKind",
    "plan_repr",
]

_O = TypeVar("_O", bound=Options)

Placement = Literal["source", "central", "dispatch", "worker"]
#: ``mix(stop=...)``.
STOP_MODES = ("first_exhausted", "all_exhausted", "never")


@attrs.frozen(eq=False)
class StageSpec:
    """One stage of the plan: what it is, where it runs, and its arguments.

    ``options`` given as a mapping become the kind's typed options
    (``PipelineError`` for one the kind does not take, or a required one
    left out); a kind with no options class (none of the library's) keeps
    the mapping as given."""

    kind: str
    name: str
    placement: Placement
    fn: Any = None
    options: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        worker = WORKER_KINDS.get(self.kind)
        cls: type[Options] | None = CENTRAL_OPTIONS.get(self.kind)
        if worker is not None:
            cls = worker.options
        if cls is not None and not isinstance(self.options, cls):
            object.__setattr__(self, "options", cls.from_mapping(self.options, self.name))

    @property
    def parallel(self) -> bool:
        """A central stage run in the workers (``parallel=True``)."""
        return isinstance(self.options, ItemOptions) and self.options.parallel

    def options_as(self, cls: type[_O]) -> _O:
        """The typed options of this stage, which are a ``cls`` (``TypeError``
        naming the stage when they are not: a node class given another kind's spec)."""
        if not isinstance(self.options, cls):
            msg = (
                f"stage '{self.name}' ({self.kind}) has options of type "
                f"{type(self.options).__name__}, not {cls.__name__}."
            )
            raise TypeError(msg)
        return self.options

    @property
    def item_options(self) -> ItemOptions:
        """The typed options of a per-item stage (``TypeError`` for another kind)."""
        if not isinstance(self.options, ItemOptions):
            msg = f"stage '{self.name}' ({self.kind}) is not a per-item stage: no item options."
            raise TypeError(msg)
        return self.options

    @property
    def item_kind(self) -> WorkerKind:
        """The per-item kind of this stage (a batched map's is ``BATCHED_MAP``)."""
        return kind_of(self.kind, self.item_options)

    def describe(self) -> str:
        fn = ""
        if self.fn is not None:
            fn = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k != "source")
        args = ", ".join(a for a in (fn, opts) if a)
        return f"{self.name}: {self.kind}({args}) [{self.placement}]"


def plan_repr(specs: Sequence[StageSpec]) -> str:
    """``Pipeline(kind:name -> ...)``: how a pipeline, or a plan, prints."""
    inner = " -> ".join(f"{s.kind}:{s.name}" for s in specs)
    return f"Pipeline({inner})"


@attrs.frozen(eq=False, repr=False)
class Plan:
    """The stages of a sub-pipeline, as a ``mix`` spec records it (a source first)."""

    stages: tuple[StageSpec, ...]

    def __repr__(self) -> str:
        return plan_repr(self.stages)

"""The per-item stage kinds, one home each: ``map``, ``filter``, ``flat_map``
and ``collate`` (and the batched form of ``map``).

A :class:`WorkerKind` says everything about one kind that does not depend on
where it runs: its typed options (an :class:`ItemOptions` class, what the
spec carries), how many outputs one input makes (its length rule, for
``len(loader)`` and for the checkpoint's bounds) and how it applies to the
values of one input in the worker chain. Whoever needs a rule of the kind
looks it up here: the builder (the options it accepts), the central nodes
(``stages.transform`` inline, ``stages.parallel`` on the workers) and the
worker chain (``dispatch.worker.chain``). Central stage kinds have their home
in their node class (:mod:`centralpipe.stages`), their typed options in
:mod:`centralpipe.plan.options`.

Runs in worker processes too: imports neither torch nor the builder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import attrs

from centralpipe.errors import PipelineError
from centralpipe.plan.options import Options

__all__ = [
    "BATCHED_MAP",
    "COLLATE",
    "FILTER",
    "FLAT_MAP",
    "MAP",
    "WORKER_KINDS",
    "CollateOptions",
    "ItemOptions",
    "MapOptions",
    "Outputs",
    "StageOptions",
    "Total",
    "WorkerKind",
]

#: How many outputs one input makes.
Outputs = Literal["one", "at_most_one", "any"]
#: ``apply(fn, values, rng)``: the outputs of a stage over the values one
#: input has become so far (``rng``: the input's generator, or ``None``).
Apply = Callable[[Callable[..., Any], list[Any], Any], list[Any]]


@attrs.frozen
class Total:
    """Items per epoch: exactly ``items``, or at most ``items`` when not ``exact``.

    ``bound_by`` names the first stage that made the count an upper bound
    (``None`` when exact)."""

    items: int
    exact: bool = True
    bound_by: str | None = None

    def at_most(self, stage: str) -> Total:
        """This total as an upper bound, made one by ``stage`` (if not already)."""
        return Total(self.items, False, self.bound_by if not self.exact else stage)


def _flag(_inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        msg = f"`{attribute.name}` must be a bool, got {value!r}."
        raise PipelineError(msg)


@attrs.frozen(kw_only=True, eq=False)
class ItemOptions(Options):
    """The typed options of a per-item stage (an :class:`Options`, read as
    attributes and as the mapping the builder records): a subclass per kind
    says which it takes (``TAKES``); setting another is a ``PipelineError``.
    """

    TAKES: ClassVar[tuple[str, ...]] = ("with_rng", "parallel", "batched")

    #: ``fn(item, rng)`` with a ``torch.Generator`` seeded per item.
    with_rng: bool = attrs.field(default=False, validator=_flag)
    #: A central stage whose function runs in the workers.
    parallel: bool = attrs.field(default=False, validator=_flag)
    #: ``fn(list of items) -> list``, once per chunk.
    batched: bool = attrs.field(default=False, validator=_flag)


@attrs.frozen(kw_only=True, eq=False)
class MapOptions(ItemOptions):
    """``map``: ``with_rng`` (always listed), ``parallel``, ``batched``."""

    SHOWN = ("with_rng",)


@attrs.frozen(kw_only=True, eq=False)
class StageOptions(ItemOptions):
    """``filter`` and ``flat_map``: ``parallel`` only."""

    TAKES = ("parallel",)


@attrs.frozen(kw_only=True, eq=False)
class CollateOptions(ItemOptions):
    """``collate``: no options."""

    TAKES = ()


def _apply_map(fn: Callable[..., Any], values: list[Any], rng: Any) -> list[Any]:
    if rng is not None:
        return [fn(v, rng) for v in values]
    return [fn(v) for v in values]


def _apply_filter(fn: Callable[..., Any], values: list[Any], rng: Any) -> list[Any]:
    return [v for v in values if fn(v)]


def _apply_flat_map(fn: Callable[..., Any], values: list[Any], rng: Any) -> list[Any]:
    return [out for v in values for out in fn(v)]


def _apply_batched(fn: Callable[..., Any], values: list[Any], rng: Any) -> list[Any]:
    """``fn(values)`` as a list of one output per value, else ``TypeError``
    or ``ValueError`` saying what was wrong."""
    outs = fn(values)
    try:
        outs = list(outs)
    except TypeError:
        msg = f"a batched map must return a list (one output per item), got {type(outs).__name__}"
        raise TypeError(msg) from None
    if len(outs) != len(values):
        msg = (
            f"a batched map must return one output per item: {len(values)} item(s) in, "
            f"{len(outs)} output(s) out"
        )
        raise ValueError(msg)
    return outs


@attrs.frozen
class WorkerKind:
    """A stage kind that runs per item, in the workers or inline; see the
    module docstring."""

    #: The spec's kind string.
    name: str
    #: How many outputs one input makes: its length rule.
    outputs: Outputs
    #: The class of its typed options.
    options: type[ItemOptions]
    #: How it applies to one input's values in the worker chain.
    apply: Apply
    #: Called once per chunk with the values of every live input (``apply``
    #: then takes and returns all of them).
    batched: bool = False

    def out_total(self, total: Total, stage: str) -> Total | None:
        """Items out of ``total`` items in (``None``: unknown)."""
        if self.outputs == "one":
            return total
        return total.at_most(stage) if self.outputs == "at_most_one" else None

    def max_items_out(self, bound_in: int | None) -> int | None:
        """An upper bound on the outputs of ``bound_in`` inputs (``None``: unknown)."""
        return None if self.outputs == "any" else bound_in


MAP = WorkerKind("map", "one", MapOptions, _apply_map)
#: ``map(fn, batched=True)``: the spec's kind is ``map``; see :func:`kind_of`.
BATCHED_MAP = WorkerKind("map", "one", MapOptions, _apply_batched, batched=True)
COLLATE = WorkerKind("collate", "one", CollateOptions, _apply_map)
FILTER = WorkerKind("filter", "at_most_one", StageOptions, _apply_filter)
FLAT_MAP = WorkerKind("flat_map", "any", StageOptions, _apply_flat_map)

#: The kinds a worker stage can have, by the spec's kind string.
WORKER_KINDS: Mapping[str, WorkerKind] = {k.name: k for k in (MAP, COLLATE, FILTER, FLAT_MAP)}


def kind_of(kind: str, options: ItemOptions) -> WorkerKind:
    """The per-item kind of a spec of ``kind`` with ``options`` (a batched map
    applies as :data:`BATCHED_MAP`)."""
    return BATCHED_MAP if kind == MAP.name and options.batched else WORKER_KINDS[kind]

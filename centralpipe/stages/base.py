"""The base of every central stage: a ``torchdata.nodes.BaseNode`` with a name.

A central stage owns a ``source`` node. Its state, as torchdata expects, is its
own fields plus ``{SOURCE_KEY: source.state_dict()}``; ``own_state()`` is the
part without the source, which the Loader stores per stage name and which
``query()`` reads (under the chain lock, unless the stage publishes a
:meth:`~CentralNode.live_view`). Subclasses write ``produce()`` (the next item, or
``StopIteration``), ``own_state()`` and ``restore(state | None)``, and declare
``State``, the attrs class of their state, which the checkpoint model checks
(with ``check_state()`` for what depends on the pipeline, e.g. file sizes).

Interrupts. A ``KeyboardInterrupt`` (Ctrl-C, when the chain runs in the
caller's thread) can land inside any call a stage makes: a nested ``next()``
of its source, or the user's function. No stage keeps an input it pulled in a
local variable across such a call: what it pulled and has not passed on yet is
in its own state (``held``: the inputs of the interrupted call, or the stage's
own buffers), so the next ``next()`` carries on with it and ``state_dict()``
taken at that moment records it. Only ``Exception`` is a stage's failure (the
input it raised on is dropped and the pass goes on after it); any other
exception leaves the input held.

CPython (3.11) handles a pending signal as a Python function starts, on a
loop's backward jump, and right after a call into C returns, never as a
Python function returns nor inside a list operation. So a stage never takes
an input with ``x = next(source)`` or ``held.pop()`` (a Ctrl-C landing as
the builtin returns loses the item the source has already counted): it takes
one with :func:`pull_one` into ``held`` and removes it with ``held[-1]`` and
``del held[-1]``, so an input is always either in the source or held.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import attrs
from torchdata.nodes import BaseNode

from centralpipe.checkpoint import compact
from centralpipe.errors import CheckpointError
from centralpipe.plan.kinds import Total
from centralpipe.validators import FieldError, checked, sequence_of

if TYPE_CHECKING:
    from centralpipe.plan.specs import StageSpec

__all__ = [
    "HELD",
    "HELD_KEY",
    "NODE_CLASSES",
    "SOURCE_KEY",
    "CentralNode",
    "HeldState",
    "NoState",
    "RunContext",
    "Total",
    "add_stage_note",
    "build_central",
    "held_items",
    "pull_one",
]

SOURCE_KEY = "source"
#: The inputs an interrupted call had pulled and not passed on (present only then).
HELD_KEY = "held"
T = TypeVar("T")


def pull_one(source: BaseNode[Any], out: list[Any]) -> None:
    """Append ``source``'s next item to ``out``, or raise ``StopIteration``.

    What ``out.append(next(source))`` means, without its window: there a
    Ctrl-C handled as the builtin ``next()`` returns drops an item the source
    has already handed out. Here the item moves only inside the list's own
    ``append`` and Python-level returns, so once the source has handed it out
    it is in ``out`` whatever is raised after."""
    if isinstance(source, CentralNode):
        source.pull_into(out, 1)
    else:
        out.append(source.__next__())


@attrs.define
class RunContext:
    """What central stages read at ``reset()``: seed, epoch and rank."""

    seed: int = 0
    epoch: int = 0
    rank: int = 0
    world_size: int = 1


@attrs.frozen
class NoState:
    """The state of a stage that keeps none: ``{}``."""


#: The validator of a state class's ``held`` field (optional: ``factory=list``).
HELD = checked(FieldError, "a list (the inputs of an interrupted call)", sequence_of())


def held_items(value: Any) -> Any:
    """The converter of a state class's ``held`` field: held 1-D arrays are
    saved compact (:mod:`centralpipe.checkpoint.compact`); read back as a list."""
    return compact.decoded_items(HELD_KEY, value)


@attrs.frozen(kw_only=True)
class HeldState:
    """The state of a stage that keeps nothing between calls, except after an
    interrupt: ``{}``, or ``{"held": [inputs]}``."""

    held: list[Any] = attrs.field(factory=list, converter=held_items, validator=HELD)


def add_stage_note(exc: BaseException, stage: str) -> None:
    """Name the central stage an exception came from (once, innermost wins)."""
    if getattr(exc, "_centralpipe_stage", None) is None:
        try:
            exc._centralpipe_stage = stage  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - exceptions with __slots__
            return
        exc.add_note(f"(raised in central stage '{stage}')")


class CentralNode(BaseNode[T], Generic[T]):
    """A named central stage; see the module docstring.

    A subclass is the one home of its stage kind: ``kind`` (the spec's kind
    string), :meth:`from_spec` (the node of a spec), ``State`` and
    :meth:`check_state` (its checkpoint schema), :meth:`out_total` (its length
    rule) and ``stamped`` (whether dispatched items carry its totals). A
    class that declares ``kind`` is registered in :data:`NODE_CLASSES` as it
    is defined; a second class for one kind is an error. (The per-item
    kinds' rules are in :mod:`centralpipe.plan.kinds`, which their node
    classes look up.)"""

    kind: str = "node"
    #: ``count`` and ``shard`` stages: each dispatched item is stamped with
    #: their totals so ``query(delivered=True)`` is exact (see ``stamp()``).
    stamped: ClassVar[bool] = False
    #: The attrs class of ``own_state()``: the checkpoint model checks a stage's
    #: state against it before ``restore`` sees it. ``None``: any dict.
    State: ClassVar[type | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if isinstance(kind, str):
            other = NODE_CLASSES.setdefault(kind, cls)
            if other is not cls:
                both = f"{other.__qualname__} and {cls.__qualname__}"
                msg = f"stage kind {kind!r} has two node classes: {both}."
                raise TypeError(msg)

    def __init__(self, source: BaseNode[Any] | None, *, name: str, ctx: RunContext) -> None:
        super().__init__()
        self.source = source
        self.name = name
        self.ctx = ctx
        self.items_out = 0
        #: Nanoseconds spent in this stage's calls, its source's calls
        #: (made from inside them) included; see :meth:`own_time_s`.
        self.busy_ns = 0
        #: Inputs pulled from ``source`` by a call that was interrupted before
        #: it passed them on (see the module docstring); the next call takes
        #: them first. In the state under ``HELD_KEY`` when not empty.
        self.held: list[Any] = []

    @classmethod
    @abc.abstractmethod
    def from_spec(
        cls, spec: StageSpec, source: CentralNode[Any] | None, ctx: RunContext
    ) -> CentralNode[Any]:
        """The node of ``spec`` reading from ``source`` (``None`` for a source)."""

    def prepare(self) -> None:
        """Resolve what the stage needs once, when the Loader is built (a glob)."""

    def out_total(self, total: Total) -> Total | None:
        """Items this stage yields per epoch from ``total`` input items
        (``None``: only iterating would tell)."""
        return None

    # -- torchdata.nodes protocol ---------------------------------------------

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if self.source is not None:
            self.source.reset(None if initial_state is None else initial_state[SOURCE_KEY])
        self.restore(initial_state)

    def get_state(self) -> dict[str, Any]:
        state = self.own_state()
        if self.source is not None:
            state[SOURCE_KEY] = self.source.state_dict()
        return state

    def next(self) -> T:
        # For callers outside the package (torchdata's, a user's): a Ctrl-C
        # handled at the timing call after produce() drops the item made.
        # The package's own pulls go through pull_into() (see pull_one).
        # Every call is timed: a sample of calls cannot be split into the
        # stage's own time and its source's (a bucket's sampled call may be
        # the one that reads 50,000 inputs), so sampled own times added up
        # to more than the epoch.
        start = perf_counter_ns()
        try:
            item = self.produce()
        except StopIteration:
            raise
        except Exception as exc:
            add_stage_note(exc, self.name)
            raise
        finally:
            self.busy_ns += perf_counter_ns() - start
        self.items_out += 1
        return item

    def pull_into(self, out: list[T], n: int) -> None:
        """Append up to ``n`` (>= 1) next items to ``out``: the bulk form of
        :meth:`next` for whoever pulls many items at once (the chunks of a
        boundary). Returns after appending at least one item, or raises
        ``StopIteration`` at the end of the epoch (possibly after appending
        the last ones). Items appended stay appended whatever is raised after
        them, and the stage's position is just after them, so pulling in
        bulk loses nothing and checkpoints stay exact."""
        before = len(out)
        start = perf_counter_ns()
        try:
            self.produce_into(out, n)
        except StopIteration:
            raise
        except Exception as exc:
            add_stage_note(exc, self.name)
            raise
        finally:
            self.items_out += len(out) - before
            self.busy_ns += perf_counter_ns() - start

    # -- flat state, keyed by stage name (what the Loader checkpoints) --------

    def chain(self) -> list[CentralNode[Any]]:
        """The central nodes from the source up to this one."""
        below = self.source.chain() if isinstance(self.source, CentralNode) else []
        return [*below, self]

    def load_flat(self, flat: dict[str, Any] | None) -> None:
        """Reset the chain up to here: each stage from ``flat[name]`` (or to the
        start of an epoch when ``flat`` is ``None``)."""
        if isinstance(self.source, CentralNode):
            self.source.load_flat(flat)
        elif self.source is not None:
            self.source.reset(None)
        BaseNode.reset(self, None)
        if flat is None:
            self.restore(None)
            return
        try:
            self.restore(flat[self.name])
        except CheckpointError:
            raise
        except Exception as exc:
            msg = (
                f"damaged checkpoint: the state of stage '{self.name}' cannot be restored: "
                f"{type(exc).__name__}: {exc}"
            )
            raise CheckpointError(msg) from exc

    # -- for subclasses ------------------------------------------------------

    @abc.abstractmethod
    def produce(self) -> T:
        """The next item, or ``StopIteration`` at the end of the epoch."""

    def produce_into(self, out: list[T], n: int) -> None:
        """Append up to ``n`` items as :meth:`pull_into` says. By default one
        :meth:`produce` at a time (without :meth:`next`'s per-item
        bookkeeping); a stage that can hand out items in bulk overrides it."""
        append, produce = out.append, self.produce
        for _ in range(n):
            append(produce())

    def own_state(self) -> dict[str, Any]:
        """This stage's state without its source's (a fresh dict)."""
        return {}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Start of an epoch (``None``) or the position in ``state`` (a wire
        dict that already passed ``State`` and :meth:`check_state`)."""

    def check_state(self, state: Any, states: Mapping[str, Any]) -> None:
        """Raise ``FieldError`` if ``state`` (a ``State`` instance) cannot be
        this stage's position in this pipeline; ``states`` has every stage's.
        Must not change anything: a refused checkpoint leaves the loader as it was."""

    # -- held inputs (see the module docstring) --------------------------------

    def with_held(self, state: dict[str, Any], start: int = 0) -> dict[str, Any]:
        """``state`` with the held inputs from index ``start`` on, if any (for
        ``own_state()``; 1-D arrays saved compact)."""
        if len(self.held) > start:
            state[HELD_KEY] = compact.encode_items(self.held[start:])
        return state

    def restore_held(self, state: dict[str, Any] | None) -> None:
        """The held inputs of ``state`` (none at the start of an epoch)."""
        self.held = [] if state is None else compact.decode_items(state.get(HELD_KEY, []))

    def check_held(self, held: list[Any], most: int) -> None:
        """``FieldError`` unless ``held`` could be this stage's: at most ``most`` inputs."""
        if len(held) > most:
            expected = f"at most {most} input(s) (what one interrupted call of a {self.kind} pulls)"
            raise FieldError(HELD_KEY, expected, held)

    def max_items_out(self, state: Any, bound_in: int | None) -> int | None:
        """An upper bound on the items this stage has yielded this epoch, from
        its checked ``state`` and the bound of its source (``None``: unknown);
        a checkpoint's seq counter cannot pass it."""
        return None

    def query_state(self) -> dict[str, Any]:
        """What ``Loader.query(name)`` returns: ``own_state()`` unless a stage
        holds a large buffer, in which case a summary."""
        return self.own_state()

    def live_view(self) -> dict[str, Any] | None:
        """What ``Loader.query(name)`` returns without the chain lock: a fresh
        dict of an immutable snapshot the stage publishes with one attribute
        store each time it changes (``count``: its ``(items, weight)``), so a
        reader in any thread sees one moment of it and never waits for the
        ``next()`` in progress. ``None`` (the default): the stage publishes
        none, and its query takes the chain lock (:meth:`query_state`)."""
        return None

    def release(self) -> None:
        """Close what the stage holds open (files); the next ``reset`` reopens."""
        if isinstance(self.source, CentralNode):
            self.source.release()

    def source_busy_ns(self) -> int:
        """Nanoseconds spent in the calls this stage made to its source."""
        return self.source.busy_ns if isinstance(self.source, CentralNode) else 0

    def own_time_s(self) -> float:
        """Seconds spent in this stage's calls, less the time in its source's:
        exact (every call is timed), so the stages' own times of one chain
        partition the time spent in it and add up to no more than it."""
        return max(0, self.busy_ns - self.source_busy_ns()) / 1e9

    def source_items(self) -> int | None:
        return self.source.items_out if isinstance(self.source, CentralNode) else None


#: The node class of each central stage kind, registered as it is defined
#: (``centralpipe.stages`` imports every stage module): the one home of the
#: kind (how a spec becomes a node, its state schema, its length rule).
NODE_CLASSES: dict[str, type[CentralNode[Any]]] = {}


def build_central(specs: Sequence[StageSpec], ctx: RunContext) -> list[CentralNode[Any]]:
    """Nodes for the source and central stages, in order (last = the tip);
    each made by its kind's node class."""
    nodes: list[CentralNode[Any]] = []
    for spec in specs:
        cls = NODE_CLASSES.get(spec.kind)
        if cls is None:  # pragma: no cover - the builder makes only known kinds
            raise AssertionError(f"no node class for central stage kind {spec.kind!r}")
        nodes.append(cls.from_spec(spec, nodes[-1] if nodes else None, ctx))
    return nodes

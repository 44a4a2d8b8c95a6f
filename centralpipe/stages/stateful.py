"""A re-iterable that keeps its own position: checkpointed through its
``state_dict()`` / ``load_state_dict()``, never by replaying.

``Pipeline.from_iterable(obj)`` picks this source when ``obj`` is not a
sequence and has both methods — a Hugging Face ``datasets.IterableDataset``
(streaming or not), or any iterable written that way. Its ``state_dict()``
must describe the position after the items it has yielded, and
``load_state_dict(s)`` followed by ``iter(obj)`` must go on from there (what
``datasets`` documents). The state is ``{"index": items yielded this epoch,
"state": obj.state_dict()}``; each epoch starts from the state ``obj`` had
when ``from_iterable`` was called.

A ``datasets.IterableDataset`` that cannot resume exactly by its own account
— one with a shuffle buffer (``.shuffle(buffer_size=...)``: the buffer is lost
on resume), or arrow formatting with a batched ``.map()`` (may skip a batch) —
is refused with a ``PipelineError`` saying what to do instead.

An object is read by one live Loader at a time (its position is its own).
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v

from centralpipe.errors import PipelineError
from centralpipe.plan.options import StatefulIterableOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import CentralNode, RunContext
from centralpipe.validators import FieldError, checked, int_in

__all__ = ["StatefulIterableSource", "StatefulState", "is_stateful", "why_not_exact"]


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` offers ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def why_not_exact(obj: Any) -> str | None:
    """Why a ``datasets.IterableDataset`` cannot resume exactly (``None``: it can)."""
    it = getattr(obj, "_ex_iterable", None)
    formatting = getattr(obj, "_formatting", None)
    arrow = getattr(formatting, "format_type", None) == "arrow"
    seen = 0
    while it is not None and seen < 1000:
        kind = type(it).__name__
        if kind == "BufferShuffledExamplesIterable":
            return (
                "it has a shuffle buffer (.shuffle(buffer_size=...)), whose items are lost "
                "on resume; shuffle with Pipeline.shuffle(buffer_size) after this source "
                "instead (its buffer is checkpointed), or use .shuffle() of a map-style "
                "datasets.Dataset with from_dataset"
            )
        if kind == "MappedExamplesIterable" and arrow and getattr(it, "batched", False):
            return (
                "it combines arrow formatting with a batched .map(), which may skip a batch "
                "on resume; drop .with_format('arrow') or map per example"
            )
        it = getattr(it, "ex_iterable", None)
        seen += 1
    return None


@attrs.frozen(kw_only=True)
class StatefulState:
    index: int = attrs.field(validator=checked(FieldError, "an int >= 0", int_in(0, 2**63)))
    state: dict[str, Any] = attrs.field(
        validator=checked(FieldError, "the object's state_dict (a dict)", v.instance_of(Mapping))
    )


class StatefulIterableSource(CentralNode[Any]):
    kind = "stateful_iterable"
    State = StatefulState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> StatefulIterableSource:
        o = spec.options_as(StatefulIterableOptions)
        return cls(o.source, start=o.start, name=spec.name, ctx=ctx)

    def __init__(self, obj: Any, *, start: dict[str, Any], name: str, ctx: RunContext) -> None:
        super().__init__(None, name=name, ctx=ctx)
        why = why_not_exact(obj)
        if why is not None:
            msg = f"stage '{name}': this {type(obj).__name__} cannot resume exactly: {why}."
            raise PipelineError(msg)
        owner = getattr(obj, "_centralpipe_owner", None)
        if owner is not None and owner() is not None:
            msg = (
                f"stage '{name}': this {type(obj).__name__} is already read by another live "
                "Loader, and its position is its own; close the other Loader, or give each "
                "Loader its own object."
            )
            raise PipelineError(msg)
        obj._centralpipe_owner = weakref.ref(ctx)
        self._obj = obj
        self._start = start
        self._index = 0
        self._it: Any = None
        #: The state loaded at the last restore, until an item is yielded after
        #: it (``obj.state_dict()`` tells the last iteration's until then).
        self._loaded: dict[str, Any] | None = self._start

    def produce(self) -> Any:
        if self._it is None:
            self._it = iter(self._obj)
        try:
            item = next(self._it)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # interrupted: the iterator is over
                self._load(self._position())
            raise
        self._loaded = None
        self._index += 1
        return item

    def produce_into(self, out: list[Any], n: int) -> None:
        # The iterator sliced in one C-level extend; only the items handed out
        # count, whatever is raised (an item that raised was not).
        if self._it is None:
            self._it = iter(self._obj)
        before = len(out)
        interrupted = False
        try:
            out.extend(itertools.islice(self._it, n))
        except BaseException as exc:
            interrupted = not isinstance(exc, Exception)
            raise
        finally:
            got = len(out) - before
            self._index += got
            if got:
                self._loaded = None
            if interrupted:  # the iterator is over: go on from the items handed out
                self._load(self._position())
        if not got:
            raise StopIteration

    def _position(self) -> dict[str, Any]:
        if self._loaded is not None:
            return copy.deepcopy(self._loaded)
        return dict(self._obj.state_dict())

    def _load(self, state: dict[str, Any]) -> None:
        self._it = None
        self._obj.load_state_dict(copy.deepcopy(state))
        self._loaded = state

    def own_state(self) -> dict[str, Any]:
        return {"index": self._index, "state": self._position()}

    def max_items_out(self, state: StatefulState, bound_in: int | None) -> int | None:
        return state.index

    def restore(self, state: dict[str, Any] | None) -> None:
        self._index = 0 if state is None else state["index"]
        self._load(copy.deepcopy(self._start if state is None else dict(state["state"])))

    def release(self) -> None:
        owner = getattr(self._obj, "_centralpipe_owner", None)
        if owner is not None and owner() is self.ctx:
            self._obj._centralpipe_owner = None
        self._it = None
        super().release()

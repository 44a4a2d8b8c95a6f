"""Source stages: iterables, map-style datasets, torchdata nodes and file lists.

Each resumes without replay where it can: sequences, datasets and file lists by
index. A re-iterable without indexing (a zero-argument factory, or an object
whose ``iter()`` is fresh each time) resumes by skipping forward over the items
already yielded — which re-reads them, so prefer a sequence for large sources.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import itertools
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.errors import CheckpointError, PipelineError
from centralpipe.pipeline import StageSpec
from centralpipe.stages.base import CentralNode, RunContext
from centralpipe.validators import FieldError, checked, int_in

__all__ = [
    "DatasetSource",
    "FilesSource",
    "FilesState",
    "IndexState",
    "IterableSource",
    "NodeSource",
    "NodeState",
]

INDEX_KEY = "index"
FILES_KEY = "files"
NODE_KEY = "node"


_INDEX = checked(FieldError, "an int >= 0", int_in(0, 2**63))


@attrs.frozen(kw_only=True)
class IndexState:
    index: int = attrs.field(validator=_INDEX)


@attrs.frozen(kw_only=True)
class NodeState:
    node: dict[str, Any] = attrs.field(
        validator=checked(FieldError, "the node's state_dict (a dict)", v.instance_of(Mapping))
    )


@attrs.frozen(kw_only=True)
class FilesState:
    index: int = attrs.field(validator=_INDEX)
    files: str = attrs.field(validator=checked(FieldError, "a str", v.instance_of(str)))


class IterableSource(CentralNode[Any]):
    """Items of a sequence (by index) or of a re-iterable (by skipping forward)."""

    kind = "iterable"
    State = IndexState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> IterableSource:
        o = spec.options
        return cls(o["source"], o["mode"], name=spec.name, ctx=ctx)

    def __init__(self, iterable: Any, mode: str, *, name: str, ctx: RunContext) -> None:
        super().__init__(None, name=name, ctx=ctx)
        self._iterable = iterable
        self._mode = mode
        self._index = 0
        self._it: Iterator[Any] | None = None

    def produce(self) -> Any:
        if self._mode == "sequence":
            if self._index >= len(self._iterable):
                raise StopIteration
            item = self._iterable[self._index]
        else:
            assert self._it is not None  # set by restore()
            item = next(self._it)
        self._index += 1
        return item

    def own_state(self) -> dict[str, Any]:
        return {INDEX_KEY: self._index}

    def max_items_out(self, state: IndexState, bound_in: int | None) -> int | None:
        return state.index

    def check_state(self, state: IndexState, states: Mapping[str, Any]) -> None:
        n = self.length()
        if n is not None and state.index > n:
            raise FieldError("index", f"<= {n} (the length of the source)", state.index)

    def restore(self, state: dict[str, Any] | None) -> None:
        self._index = 0 if state is None else state[INDEX_KEY]
        if self._mode != "sequence":
            self._it = iter(self._iterable() if self._mode == "factory" else self._iterable)
            if self._index:
                # One-shot sources cannot seek: skip what was already yielded.
                skipped = sum(1 for _ in itertools.islice(self._it, self._index))
                if skipped < self._index:
                    msg = (
                        f"stage '{self.name}': checkpoint is at item {self._index} but the "
                        f"iterable now has only {skipped} items."
                    )
                    raise CheckpointError(msg)

    def length(self) -> int | None:
        return len(self._iterable) if self._mode == "sequence" else None


class DatasetSource(IterableSource):
    """``dataset[i]`` in index order (a map-style dataset is a sequence)."""

    kind = "dataset"

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> DatasetSource:
        return cls(spec.options["source"], name=spec.name, ctx=ctx)

    def __init__(self, dataset: Any, *, name: str, ctx: RunContext) -> None:
        super().__init__(dataset, "sequence", name=name, ctx=ctx)

    def length(self) -> int:
        return len(self._iterable)


class NodeSource(CentralNode[Any]):
    """A user's ``BaseNode``: its own ``state_dict()`` is the state."""

    kind = "node"
    State = NodeState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> NodeSource:
        return cls(spec.options["source"], name=spec.name, ctx=ctx)

    def __init__(self, node: BaseNode[Any], *, name: str, ctx: RunContext) -> None:
        super().__init__(None, name=name, ctx=ctx)
        # A torchdata node is an iterator: two live Loaders sharing one would
        # each see part of its items.
        owner = getattr(node, "_centralpipe_owner", None)
        if owner is not None and owner() is not None:
            msg = (
                f"stage '{name}': this node is already read by another live Loader; "
                "build each Loader's pipeline with its own node (or close the other Loader)."
            )
            raise PipelineError(msg)
        node._centralpipe_owner = weakref.ref(ctx)
        self._node = node

    def produce(self) -> Any:
        return next(self._node)

    def own_state(self) -> dict[str, Any]:
        return {NODE_KEY: self._node.state_dict()}

    def restore(self, state: dict[str, Any] | None) -> None:
        self._node.reset(None if state is None else state[NODE_KEY])

    def release(self) -> None:
        owner = getattr(self._node, "_centralpipe_owner", None)
        if owner is not None and owner() is self.ctx:
            self._node._centralpipe_owner = None
        super().release()


class FilesSource(CentralNode[str]):
    """Paths from a glob (sorted) or a list (in order), resolved once by
    :meth:`prepare` when the Loader starts."""

    kind = "files"
    State = FilesState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> FilesSource:
        o = spec.options
        return cls(glob=o.get("glob"), paths=o.get("paths"), name=spec.name, ctx=ctx)

    def __init__(
        self,
        *,
        glob: str | None = None,
        paths: tuple[str, ...] | None = None,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(None, name=name, ctx=ctx)
        self._glob = glob
        self._paths: tuple[str, ...] | None = paths
        self._digest = _digest(paths) if paths is not None else ""
        self._index = 0

    def prepare(self) -> None:
        """Resolve the glob; one matching nothing is a ``PipelineError``."""
        if self._paths is not None:
            return
        assert self._glob is not None
        matches = tuple(sorted(globlib.glob(self._glob, recursive=True)))
        if not matches:
            msg = (
                f"stage '{self.name}': the glob {self._glob!r} matches no file; "
                "check the path and the working directory."
            )
            raise PipelineError(msg)
        self._paths = matches
        self._digest = _digest(matches)

    @property
    def paths(self) -> tuple[str, ...]:
        self.prepare()
        assert self._paths is not None
        return self._paths

    def produce(self) -> str:
        paths = self.paths
        if self._index >= len(paths):
            raise StopIteration
        path = paths[self._index]
        self._index += 1
        return path

    def own_state(self) -> dict[str, Any]:
        return {INDEX_KEY: self._index, FILES_KEY: self._digest}

    def max_items_out(self, state: FilesState, bound_in: int | None) -> int | None:
        return state.index

    def check_state(self, state: FilesState, states: Mapping[str, Any]) -> None:
        self.prepare()
        if state.files != self._digest:
            msg = (
                f"stage '{self.name}': the file list changed since the checkpoint "
                f"(checkpoint digest {state.files!r}, now {self._digest!r} for "
                f"{len(self.paths)} files); resuming would read the wrong files."
            )
            raise CheckpointError(msg)
        if state.index > len(self.paths):
            raise FieldError("index", f"<= {len(self.paths)} (the number of files)", state.index)

    def restore(self, state: dict[str, Any] | None) -> None:
        self.prepare()
        self._index = 0 if state is None else state[INDEX_KEY]

    def length(self) -> int:
        return len(self.paths)


def _digest(paths: tuple[str, ...]) -> str:
    return hashlib.sha1("\0".join(paths).encode("utf-8", "surrogateescape")).hexdigest()[:16]

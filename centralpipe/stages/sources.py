"""Source stages: iterables, map-style datasets, torchdata nodes and file lists.

Each resumes without replay where it can: sequences, datasets and file lists by
index. A re-iterable without indexing (a zero-argument factory, or an object
whose ``iter()`` is fresh each time) resumes by skipping forward over the items
already yielded — which re-reads them, so prefer a sequence for large sources.
An iterable that keeps its own position (``state_dict()``/``load_state_dict()``,
a ``datasets.IterableDataset``) is :mod:`centralpipe.stages.stateful`'s. File
lists may be fsspec URLs (:mod:`centralpipe.stages.fs`).

An interrupt (Ctrl-C) inside a source's own code (a dataset's ``__getitem__``,
an iterator's ``__next__``) hands out nothing and does not move the index. An
iterator it went through is finished by it (a generator cannot go on after
an exception), so the next ``next()`` opens the re-iterable again and skips
forward to the index, as a resume does.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import itertools
import os
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.errors import CheckpointError, PipelineError
from centralpipe.plan.options import DatasetOptions, FilesOptions, IterableOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import CentralNode, RunContext
from centralpipe.stages.fs import file_size, glob_url, is_url
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
LISTING_KEY = "listing"
#: Checkpoints list the files (names and sizes) up to this many, to say what changed.
LISTING_MAX = 10_000
_GLOB_MAGIC = frozenset("*?[")
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
    #: Digest of the file list: names relative to the root, and sizes.
    files: str = attrs.field(validator=checked(FieldError, "a str", v.instance_of(str)))
    #: ``"name\tsize\n"`` per file (up to ``LISTING_MAX`` files), to say what changed.
    listing: str | None = attrs.field(
        default=None, validator=checked(FieldError, "None or a str", v.optional(v.instance_of(str)))
    )


class IterableSource(CentralNode[Any]):
    """Items of a sequence (by index) or of a re-iterable (by skipping forward)."""

    kind = "iterable"
    State = IndexState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> IterableSource:
        o = spec.options_as(IterableOptions)
        return cls(o.source, o.mode, name=spec.name, ctx=ctx)

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
            if self._it is None:
                self._reopen()
            assert self._it is not None
            try:
                item = next(self._it)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # interrupted: the iterator is over
                    self._it = None
                raise
        self._index += 1
        return item

    def produce_into(self, out: list[Any], n: int) -> None:
        # One C-level loop over the items: ``seq[i]`` per index (any sequence
        # or dataset, as :meth:`produce`), or the iterator sliced.
        before = len(out)
        if self._mode == "sequence":
            seq, i = self._iterable, self._index
            end = min(len(seq), i + n)
            if i >= end:
                raise StopIteration
            # The position moves first, and back if an item raised: CPython
            # may handle a Ctrl-C as the extend returns, and counting the
            # items after it would then hand them out a second time.
            getitems = getattr(seq, "__getitems__", None)
            self._index = end
            try:
                if callable(getitems):
                    # A batched fetch (torch's protocol, which datasets.Dataset
                    # offers): the same items as seq[i] each, in one call.
                    out.extend(getitems(list(range(i, end))))
                else:
                    out.extend(map(seq.__getitem__, range(i, end)))
            except BaseException:
                # Only the items handed out count: one that raised was not.
                self._index = i + len(out) - before
                raise
            return
        try:
            if self._it is None:
                self._reopen()
            assert self._it is not None
            try:
                out.extend(itertools.islice(self._it, n))
            except BaseException as exc:
                if not isinstance(exc, Exception):  # interrupted: the iterator is over
                    self._it = None
                raise
            if len(out) == before:
                raise StopIteration
        finally:
            # Only the items handed out count: one that raised was not.
            self._index += len(out) - before

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
        self._it = None
        if self._mode != "sequence":
            self._reopen()

    def _reopen(self) -> None:
        """A fresh iterator of the re-iterable, moved forward to ``index``."""
        it = iter(self._iterable() if self._mode == "factory" else self._iterable)
        if self._index:
            # One-shot sources cannot seek: skip what was already yielded.
            skipped = sum(1 for _ in itertools.islice(it, self._index))
            if skipped < self._index:
                msg = (
                    f"stage '{self.name}': checkpoint is at item {self._index} but the "
                    f"iterable now has only {skipped} items."
                )
                raise CheckpointError(msg)
        self._it = it

    def length(self) -> int | None:
        return len(self._iterable) if self._mode == "sequence" else None


class DatasetSource(IterableSource):
    """``dataset[i]`` in index order (a map-style dataset is a sequence)."""

    kind = "dataset"

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> DatasetSource:
        return cls(spec.options_as(DatasetOptions).source, name=spec.name, ctx=ctx)

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
        return cls(spec.options_as(DatasetOptions).source, name=spec.name, ctx=ctx)

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
    :meth:`prepare` when the Loader starts.

    Checkpoints name files relative to a *root* — a glob's leading directories
    without wildcards, or a list's common parent directory — with their sizes,
    so a dataset moved or copied elsewhere (e.g. to local scratch) resumes."""

    kind = "files"
    State = FilesState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> FilesSource:
        o = spec.options_as(FilesOptions)
        return cls(glob=o.glob, paths=o.paths, name=spec.name, ctx=ctx)

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
        self._digest = ""
        self._names: tuple[str, ...] = ()
        self._name_of: dict[str, str] = {}
        self._path_of: dict[str, str] = {}
        self._listing: str | None = None
        self._index = 0

    def prepare(self) -> None:
        """Resolve the glob (one matching nothing is a ``PipelineError``) and
        list the files relative to the root, with their sizes."""
        if self._digest:
            return
        sizes: dict[str, int] = {}
        root = None
        if self._paths is None:
            assert self._glob is not None
            if is_url(self._glob):
                root, found = glob_url(self._glob, f"stage '{self.name}'")
                sizes = dict(found)
                matches = tuple(url for url, _ in found)
            else:
                matches = tuple(sorted(globlib.glob(self._glob, recursive=True)))
            if not matches:
                msg = (
                    f"stage '{self.name}': the glob {self._glob!r} matches no file; "
                    "check the path and the working directory."
                )
                raise PipelineError(msg)
            self._paths = matches
        if root is None:
            root = _root(self._glob, self._paths)
        self._names = tuple(_relative(p, root) for p in self._paths)
        self._name_of = dict(zip(self._paths, self._names))
        self._path_of = dict(zip(self._names, self._paths))
        lines = "".join(
            f"{n}\t{sizes[p] if p in sizes else self._size(p)}\n"
            for n, p in zip(self._names, self._paths)
        )
        self._digest = hashlib.sha1(lines.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        self._listing = lines if len(self._paths) <= LISTING_MAX else None

    def _size(self, path: str) -> int:
        try:
            return file_size(path, f"stage '{self.name}'")
        except OSError:
            return -1  # missing: reading it fails later, with the path

    def name_of(self, path: str) -> str:
        """``path`` (one of :attr:`paths`) relative to the root."""
        self.prepare()
        return self._name_of.get(path, path)

    def path_of(self, name: str) -> str | None:
        """The path of the file named ``name`` relative to the root, if listed."""
        self.prepare()
        return self._path_of.get(name)

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
        self.prepare()
        return {INDEX_KEY: self._index, FILES_KEY: self._digest, LISTING_KEY: self._listing}

    def max_items_out(self, state: FilesState, bound_in: int | None) -> int | None:
        return state.index

    def check_state(self, state: FilesState, states: Mapping[str, Any]) -> None:
        self.prepare()
        if state.files != self._digest:
            msg = (
                f"stage '{self.name}': the file list changed since the checkpoint "
                f"({_what_changed(state.listing, self._listing, len(self.paths))}); "
                "resuming would read the wrong files. Files are matched by their path "
                "relative to the root (the glob's directories before any wildcard, or a "
                "list's common parent) and their size."
            )
            raise CheckpointError(msg)
        if state.index > len(self.paths):
            raise FieldError("index", f"<= {len(self.paths)} (the number of files)", state.index)

    def restore(self, state: dict[str, Any] | None) -> None:
        self.prepare()
        self._index = 0 if state is None else state[INDEX_KEY]

    def length(self) -> int:
        return len(self.paths)


def _root(glob: str | None, paths: tuple[str, ...]) -> str:
    """A glob's leading directories without wildcards, or the paths' common parent."""
    if any(is_url(p) for p in paths):
        # URLs: their common parent, "/"-separated, when they share one.
        heads = sorted({p.rpartition("/")[0] + "/" for p in paths})
        common = os.path.commonprefix(heads)  # noqa: RUF071 - cut at "/" below
        return common[: common.rfind("/") + 1] if "://" in common else ""
    if glob is not None:
        parts = glob.split(os.sep)
        fixed = []
        for part in parts[:-1]:
            if _GLOB_MAGIC & set(part):
                break
            fixed.append(part)
        return os.path.abspath(os.sep.join(fixed) or (os.sep if glob.startswith(os.sep) else "."))
    parents = [os.path.dirname(os.path.abspath(p)) for p in paths]
    try:
        return os.path.commonpath(parents) if parents else "."
    except ValueError:  # pragma: no cover - paths on different drives
        return ""


def _relative(path: str, root: str) -> str:
    if not root:
        return path
    if is_url(path) or is_url(root):
        return path.removeprefix(root) if path.startswith(root) else path
    return os.path.relpath(os.path.abspath(path), root)


def _parse(listing: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in listing.splitlines():
        name, _, size = line.rpartition("\t")
        out[name] = int(size)
    return out


def _what_changed(before: str | None, now: str | None, count: int) -> str:
    """Which files were added, removed or changed size, as far as the listings tell."""
    if before is None or now is None:
        return (
            f"now {count} files; the checkpoint lists no files (more than {LISTING_MAX}, "
            "or an older checkpoint), only a digest of them"
        )
    old, new = _parse(before), _parse(now)
    parts = []
    added = [n for n in new if n not in old]
    removed = [n for n in old if n not in new]
    resized = [f"{n} ({old[n]} -> {new[n]} bytes)" for n in new if n in old and old[n] != new[n]]
    for what, names in (("added", added), ("removed", removed), ("changed size", resized)):
        if names:
            shown = ", ".join(names[:5]) + (
                f", ... ({len(names)} in all)" if len(names) > 5 else ""
            )
            parts.append(f"{what}: {shown}")
    if not parts:
        parts.append("the same files in another order")
    return "; ".join(parts)

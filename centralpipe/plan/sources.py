"""The specs of the sources: the argument checks of ``Pipeline.from_*``.

Each function checks what a user passed to one source classmethod and
returns its :class:`~centralpipe.plan.specs.StageSpec` (``PipelineError``
naming the stage otherwise). ``mix`` has its own module,
:mod:`centralpipe.plan.mix`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from centralpipe.errors import PipelineError
from centralpipe.plan.checks import check_name, is_sequence_like
from centralpipe.plan.options import (
    DatasetOptions,
    FilesOptions,
    IterableOptions,
    StatefulIterableOptions,
)
from centralpipe.plan.specs import StageSpec

__all__ = ["dataset_spec", "files_spec", "iterable_spec", "node_spec"]


def iterable_spec(iterable: Any, name: str) -> StageSpec:
    """The spec of ``Pipeline.from_iterable(iterable, name=name)``."""
    check_name(name)
    if isinstance(iterable, (str, bytes)):
        msg = (
            f"stage '{name}': from_iterable got a {type(iterable).__name__}; "
            "wrap it in a list if you mean one item, or use list(...) for its characters."
        )
        raise PipelineError(msg)
    if isinstance(iterable, (set, frozenset, Mapping)):
        msg = (
            f"stage '{name}': from_iterable got a {type(iterable).__name__}, whose order "
            "is not fixed across processes (resume skips forward by position); pass "
            "sorted(...) or list(...) of it."
        )
        raise PipelineError(msg)
    if isinstance(iterable, Sequence) or is_sequence_like(iterable):
        mode = "sequence"
    elif callable(getattr(iterable, "state_dict", None)) and callable(
        getattr(iterable, "load_state_dict", None)
    ):
        # Keeps its own position (a datasets.IterableDataset): checkpointed through
        # it. Each epoch starts from its state now, whatever Loaders do to it later.
        start = copy.deepcopy(iterable.state_dict())
        stateful = StatefulIterableOptions(source=iterable, start=start)
        return StageSpec("stateful_iterable", name, "source", options=stateful)
    elif callable(iterable):
        mode = "factory"
    elif isinstance(iterable, Iterable):
        if iter(iterable) is iterable:
            msg = (
                f"stage '{name}': from_iterable got a one-shot iterator "
                f"({type(iterable).__name__}), which cannot be read again in the next "
                "epoch or on resume; pass a list, or a zero-argument function that "
                "returns a new iterator."
            )
            raise PipelineError(msg)
        mode = "reiterable"
    else:
        msg = (
            f"stage '{name}': from_iterable needs a list, range, tuple, a re-iterable "
            f"or a zero-argument callable, got {type(iterable).__name__}."
        )
        raise PipelineError(msg)
    options = IterableOptions(source=iterable, mode=mode)
    return StageSpec("iterable", name, "source", options=options)


def files_spec(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], name: str
) -> StageSpec:
    """The spec of ``Pipeline.from_files(paths, name=name)``."""
    check_name(name)
    if isinstance(paths, (str, os.PathLike)):
        options = FilesOptions(glob=os.fspath(paths))
    elif isinstance(paths, Sequence) and not isinstance(paths, bytes):
        items = list(paths)
        if not items:
            msg = f"stage '{name}': from_files got an empty list of paths."
            raise PipelineError(msg)
        bad = [p for p in items if not isinstance(p, (str, os.PathLike))]
        if bad:
            msg = f"stage '{name}': paths must be str or os.PathLike, got {bad[0]!r}."
            raise PipelineError(msg)
        options = FilesOptions(paths=tuple(os.fspath(p) for p in items))
    else:
        msg = (
            f"stage '{name}': from_files needs a glob string or a list of paths, "
            f"got {type(paths).__name__}."
        )
        raise PipelineError(msg)
    return StageSpec("files", name, "source", options=options)


def dataset_spec(dataset: Any, name: str) -> StageSpec:
    """The spec of ``Pipeline.from_dataset(dataset, name=name)``."""
    check_name(name)
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        msg = (
            f"stage '{name}': from_dataset needs a map-style dataset with __len__ and "
            f"__getitem__, got {type(dataset).__name__}; use from_iterable for iterables."
        )
        raise PipelineError(msg)
    return StageSpec("dataset", name, "source", options=DatasetOptions(source=dataset))


def node_spec(node: Any, name: str) -> StageSpec:
    """The spec of ``Pipeline.from_node(node, name=name)``."""
    # Here, not at the top: workers unpickle specs, and need no torch(data).
    from torchdata.nodes import BaseNode

    check_name(name)
    if not isinstance(node, BaseNode):
        msg = (
            f"stage '{name}': from_node needs a torchdata.nodes.BaseNode, "
            f"got {type(node).__name__}."
        )
        raise PipelineError(msg)
    return StageSpec("node", name, "source", options=DatasetOptions(source=node))

"""What a pipeline is made of: stage specs, worker stage kinds, and the
argument checks the builder (:mod:`centralpipe.plan.pipeline`) shares, including
the checks of each source's arguments (``Pipeline.from_*``).

A :class:`StageSpec` is frozen: kind, name, placement, function and options.
Central stage kinds have their home in their node class
(:mod:`centralpipe.stages`); the per-item kinds that run in workers are here.
"""

from __future__ import annotations

import codecs
import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from centralpipe.errors import PipelineError

if TYPE_CHECKING:
    from centralpipe.stages.base import Total

__all__ = [
    "EQUALIZE",
    "WORKER_KINDS",
    "Placement",
    "StageSpec",
    "WorkerKind",
    "check_callable",
    "check_decode_errors",
    "check_int",
    "check_line_encoding",
    "check_name",
    "dataset_spec",
    "files_spec",
    "is_sequence_like",
    "iterable_spec",
    "node_spec",
]

Placement = Literal["source", "central", "dispatch", "worker"]
EQUALIZE = (None, "drop_last", "pad")
#: Every ASCII character: an encoding that writes them as ASCII bytes can be split on b"\n".
_ASCII = "".join(map(chr, range(128)))


@attrs.frozen
class WorkerKind:
    """A stage kind that runs per item in the workers (or inline), and how many
    outputs one input makes: ``"one"``, ``"at_most_one"`` or ``"any"``. (Central
    stage kinds have their home in their node class, ``centralpipe.stages``.)"""

    outputs: Literal["one", "at_most_one", "any"]

    def out_total(self, total: Total, stage: str) -> Total | None:
        """Items out of ``total`` items in (``None``: unknown)."""
        if self.outputs == "one":
            return total
        return total.at_most(stage) if self.outputs == "at_most_one" else None


#: The kinds a worker stage can have.
WORKER_KINDS: dict[str, WorkerKind] = {
    "map": WorkerKind("one"),
    "collate": WorkerKind("one"),
    "filter": WorkerKind("at_most_one"),
    "flat_map": WorkerKind("any"),
}


@attrs.frozen(eq=False)
class StageSpec:
    """One stage of the plan: what it is, where it runs, and its arguments."""

    kind: str
    name: str
    placement: Placement
    fn: Any = None
    options: dict[str, Any] = attrs.field(factory=dict)

    @property
    def parallel(self) -> bool:
        """A central stage run in the workers (``parallel=True``)."""
        return bool(self.options.get("parallel"))

    def describe(self) -> str:
        fn = ""
        if self.fn is not None:
            fn = getattr(self.fn, "__qualname__", None) or type(self.fn).__name__
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k != "source")
        args = ", ".join(a for a in (fn, opts) if a)
        return f"{self.name}: {self.kind}({args}) [{self.placement}]"


def check_callable(fn: Any, what: str, name: str) -> None:
    if not callable(fn):
        msg = f"stage '{name}': {what} must be callable, got {type(fn).__name__} {fn!r}."
        raise PipelineError(msg)


def check_int(value: Any, what: str, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        msg = f"stage '{name}': `{what}` must be an int >= {minimum}, got {value!r}."
        raise PipelineError(msg)


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        msg = f"a stage name must be a non-empty str, got {name!r}."
        raise PipelineError(msg)


#: ``open()``'s ``errors`` that decode (``xmlcharrefreplace`` and ``namereplace`` only encode).
DECODE_ERRORS = ("strict", "replace", "ignore", "backslashreplace", "surrogateescape")


def check_decode_errors(errors: Any, stage: str) -> None:
    """``errors`` is one of ``open()``'s choices that decode bytes."""
    if errors not in DECODE_ERRORS:
        choices = ", ".join(repr(e) for e in DECODE_ERRORS)
        msg = f"stage '{stage}': `errors` must be one of {choices} (as open()), got {errors!r}."
        raise PipelineError(msg)


def check_line_encoding(encoding: Any, stage: str) -> None:
    """``read_lines`` splits bytes on ``b"\\n"``: the encoding must be a text
    encoding that writes ASCII as ASCII."""
    if not isinstance(encoding, str):
        raise PipelineError(f"stage '{stage}': `encoding` must be a str, got {encoding!r}.")
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise PipelineError(f"stage '{stage}': unknown encoding {encoding!r}.") from None
    try:
        "".encode(encoding)
    except LookupError:  # a codec such as "rot13" or "hex"
        msg = f"stage '{stage}': {encoding!r} is not a text encoding (e.g. 'utf-8')."
        raise PipelineError(msg) from None
    try:
        # utf-8-sig writes a BOM first and is otherwise UTF-8.
        encoded = _ASCII.encode(encoding).removeprefix(codecs.BOM_UTF8)
        ascii_compatible = encoded == _ASCII.encode("ascii")
    except (UnicodeError, LookupError, TypeError):
        ascii_compatible = False
    if not ascii_compatible:
        # Lines are found by splitting the bytes on b"\n", which in UTF-16/32
        # (and EBCDIC, UTF-7, bytes-to-bytes codecs) is not a line end.
        msg = (
            f"stage '{stage}': read_lines needs an ASCII-compatible text encoding (it splits "
            f"each file's bytes on b'\\n'), and {encoding!r} is not one. Convert the files "
            "to UTF-8, or read whole files with .map(lambda p: open(p, "
            f"encoding={encoding!r}).read().splitlines()) and .flat_map."
        )
        raise PipelineError(msg)


def is_sequence_like(obj: Any) -> bool:
    """Indexable with a length, but not a mapping (dict keys are not indices)."""
    return (
        hasattr(obj, "__len__")
        and hasattr(obj, "__getitem__")
        and not isinstance(obj, Mapping)
        and not callable(obj)
        and type(obj).__module__ == "builtins"
    )


# -- sources: the argument checks of Pipeline.from_* --------------------------------------


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
        options = {"source": iterable, "start": start}
        return StageSpec("stateful_iterable", name, "source", options=options)
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
    return StageSpec("iterable", name, "source", options={"source": iterable, "mode": mode})


def files_spec(
    paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], name: str
) -> StageSpec:
    """The spec of ``Pipeline.from_files(paths, name=name)``."""
    check_name(name)
    if isinstance(paths, (str, os.PathLike)):
        options: dict[str, Any] = {"glob": os.fspath(paths)}
    elif isinstance(paths, Sequence) and not isinstance(paths, bytes):
        items = list(paths)
        if not items:
            msg = f"stage '{name}': from_files got an empty list of paths."
            raise PipelineError(msg)
        bad = [p for p in items if not isinstance(p, (str, os.PathLike))]
        if bad:
            msg = f"stage '{name}': paths must be str or os.PathLike, got {bad[0]!r}."
            raise PipelineError(msg)
        options = {"paths": tuple(os.fspath(p) for p in items)}
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
    return StageSpec("dataset", name, "source", options={"source": dataset})


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
    return StageSpec("node", name, "source", options={"source": node})

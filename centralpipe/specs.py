"""What a pipeline is made of: stage specs, worker stage kinds, and the
argument checks the builder (:mod:`centralpipe.pipeline`) shares.

A :class:`StageSpec` is frozen: kind, name, placement, function and options.
Central stage kinds have their home in their node class
(:mod:`centralpipe.stages`); the per-item kinds that run in workers are here.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping
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
    "check_int",
    "check_line_encoding",
    "check_name",
    "is_sequence_like",
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

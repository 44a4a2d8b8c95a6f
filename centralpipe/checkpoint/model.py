"""The checkpoint: one typed model that builds, validates and prints it.

On the wire a checkpoint is a plain dict of builtins (and whatever tensors the
items hold), safe for ``torch.save`` and ``torch.distributed.checkpoint``::

    {
      "format_version": 2,
      "fingerprint": [[stage name, kind], ...],   # the whole pipeline
      "seed": int, "epoch": int, "finished": bool,
      "distributed": {"rank": int, "world_size": int},
      "central": {stage name: that stage's own state, ...},
      "in_flight": {boundary name: {               # "dispatch", each parallel stage
          "next_seq": int,                         # next index at the boundary
          "first_seq": int, "items": [...],        # dispatched, not delivered
          "stamps": [...] | None, "skip_outputs": int, "skip": [seq, ...],
          "delivered_stamp": [...] | None,         # parallel stages: as of their last output
          "ranges": [[at, file, start, end, lines, skip], ...]}},  # optional: lines in flight
                                                   # as byte ranges (after read_lines)
      "delivered_stamp": [...] | None,             # count/shard totals as delivered
      "position": {"pre_shard_index": int | None,
                   "delivered": int,                # outputs this epoch (the step count)
                   "skipped": int},                 # inputs that gave none (optional)
    }

It describes the position after the last item the consumer received: the
central stages' state at the feeder's (possibly later) position plus, per
boundary, the inputs sent on but not delivered, which a resume sends first.

:class:`Checkpoint` is that layout as attrs classes; :func:`structure` builds
it from a wire dict with cattrs, checking every type and range (errors name the
key path, what was expected and what was got). Each stage kind declares its own
state class (``CentralNode.State``); :func:`check_pipeline` (in
:mod:`centralpipe.checkpoint.fit`) then checks the checkpoint against the
pipeline it is loaded into. ``Loader.state_dict()``
writes the wire dict directly (it is taken every few steps and must stay
cheap); a test pins that it always structures into this model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, cast

import attrs
import cattrs
from attrs import validators as v
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn

from centralpipe.checkpoint import compact
from centralpipe.errors import CheckpointError
from centralpipe.validators import NUMBER, FieldError, checked, int_in, sequence_of, short_repr

__all__ = [
    "FORMAT_VERSION",
    "Boundary",
    "Checkpoint",
    "Distributed",
    "Position",
    "structure",
    "structure_state",
    "unstructure",
]

FORMAT_VERSION = 2
#: Counts, seqs and indexes fit an int64 (tensors, torch.distributed.checkpoint).
INT64_END = 2**63
#: Seeds are mixed as 64-bit values: larger ones would repeat smaller ones' streams.
SEED_END = 2**64

T = TypeVar("T")


def _count(name: str = "an int >= 0") -> Any:
    return checked(FieldError, name, int_in(0, INT64_END))


def _is_stamp_entry(_inst: Any, _attr: attrs.Attribute[Any], value: Any) -> None:
    # A shard stamps its index (int), or [index, *count totals the item
    # arrived with] when counts precede it; a count stamps (items, weight).
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < INT64_END:
            raise ValueError(value)
        return
    if not isinstance(value, (list, tuple)) or not value:
        raise TypeError(value)
    if all(isinstance(x, (list, tuple)) for x in value[1:]):  # a shard's [index, *counts]
        int_in(0, INT64_END)(_inst, _attr, value[0])
        for pair in value[1:]:
            _is_stamp_entry(_inst, _attr, pair)
        return
    if len(value) != 2:
        raise TypeError(value)
    items, weight = value
    int_in(0, INT64_END)(_inst, _attr, items)
    NUMBER(_inst, _attr, weight)


STAMP = sequence_of(_is_stamp_entry)
_IS_MAPPING: Any = v.instance_of(cast(type, Mapping))
STAMP_TEXT = "a list of shard indexes (int >= 0) and count totals ([items, weight])"


@attrs.frozen(kw_only=True)
class Distributed:
    rank: int = attrs.field(validator=_count())
    world_size: int = attrs.field(validator=checked(FieldError, "an int >= 1", int_in(1)))
    #: A global state (``merge_states``): loads on any rank of any world size;
    #: ``world_size`` is the one it was merged from.
    merged: bool = attrs.field(
        default=False, validator=checked(FieldError, "a bool", v.instance_of(bool))
    )

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            raise FieldError("rank", f"< world_size ({self.world_size})", self.rank)


@attrs.frozen(kw_only=True)
class Position:
    pre_shard_index: int | None = attrs.field(
        validator=checked(FieldError, "None or an int >= 0", v.optional(int_in(0, INT64_END)))
    )
    #: Outputs delivered this epoch (since its start or its last elastic resume).
    delivered: int = attrs.field(default=0, validator=_count())
    #: Inputs of this epoch before the first undelivered one that gave no
    #: output (skipped with ``on_error="skip"``, dropped by a worker filter);
    #: ``None`` in states from before the field. With worker stages that make
    #: at most one output per input, ``delivered + skipped`` is the dispatch
    #: boundary's ``first_seq``: a step count edited alone is caught.
    skipped: int | None = attrs.field(
        default=None,
        validator=checked(FieldError, "None or an int >= 0", v.optional(int_in(0, INT64_END))),
    )


def _is_range(_inst: Any, _attr: attrs.Attribute[Any], value: Any) -> None:
    # [at, file name, start byte, end byte, lines, lines before the in-flight ones]
    if not isinstance(value, (list, tuple)) or len(value) != 6:
        raise TypeError(value)
    at, name, start, end, count, skip = value
    for n in (at, start, end, count, skip):
        int_in(0, INT64_END)(_inst, _attr, n)
    if not isinstance(name, str) or not name or not start < end or not skip < count:
        raise ValueError(value)


RANGE_TEXT = (
    "a list of [at, file, start, end, lines, skip] (ints >= 0 but the file's name; "
    "start < end, skip < lines)"
)


def _decoded_items(value: Any) -> list[Any]:
    """A boundary's ``items``: a list, or their compact form decoded."""
    items: list[Any] = compact.decoded_items("items", value)
    return items


@attrs.frozen(kw_only=True)
class Boundary:
    """The inputs sent across one boundary (e.g. ``dispatch``) and not yet
    delivered, oldest first: ``items[i]`` has seq ``first_seq + i``."""

    next_seq: int = attrs.field(validator=_count())
    first_seq: int = attrs.field(validator=_count())
    items: list[Any] = attrs.field(
        converter=_decoded_items,
        validator=checked(FieldError, "a list", sequence_of()),
    )
    stamps: list[Any] | None = attrs.field(
        validator=checked(
            FieldError, f"None or a list of stamps ({STAMP_TEXT})", v.optional(sequence_of(STAMP))
        )
    )
    skip_outputs: int = attrs.field(validator=_count())
    skip: list[int] = attrs.field(
        validator=checked(FieldError, "a list of seqs", sequence_of(int_in(0, INT64_END)))
    )
    #: A parallel central stage's stamp of the stages before it, as of its last
    #: output (the dispatch boundary's is the top-level ``delivered_stamp``).
    delivered_stamp: list[Any] | None = attrs.field(
        default=None, validator=checked(FieldError, f"None or {STAMP_TEXT}", v.optional(STAMP))
    )
    #: In-flight lines of a parallel stage reading from ``read_lines``, as
    #: byte ranges of their files (never sent as lines): ``[at, file, start,
    #: end, lines, skip]``: the range's lines after its first ``skip`` come
    #: before ``items[at]`` (or after the last item). Absent when empty.
    ranges: list[Any] = attrs.field(
        factory=list, validator=checked(FieldError, RANGE_TEXT, sequence_of(_is_range))
    )

    def __attrs_post_init__(self) -> None:
        n = len(self.items)
        ats = [r[0] for r in self.ranges]
        if ats != sorted(ats) or any(at > n for at in ats):
            expected = f"ranges in order, each 'at' <= len(items) ({n})"
            raise FieldError("ranges", expected, self.ranges)
        if self.ranges and self.stamps is not None:
            raise FieldError("ranges", "[] when items carry stamps", self.ranges)
        lines = sum(r[4] - r[5] for r in self.ranges)
        if self.first_seq + n + lines != self.next_seq:
            total = self.first_seq + n + lines
            expected = f"first_seq + len(items) = {self.first_seq} + {n} = {total}"
            if lines:
                expected = (
                    f"first_seq + len(items) + in-flight lines of ranges = "
                    f"{self.first_seq} + {n} + {lines} = {total}"
                )
            raise FieldError("next_seq", expected, self.next_seq)
        if self.stamps is not None and len(self.stamps) != n:
            raise FieldError("stamps", f"None or one stamp per item ({n})", self.stamps)
        bad = [s for s in self.skip if not self.first_seq <= s < self.next_seq]
        if bad or len(set(self.skip)) != len(self.skip):
            expected = f"distinct seqs of in-flight items, in [{self.first_seq}, {self.next_seq})"
            raise FieldError("skip", expected, self.skip)
        n += lines
        if self.skip_outputs and not n:
            raise FieldError("skip_outputs", "0 when no item is in flight", self.skip_outputs)


@attrs.frozen(kw_only=True)
class Checkpoint:
    """The whole checkpoint; see the module docstring for the wire layout."""

    format_version: int = attrs.field(validator=checked(FieldError, f"{FORMAT_VERSION}", int_in(0)))
    fingerprint: list[Any] = attrs.field(
        validator=checked(
            FieldError,
            "a list of [stage name, kind] pairs",
            sequence_of(sequence_of(v.and_(v.instance_of(str), v.min_len(1)))),
        )
    )
    seed: int = attrs.field(
        validator=checked(FieldError, "an int in [0, 2**64)", int_in(0, SEED_END))
    )
    epoch: int = attrs.field(validator=_count())
    finished: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))
    distributed: Distributed
    central: dict[str, Any] = attrs.field(
        validator=checked(
            FieldError,
            "a dict of stage name -> state dict",
            v.deep_mapping(v.instance_of(str), _IS_MAPPING, _IS_MAPPING),
        )
    )
    in_flight: dict[str, Boundary]
    delivered_stamp: list[Any] | None = attrs.field(
        validator=checked(FieldError, f"None or {STAMP_TEXT}", v.optional(STAMP))
    )
    position: Position

    def __attrs_post_init__(self) -> None:
        if any(len(pair) != 2 for pair in self.fingerprint):
            raise FieldError("fingerprint", "a list of [stage name, kind] pairs", self.fingerprint)


# -- cattrs: wire dict <-> model ---------------------------------------------------------


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    # Values pass through untouched: the attrs validators check them (cattrs
    # would coerce, e.g. int("3")). Containers of attrs classes are checked here.
    def passthrough(value: Any, _type: Any) -> Any:
        return value

    conv.register_structure_hook_func(lambda tp: True, passthrough)
    for primitive in (int, float, str, bool, bytes):
        conv.register_structure_hook(primitive, passthrough)

    def attrs_factory(cl: Any) -> Any:
        base = make_dict_structure_fn(cl, conv, _cattrs_forbid_extra_keys=True)

        def hook(value: Any, tp: Any) -> Any:
            if not isinstance(value, Mapping):
                raise TypeError(f"must be a dict, got {type(value).__name__} {value!r:.60}")
            return base(value, tp)

        return hook

    conv.register_structure_hook_factory(attrs.has, attrs_factory)
    boundaries = conv.gen_structure_mapping(dict[str, Boundary])

    def boundaries_hook(value: Any, tp: Any) -> Any:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise TypeError(
                f"must be a dict of boundary name -> in-flight inputs, got {value!r:.60}"
            )
        return boundaries(value, tp)

    conv.register_structure_hook_func(lambda tp: tp == dict[str, Boundary], boundaries_hook)
    # The wire form keeps values as they are (tuples stay tuples).
    conv.register_unstructure_hook_func(
        lambda tp: not attrs.has(tp) and tp != dict[str, Boundary], lambda value: value
    )
    boundary = make_dict_unstructure_fn(Boundary, conv)

    def boundary_wire(value: Boundary) -> dict[str, Any]:
        out: dict[str, Any] = boundary(value)
        if not out["ranges"]:
            del out["ranges"]  # present only when some lines are in flight as ranges
        return out

    conv.register_unstructure_hook(Boundary, boundary_wire)
    return conv


_CONVERTER = _make_converter()


def _format(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, FieldError):
        return f"\0{exc.field}\0 must be {exc.expected}, got {short_repr(exc.value)}"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"has unexpected key(s) {sorted(exc.extra_fields)}"
    if isinstance(exc, KeyError):
        return "is missing"
    return str(exc)


def _messages(exc: BaseException, root: str) -> list[str]:
    out = []
    for line in cattrs.transform_error(exc, path=root, format_exception=_format):
        message, _, path = line.rpartition(" @ ")
        if message.startswith("\0"):
            field, _, rest = message[1:].partition("\0")
            path = f"{path}.{field}"
            message = rest.lstrip()
        out.append(f"{path.lstrip('$.') or 'the checkpoint'} {message}")
    return out


def _raise(exc: BaseException, root: str) -> None:
    lines = _messages(exc, root)
    more = f" (and {len(lines) - 1} more: {'; '.join(lines[1:4])})" if len(lines) > 1 else ""
    raise CheckpointError(f"damaged checkpoint: {lines[0]}.{more}") from None


def structure(sd: Any) -> Checkpoint:
    """The typed checkpoint of the wire dict ``sd``; ``CheckpointError`` naming
    the key path for any missing, unexpected, mistyped or out-of-range value."""
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"a checkpoint must be a dict, got {type(sd).__name__}.")
    version = sd.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version != FORMAT_VERSION:
        newer = version > FORMAT_VERSION
        msg = (
            f"checkpoint format_version is {version}, this centralpipe reads format_version "
            f"{FORMAT_VERSION}; "
            + (
                "upgrade centralpipe to resume it."
                if newer
                else "it was written by an older centralpipe; resume it with that version."
            )
        )
        raise CheckpointError(msg)
    try:
        return _CONVERTER.structure(sd, Checkpoint)
    except Exception as exc:
        _raise(exc, "$")
        raise  # pragma: no cover - _raise always raises


def structure_state(state: Any, cls: type[T], stage: str) -> T:
    """Stage ``stage``'s wire state as its declared state class ``cls``."""
    try:
        return _CONVERTER.structure(state, cls)
    except Exception as exc:
        _raise(exc, f"$.central['{stage}']")
        raise  # pragma: no cover - _raise always raises


def unstructure(obj: Any) -> Any:
    """The wire form (plain dicts) of a model object."""
    return _CONVERTER.unstructure(obj)

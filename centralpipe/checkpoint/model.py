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
pipeline it is loaded into.

This module is the only one that spells the layout (a test pins it):

- writers: ``Loader.state_dict()`` is taken every few steps, so it builds the
  wire dict directly, with no cattrs round trip: each stream's entry with
  :func:`entry_wire`, the whole checkpoint with :meth:`Captured.wire`; a
  global state with :func:`merged_wire`. Tests pin that what they write
  structures into this model.
- readers: a load structures the dict once; resume (a stream is handed its
  :class:`Boundary`), ``merge_states`` and ``inspect`` (:class:`Outline`)
  read the typed objects. The few facts read from a wire dict that is not
  structured (a damaged one for ``inspect``, a count for a benchmark) are
  read here too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import attrs
import cattrs
from attrs import validators as v
from cattrs.gen import make_dict_structure_fn

from centralpipe.checkpoint import compact
from centralpipe.checkpoint.values import (
    INT64_END,
    IS_MAPPING,
    RANGE,
    RANGE_TEXT,
    SEED_END,
    STAMP,
    STAMP_TEXT,
    count,
)
from centralpipe.errors import CheckpointError
from centralpipe.validators import FieldError, checked, int_in, sequence_of, short_repr

__all__ = [
    "DELIVERED_STAMP_KEY",
    "FORMAT_VERSION",
    "IN_FLIGHT_KEY",
    "STAMP_KEYS",
    "Boundary",
    "Captured",
    "Checkpoint",
    "Distributed",
    "EntryOutline",
    "Outline",
    "Position",
    "copy_wire",
    "empty_entry",
    "entry_wire",
    "has_step_count",
    "in_flight_items",
    "is_global",
    "later_entry",
    "merged_wire",
    "stamp_tuple",
    "structure",
    "structure_state",
    "unstructure",
]

FORMAT_VERSION = 2
#: Keys that other modules name in messages (key paths); only this module reads them.
IN_FLIGHT_KEY = "in_flight"
DELIVERED_STAMP_KEY = "delivered_stamp"
#: Keys whose values are stamps (damaged as stamps by ``testing.faults``).
STAMP_KEYS = frozenset({DELIVERED_STAMP_KEY})

T = TypeVar("T")


@attrs.frozen(kw_only=True)
class Distributed:
    rank: int = attrs.field(validator=count())
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
    delivered: int = attrs.field(default=0, validator=count())
    #: Inputs of this epoch before the first undelivered one that gave no
    #: output (skipped with ``on_error="skip"``, dropped by a worker filter);
    #: ``None`` in states from before the field. With worker stages that make
    #: at most one output per input, ``delivered + skipped`` is the dispatch
    #: boundary's ``first_seq``: a step count edited alone is caught.
    skipped: int | None = attrs.field(
        default=None,
        validator=checked(FieldError, "None or an int >= 0", v.optional(int_in(0, INT64_END))),
    )


def _decoded_items(value: Any) -> list[Any]:
    """A boundary's ``items``: a list, or their compact form decoded."""
    items: list[Any] = compact.decoded_items("items", value)
    return items


@attrs.frozen(kw_only=True)
class Boundary:
    """The inputs sent across one boundary (e.g. ``dispatch``) and not yet
    delivered, oldest first: ``items[i]`` has seq ``first_seq + i``.

    The one model of an in-flight entry: checked here, handed as is to the
    stream that resumes it, and written by :func:`entry_wire`. What a stream
    makes of it, its queue of inputs still to re-send
    (``dispatch.reorder.Stream._resume``, consumed as chunks are pulled), is
    another thing: that stream's progress, not the checkpoint."""

    next_seq: int = attrs.field(validator=count())
    first_seq: int = attrs.field(validator=count())
    items: list[Any] = attrs.field(
        converter=_decoded_items,
        validator=checked(FieldError, "a list", sequence_of()),
    )
    stamps: list[Any] | None = attrs.field(
        validator=checked(
            FieldError, f"None or a list of stamps ({STAMP_TEXT})", v.optional(sequence_of(STAMP))
        )
    )
    skip_outputs: int = attrs.field(validator=count())
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
        factory=list, validator=checked(FieldError, RANGE_TEXT, sequence_of(RANGE))
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

    @classmethod
    def from_wire(cls, entry: Any, name: str = "dispatch") -> Boundary:
        """The checked entry of boundary ``name`` (``CheckpointError`` naming
        the key path when damaged)."""
        try:
            out: Boundary = _CONVERTER.structure(entry, Boundary)
        except Exception as exc:
            _raise(exc, f"$.in_flight['{name}']")
            raise  # pragma: no cover - _raise always raises
        return out

    def to_wire(self) -> dict[str, Any]:
        """This entry's wire dict (items as they are here: decoded)."""
        return entry_wire(
            next_seq=self.next_seq,
            first_seq=self.first_seq,
            items=self.items,
            stamps=self.stamps,
            skip_outputs=self.skip_outputs,
            skip=self.skip,
            delivered_stamp=self.delivered_stamp,
            ranges=self.ranges,
        )


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
    epoch: int = attrs.field(validator=count())
    finished: bool = attrs.field(validator=checked(FieldError, "a bool", v.instance_of(bool)))
    distributed: Distributed
    central: dict[str, Any] = attrs.field(
        validator=checked(
            FieldError,
            "a dict of stage name -> state dict",
            v.deep_mapping(v.instance_of(str), IS_MAPPING, IS_MAPPING),
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

    def skipped(self, tip: str) -> int:
        """Inputs of this epoch that gave no output (``position.skipped``).

        A state from before that field has none: the first undelivered input's
        seq less the outputs delivered stands in, which is the count whenever
        each input gives at most one output (the only pipelines whose step
        count is checked against it)."""
        if self.position.skipped is not None:
            return self.position.skipped
        return max(0, self.in_flight[tip].first_seq - self.position.delivered)


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
    # One writer of an entry: the fast path's (ranges present only when some are).
    conv.register_unstructure_hook(Boundary, Boundary.to_wire)
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


# -- the writers: wire dicts built directly (state_dict() is taken every few steps) -----


def entry_wire(
    *,
    next_seq: int,
    first_seq: int,
    items: Any,
    stamps: list[Any] | None,
    skip_outputs: int,
    skip: list[int],
    delivered_stamp: Any = None,
    ranges: list[Any] | None = None,
) -> dict[str, Any]:
    """A boundary's wire entry (:class:`Boundary`'s layout), unchecked: the
    fast path of ``state_dict()``; a test pins that it structures."""
    out = {
        "next_seq": next_seq,
        "first_seq": first_seq,
        "items": items,
        "stamps": stamps,
        "skip_outputs": skip_outputs,
        "skip": skip,
        "delivered_stamp": delivered_stamp,
    }
    if ranges:  # present only when some lines are in flight as ranges
        out["ranges"] = ranges
    return out


def later_entry(first: dict[str, Any]) -> dict[str, Any]:
    """The entry of a later stage of a fused segment whose first stage's
    entry is ``first`` (``dispatch.segments``): nothing in flight, its next
    input the segment's first one not delivered, stamped as ``first``."""
    return entry_wire(
        next_seq=first["first_seq"],
        first_seq=first["first_seq"],
        items=[],
        stamps=None if first["stamps"] is None else [],
        skip_outputs=0,
        skip=[],
        delivered_stamp=first.get("delivered_stamp"),
    )


def empty_entry() -> dict[str, Any]:
    """The entry of a boundary with nothing in flight (before its first run)."""
    return entry_wire(next_seq=0, first_seq=0, items=[], stamps=None, skip_outputs=0, skip=[])


@attrs.define(slots=True, eq=False)
class Captured:
    """What ``state_dict()`` captured of a run (or of an idle loader), before
    it is a checkpoint: the dispatch boundary's entry (its ``delivered_stamp``
    the stream's, which becomes the checkpoint's top-level one), the step
    count, and, filled in by the run, the central states and every parallel
    stage's entry. Unchecked and mutable: it is built on the hot path, and
    :meth:`wire` is the one place it becomes the layout."""

    #: The dispatch boundary's wire entry (:func:`entry_wire`).
    entry: dict[str, Any]
    finished: bool
    #: Outputs delivered this epoch and inputs that gave none (``position``).
    delivered: int
    skipped: int
    central: dict[str, Any] = attrs.field(factory=dict)
    #: Each parallel stage's wire entry, by stage name.
    segments: dict[str, dict[str, Any]] = attrs.field(factory=dict)

    @classmethod
    def idle(cls, segments: Sequence[str], central: dict[str, Any]) -> Captured:
        """Between runs: no item in flight."""
        segs = {name: empty_entry() for name in segments}
        return cls(empty_entry(), True, 0, 0, central, segs)

    @property
    def delivered_stamp(self) -> Any:
        """The count/shard stamp as of the last delivered output."""
        return self.entry["delivered_stamp"]

    def count_seqs(self) -> None:
        """Count the seqs of the entry's items when ``next_seq`` has not yet
        (a pull let go of the chain lock after storing them): ``next_seq`` is
        at least ``first_seq + len(items)``."""
        entry = self.entry
        n = compact.count_items(entry["items"])  # compact when they are token arrays
        entry["next_seq"] = max(entry["next_seq"], entry["first_seq"] + n)

    def extend(self, items: list[Any], stamps: list[Any] | None) -> None:
        """Append ``items`` (with their ``stamps``) as in flight after the
        entry's, with the next seqs (a node's rank: its shard's items not yet
        sent, ``dispatch.node``)."""
        if not items:
            return
        entry = self.entry
        before = compact.decode_items(entry["items"])  # compact when they are token arrays
        had = bool(before)
        entry["items"] = compact.encode_items([*before, *items])
        if entry["stamps"] is not None:
            entry["stamps"] = [*entry["stamps"], *(stamps or ())]
        if not had:
            entry["first_seq"] = entry["next_seq"]
        entry["next_seq"] += len(items)

    def wire(
        self,
        *,
        fingerprint: Any,
        seed: int,
        epoch: int,
        rank: int,
        world_size: int,
        boundary: str,
        pre_shard_index: int | None,
    ) -> dict[str, Any]:
        """The checkpoint's wire dict (builtins and tensors only)."""
        tip = dict(self.entry)
        stamp = tip["delivered_stamp"]
        tip["delivered_stamp"] = None  # the top-level one
        return {
            "format_version": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "seed": seed,
            "epoch": epoch,
            "finished": self.finished,
            # "merged" is always present, so a state_dict() used as the template
            # of torch.distributed.checkpoint's load receives a global state's flag.
            "distributed": {"rank": rank, "world_size": world_size, "merged": False},
            "central": self.central,
            "in_flight": {**self.segments, boundary: tip},
            "delivered_stamp": stamp,
            "position": {
                "pre_shard_index": pre_shard_index,
                "delivered": self.delivered,
                "skipped": self.skipped,
            },
        }


def merged_wire(
    src: Mapping[str, Any],
    *,
    boundary: str,
    central: dict[str, Any],
    world_size: int,
    finished: bool,
    delivered_stamp: Any,
    pre_shard_index: int,
) -> dict[str, Any]:
    """A global state (``merge_states``) on the wire: rank state ``src`` (the
    furthest-behind rank's) with the merged central states, nothing in flight
    at ``boundary`` (its items are in the shard's queue) and the global
    position. Other boundaries' entries (parallel stages before the shard)
    are ``src``'s, as its pre-shard states are."""
    out = dict(src)
    out["central"] = central
    out["distributed"] = {"rank": 0, "world_size": world_size, "merged": True}
    out["finished"] = finished
    # Every key of a per-rank entry (stamps [] rather than None included):
    # torch.distributed.checkpoint loads into a template with exactly these keys.
    tip = entry_wire(next_seq=0, first_seq=0, items=[], stamps=[], skip_outputs=0, skip=[])
    out["in_flight"] = {**src["in_flight"], boundary: tip}
    out["delivered_stamp"] = delivered_stamp
    out["position"] = {"pre_shard_index": pre_shard_index, "delivered": 0, "skipped": 0}
    return out


def copy_wire(sd: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a wire checkpoint's containers (items themselves are shared)."""
    out = dict(sd)
    out["in_flight"] = {name: _copy_entry(entry) for name, entry in sd["in_flight"].items()}
    out["central"] = dict(sd["central"])
    return out


def _copy_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    out = {**entry, "items": compact.copy_items(entry["items"])}
    if "ranges" in entry:
        out["ranges"] = [list(r) for r in entry["ranges"]]
    return out


def in_flight_items(sd: Mapping[str, Any]) -> int:
    """Items in flight at every boundary of a wire checkpoint (compact ones counted)."""
    return sum(compact.count_items(e["items"]) for e in sd["in_flight"].values())


def is_global(sd: Any) -> bool:
    """Whether the wire dict ``sd`` is a global state (``merge_states``)."""
    dist = sd.get("distributed") if isinstance(sd, Mapping) else None
    return isinstance(dist, Mapping) and bool(dist.get("merged"))


def has_step_count(sd: Mapping[str, Any]) -> bool:
    """Whether a (structured) wire checkpoint states ``position.delivered``
    (states from before the field do not; the model reads them as 0)."""
    position = sd.get("position")
    return isinstance(position, Mapping) and position.get("delivered") is not None


def stamp_tuple(stamp: Any) -> Any:
    """A stamp as a stream holds it (tuples, as the stamper makes them)."""
    if stamp is None:
        return None
    return tuple(tuple(x) if isinstance(x, list) else x for x in stamp)


# -- the outline: what ``inspect`` prints, from the model or from a damaged dict ---------


@attrs.frozen
class EntryOutline:
    """One boundary's in-flight entry as ``inspect`` shows it."""

    name: str
    items: int
    first_seq: Any
    next_seq: Any
    skip_outputs: Any
    skips: int | None  # None: not a list
    #: The first in-flight item, when there is one (``[item]``), else ``[]``.
    first: list[Any]


@attrs.frozen
class Outline:
    """A checkpoint's facts as ``inspect`` shows them: from the typed model
    (:meth:`of`), or read leniently from a dict that does not pass it
    (:meth:`loose`, ``"?"`` or ``None`` for what cannot be read)."""

    format_version: Any
    epoch: Any
    finished: Any
    rank: Any
    world_size: Any
    merged: bool
    seed: Any
    pre_shard_index: Any
    delivered: Any  # None: not in the checkpoint
    in_flight: list[EntryOutline]
    delivered_stamp: Any
    #: [stage name, kind] pairs, and each central stage's state.
    fingerprint: list[Any]
    central: Mapping[str, Any]

    @classmethod
    def of(cls, ckpt: Checkpoint) -> Outline:
        flights = [
            EntryOutline(
                name,
                len(b.items),
                b.first_seq,
                b.next_seq,
                b.skip_outputs,
                len(b.skip),
                b.items[:1],
            )
            for name, b in ckpt.in_flight.items()
        ]
        dist, pos = ckpt.distributed, ckpt.position
        return cls(
            ckpt.format_version,
            ckpt.epoch,
            ckpt.finished,
            dist.rank,
            dist.world_size,
            dist.merged,
            ckpt.seed,
            pos.pre_shard_index,
            pos.delivered,
            flights,
            ckpt.delivered_stamp,
            list(ckpt.fingerprint),
            ckpt.central,
        )

    @classmethod
    def loose(cls, sd: Mapping[str, Any]) -> Outline:
        dist, pos = _mapping(sd.get("distributed")), _mapping(sd.get("position"))
        flights = []
        for name, raw in _mapping(sd.get("in_flight")).items():
            entry = _mapping(raw)
            try:
                items = compact.decode_items(entry.get("items"))
            except (TypeError, ValueError):
                items = []
            skip = entry.get("skip")
            flights.append(
                EntryOutline(
                    str(name),
                    len(items),
                    entry.get("first_seq"),
                    entry.get("next_seq"),
                    entry.get("skip_outputs", 0),
                    len(skip) if isinstance(skip, (list, tuple)) else None,
                    items[:1],
                )
            )
        fingerprint = sd.get("fingerprint")
        return cls(
            sd.get("format_version"),
            sd.get("epoch"),
            sd.get("finished"),
            dist.get("rank", "?"),
            dist.get("world_size", "?"),
            bool(dist.get("merged")),
            sd.get("seed"),
            pos.get("pre_shard_index"),
            pos.get("delivered"),
            flights,
            sd.get("delivered_stamp"),
            list(fingerprint) if isinstance(fingerprint, (list, tuple)) else [],
            _mapping(sd.get("central")),
        )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}

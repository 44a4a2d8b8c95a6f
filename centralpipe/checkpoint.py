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
          "delivered_stamp": [...] | None}},       # parallel stages: as of their last output
      "delivered_stamp": [...] | None,             # count/shard totals as delivered
      "position": {"pre_shard_index": int | None},
    }

It describes the position after the last item the consumer received: the
central stages' state at the feeder's (possibly later) position plus, per
boundary, the inputs sent on but not delivered, which a resume sends first.

:class:`Checkpoint` is that layout as attrs classes; :func:`structure` builds
it from a wire dict with cattrs, checking every type and range (errors name the
key path, what was expected and what was got). Each stage kind declares its own
state class (``CentralNode.State``); :func:`check_pipeline` then checks the
checkpoint against the pipeline it is loaded into. ``Loader.state_dict()``
writes the wire dict directly (it is taken every few steps and must stay
cheap); a test pins that it always structures into this model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar, cast

import attrs
import cattrs
from attrs import validators as v
from cattrs.gen import make_dict_structure_fn

from centralpipe.errors import CheckpointError
from centralpipe.validators import NUMBER, FieldError, checked, int_in, sequence_of

__all__ = [
    "FORMAT_VERSION",
    "Boundary",
    "Checkpoint",
    "Distributed",
    "Position",
    "rank_mismatch",
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


@attrs.frozen(kw_only=True)
class Boundary:
    """The inputs sent across one boundary (e.g. ``dispatch``) and not yet
    delivered, oldest first: ``items[i]`` has seq ``first_seq + i``."""

    next_seq: int = attrs.field(validator=_count())
    first_seq: int = attrs.field(validator=_count())
    items: list[Any] = attrs.field(validator=checked(FieldError, "a list", sequence_of()))
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

    def __attrs_post_init__(self) -> None:
        n = len(self.items)
        if self.first_seq + n != self.next_seq:
            expected = f"first_seq + len(items) = {self.first_seq} + {n} = {self.first_seq + n}"
            raise FieldError("next_seq", expected, self.next_seq)
        if self.stamps is not None and len(self.stamps) != n:
            raise FieldError("stamps", f"None or one stamp per item ({n})", self.stamps)
        bad = [s for s in self.skip if not self.first_seq <= s < self.next_seq]
        if bad or len(set(self.skip)) != len(self.skip):
            expected = f"distinct seqs of in-flight items, in [{self.first_seq}, {self.next_seq})"
            raise FieldError("skip", expected, self.skip)
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
    return conv


_CONVERTER = _make_converter()


def _format(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, FieldError):
        return f"\0{exc.field}\0 must be {exc.expected}, got {_got(exc.value)}"
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return f"has unexpected key(s) {sorted(exc.extra_fields)}"
    if isinstance(exc, KeyError):
        return "is missing"
    return str(exc)


def _got(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = f"{type(value).__name__} {text[:60]}..."
    return text


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


# -- the checkpoint against the pipeline it is loaded into --------------------------------


@attrs.frozen(kw_only=True)
class Expected:
    """What a checkpoint must match: the pipeline and the loader's config."""

    fingerprint: list[list[str]]
    seed: int
    rank: int
    world_size: int
    #: Central nodes in order (each declares ``State`` and ``check_state``).
    nodes: list[Any]
    #: Boundary names whose in-flight inputs the checkpoint holds.
    boundaries: list[str]
    #: The boundary at the tip of the central chain (``dispatch``).
    tip: str
    #: The stamped stages (``count`` and ``shard`` nodes), in order.
    stamped: list[Any]
    #: Whether the worker stages can make more than one output from one input.
    multi_output: bool
    #: Items the central chain yields per epoch, when known.
    length: int | None
    #: Parallel central stages (boundaries besides ``tip``): the stamped
    #: stages before each, and whether it can make several outputs per input.
    segments: dict[str, tuple[list[Any], bool]] = attrs.field(factory=dict)


def _fail(path: str, expected: str, got: Any) -> None:
    raise CheckpointError(f"damaged checkpoint: {path} must be {expected}, got {_got(got)}.")


def check_pipeline(ckpt: Checkpoint, want: Expected) -> dict[str, Any]:
    """Check ``ckpt`` against the pipeline and config in ``want``; return each
    stage's structured state by name. Raises ``CheckpointError``; changes nothing."""
    fp = [list(pair) for pair in ckpt.fingerprint]
    if fp != want.fingerprint:
        raise CheckpointError(_fingerprint_diff(fp, want.fingerprint))
    if ckpt.seed != want.seed:
        msg = (
            f"checkpoint was taken with seed {ckpt.seed}, this loader has seed {want.seed}; "
            "resuming would change the shuffle and with_rng streams."
        )
        raise CheckpointError(msg)
    dist = ckpt.distributed
    if not dist.merged and (dist.rank, dist.world_size) != (want.rank, want.world_size):
        raise CheckpointError(rank_mismatch(dist.rank, dist.world_size, want.rank, want.world_size))
    names = [node.name for node in want.nodes]
    if sorted(ckpt.central) != sorted(names):
        missing = [n for n in names if n not in ckpt.central]
        extra = [n for n in ckpt.central if n not in names]
        _fail("central", f"one state per central stage (missing {missing})", f"extra {extra}")
    if sorted(ckpt.in_flight) != sorted(want.boundaries):
        _fail("in_flight", f"keyed by boundary {want.boundaries}", sorted(ckpt.in_flight))
    states: dict[str, Any] = {}
    for node in want.nodes:
        raw = ckpt.central[node.name]
        cls = getattr(node, "State", None)
        states[node.name] = raw if cls is None else structure_state(raw, cls, node.name)
    for node in want.nodes:
        try:
            node.check_state(states[node.name], states)
        except FieldError as exc:
            _fail(f"central['{node.name}'].{exc.field}", exc.expected, exc.value)
    bound: int | None = None
    for node in want.nodes:
        bound = node.max_items_out(states[node.name], bound)
    for name, flight in ckpt.in_flight.items():
        path = f"in_flight['{name}']"
        if name == want.tip and bound is not None and flight.next_seq > bound:
            expected = f"<= {bound} (the items the central stages have yielded, by their state)"
            _fail(f"{path}.next_seq", expected, flight.next_seq)
        _check_boundary(path, name, flight, ckpt, want, states)
    return states


def _check_boundary(
    path: str,
    name: str,
    flight: Boundary,
    ckpt: Checkpoint,
    want: Expected,
    states: dict[str, Any],
) -> None:
    segment = want.segments.get(name)
    if segment is None:
        stamped_nodes, multi = want.stamped, want.multi_output
        delivered, delivered_path = ckpt.delivered_stamp, "delivered_stamp"
        if want.length is not None and flight.next_seq > want.length:
            _fail(f"{path}.next_seq", f"<= {want.length} (items per epoch here)", flight.next_seq)
        if flight.delivered_stamp is not None:
            _fail(
                f"{path}.delivered_stamp", "None (it is the top-level one)", flight.delivered_stamp
            )
    else:
        stamped_nodes, multi = segment
        delivered, delivered_path = flight.delivered_stamp, f"{path}.delivered_stamp"
    if flight.skip_outputs and not multi:
        makes = "the worker stages make" if segment is None else "the parallel stage makes"
        expected = f"0 ({makes} at most one output per input)"
        _fail(f"{path}.skip_outputs", expected, flight.skip_outputs)
    stamped = [node.kind for node in stamped_nodes]
    if not stamped:
        if flight.stamps is not None:
            _fail(f"{path}.stamps", "None (no count or shard stage before it)", flight.stamps)
        if delivered is not None:
            _fail(delivered_path, "None (no count or shard stage before it)", delivered)
        return
    if flight.stamps is None and flight.items:
        _fail(f"{path}.stamps", "one stamp per in-flight item", None)
    # Stamps are the stamped stages' totals as each item left the chain: they
    # never decrease along the stream and never pass the stages' own state.
    sequence = [(delivered_path, delivered)]
    sequence += [(f"{path}.stamps[{i}]", s) for i, s in enumerate(flight.stamps or [])]
    now = [_stamp_value(n.kind, states[n.name]) for n in stamped_nodes]
    previous = [0] * len(stamped)
    for where, stamp in sequence:
        if stamp is None:
            continue
        kinds_text = ", ".join("index" if k == "shard" else "[items, weight]" for k in stamped)
        if len(stamp) != len(stamped):
            _fail(where, f"{len(stamped)} entries ({kinds_text})", stamp)
        for i, (kind, entry) in enumerate(zip(stamped, stamp)):
            is_index = isinstance(entry, int)
            shard_entry = kind == "shard" and (
                is_index or all(isinstance(x, (list, tuple)) for x in entry[1:])
            )
            count_entry = kind != "shard" and not is_index and len(entry) == 2
            if not (shard_entry or count_entry):
                expected = (
                    "an int index or [index, *counts]" if kind == "shard" else "[items, weight]"
                )
                _fail(f"{where}[{i}]", expected, entry)
            value = entry if is_index else entry[0]
            # A global state's delivered view may be ahead of the furthest-behind
            # rank's stages (equalize=None): those items are dropped on resume.
            ahead_ok = ckpt.distributed.merged and where == "delivered_stamp"
            if not previous[i] <= value <= (value if ahead_ok else now[i]):
                expected = f"between {previous[i]} and the stage's {now[i]}"
                _fail(f"{where}[{i}]", expected, entry)
            previous[i] = value


def _stamp_value(kind: str, state: Any) -> int:
    return int(state.index if kind == "shard" else state.items)


def _fingerprint_diff(ckpt: list[Any], current: list[list[str]]) -> str:
    for i, (a, b) in enumerate(zip(ckpt, current)):
        if a != b:
            return (
                f"checkpoint is of another pipeline: at position {i} the checkpoint has stage "
                f"'{a[0]}' ({a[1]}), this pipeline has '{b[0]}' ({b[1]})."
            )
    return (
        f"checkpoint is of another pipeline: it has {len(ckpt)} stages, this pipeline "
        f"has {len(current)}."
    )


def rank_mismatch(ckpt_rank: Any, ckpt_world: Any, rank: int, world_size: int) -> str:
    """Why a per-rank state cannot load here, and what to do instead."""
    if ckpt_world == world_size:
        return (
            f"checkpoint is the state of rank {ckpt_rank} of {ckpt_world}, but this loader is "
            f"rank {rank} of {world_size}: each rank must load its own state. If every rank "
            "saved loader.state_dict() under the same key (e.g. with "
            "torch.distributed.checkpoint, which then keeps one rank's copy), save it under a "
            "per-rank key instead, or save one global state from cp.gather_states(loader) "
            "(cp.merge_states of every rank's state), which loads on any rank; see "
            "docs/distributed.md."
        )
    return (
        f"checkpoint is the state of rank {ckpt_rank} of {ckpt_world}, but this loader is "
        f"rank {rank} of {world_size}: a per-rank state resumes only on its own rank of the "
        "same world size. To continue on another world size, merge the states of all "
        f"{ckpt_world} ranks with cp.merge_states([...]) (or cp.gather_states(loader) under "
        "torch.distributed) and load that global state on every rank."
    )

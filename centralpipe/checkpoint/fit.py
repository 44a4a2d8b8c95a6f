"""A checkpoint against the pipeline it is loaded into.

:func:`check_pipeline` takes a checkpoint already structured by
:mod:`centralpipe.checkpoint` (so every type and range is right) and checks
that it belongs here: the same stages, seed and rank, every central stage's
state valid for this pipeline (file indexes and paths against the file list,
offsets against file sizes), and each boundary's in-flight inputs, seqs and
count stamps consistent with those states, and a step count
(``position.delivered``) no larger than the items delivered when each gives
at most one output. :class:`Expected` is what the loader knows of its
pipeline and config (``merge_states``, which has no pipeline, builds one from
what each rank's state says of it). Every refusal is a ``CheckpointError``
naming the key path; nothing is changed.
"""

from __future__ import annotations

from typing import Any

import attrs

from centralpipe.checkpoint.model import (
    DELIVERED_STAMP_KEY,
    IN_FLIGHT_KEY,
    Boundary,
    Checkpoint,
    structure_state,
)
from centralpipe.errors import CheckpointError
from centralpipe.validators import FieldError, short_repr

__all__ = ["Expected", "check_pipeline", "rank_mismatch"]


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
    #: The reader each parallel stage pulls byte ranges from (``read_lines``:
    #: ``check_range``), by stage name; ``None``: not known (``merge_states``),
    #: ranges are then checked by the loader that loads the merged state.
    readers: dict[str, Any] | None = None


def _fail(path: str, expected: str, got: Any) -> None:
    raise CheckpointError(f"damaged checkpoint: {path} must be {expected}, got {short_repr(got)}.")


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
        _parallel_mismatch(list(ckpt.in_flight), want.boundaries, names)
        _fail(IN_FLIGHT_KEY, f"keyed by boundary {want.boundaries}", sorted(ckpt.in_flight))
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
    # A boundary's seq counter cannot pass what the stages feeding it have
    # yielded: the whole chain's for the tip, the stages before it for a
    # parallel stage (its seqs number its inputs).
    bound: int | None = None
    inputs: dict[str, int | None] = {}
    for node in want.nodes:
        inputs[node.name] = bound
        bound = node.max_items_out(states[node.name], bound)
    for name, flight in ckpt.in_flight.items():
        path = f"in_flight['{name}']"
        if name == want.tip and bound is not None and flight.next_seq > bound:
            expected = f"<= {bound} (the items the central stages have yielded, by their state)"
            _fail(f"{path}.next_seq", expected, flight.next_seq)
        fed = inputs.get(name) if name != want.tip else None
        if fed is not None and flight.next_seq > fed:
            expected = f"<= {fed} (the items the stages before it have yielded, by their state)"
            _fail(f"{path}.next_seq", expected, flight.next_seq)
        _check_boundary(path, name, flight, ckpt, want, states)
    tip = ckpt.in_flight.get(want.tip)
    if tip is not None and not want.multi_output:
        _check_step_count(ckpt, want.tip, tip)
    return states


def _check_step_count(ckpt: Checkpoint, name: str, tip: Boundary) -> None:
    """The step count against the inputs delivered, when each input gave at
    most one output: exactly (``delivered + skipped == first_seq``) with
    ``position.skipped``, else (older states) ``delivered <= first_seq``. A
    state relabelled to another step, later or earlier, fails here."""
    delivered, skipped = ckpt.position.delivered, ckpt.position.skipped
    if skipped is None:
        if delivered > tip.first_seq:
            # A worker filter, or on_error="skip", gives no output for an
            # input: a step count past the inputs is another step's.
            expected = (
                f"<= in_flight['{name}'].first_seq ({tip.first_seq}, the items delivered: "
                "the worker stages make at most one output per input)"
            )
            _fail("position.delivered", expected, delivered)
        return
    if delivered + skipped != tip.first_seq:
        expected = (
            f"in_flight['{name}'].first_seq - position.skipped = {tip.first_seq} - {skipped} = "
            f"{tip.first_seq - skipped} (each item delivered gave one output or was skipped: "
            "the worker stages make at most one output per input; a step count that differs "
            "is another step's)"
        )
        _fail("position.delivered", expected, delivered)


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
        delivered, delivered_path = ckpt.delivered_stamp, DELIVERED_STAMP_KEY
        if want.length is not None and flight.next_seq > want.length:
            _fail(f"{path}.next_seq", f"<= {want.length} (items per epoch here)", flight.next_seq)
        if flight.delivered_stamp is not None:
            _fail(
                f"{path}.delivered_stamp", "None (it is the top-level one)", flight.delivered_stamp
            )
    else:
        stamped_nodes, multi = segment
        delivered, delivered_path = flight.delivered_stamp, f"{path}.delivered_stamp"
    if flight.ranges:
        _check_ranges(path, name, flight, want)
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
            ahead_ok = ckpt.distributed.merged and where == DELIVERED_STAMP_KEY
            if not previous[i] <= value <= (value if ahead_ok else now[i]):
                expected = f"between {previous[i]} and the stage's {now[i]}"
                _fail(f"{where}[{i}]", expected, entry)
            previous[i] = value


def _check_ranges(path: str, name: str, flight: Boundary, want: Expected) -> None:
    """In-flight byte ranges belong to a parallel stage reading from
    ``read_lines``, and are whole lines of its files as they are now."""
    if want.readers is None:
        return
    reader = want.readers.get(name)
    if reader is None:
        expected = "[] (only a parallel stage reading from read_lines has ranges in flight)"
        _fail(f"{path}.ranges", expected, flight.ranges)
        return
    for i, record in enumerate(flight.ranges):
        try:
            reader.check_range(record)
        except FieldError as exc:
            _fail(f"{path}.ranges[{i}]", exc.expected, exc.value)


def _stamp_value(kind: str, state: Any) -> int:
    return int(state.index if kind == "shard" else state.items)


def _parallel_mismatch(got: list[str], boundaries: list[str], names: list[str]) -> None:
    """Raise if the in-flight keys differ only in which stages are parallel:
    the fingerprint (names and kinds) matched, so the pipeline differs in a
    stage's ``parallel=`` option, not the checkpoint in its data."""
    was = [n for n in got if n not in boundaries and n in names]
    now = [n for n in boundaries if n not in got and n in names]
    if (not was and not now) or sorted(set(got) - set(was)) != sorted(set(boundaries) - set(now)):
        return
    parts = [
        f"stage '{n}' ran in worker processes (parallel=True) when the checkpoint was "
        "taken, and runs in the main process now"
        for n in was
    ] + [
        f"stage '{n}' ran in the main process when the checkpoint was taken, and is "
        "parallel=True now"
        for n in now
    ]
    msg = (
        f"checkpoint is from a different pipeline: {'; '.join(parts)}. Build the pipeline "
        "with the same parallel= options as when the checkpoint was taken to resume it."
    )
    raise CheckpointError(msg)


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

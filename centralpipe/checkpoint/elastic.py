"""Elastic resume: one global state from every rank's state, for any world size.

With ``shard()`` after every stateful central stage, all ranks run one central
stream, and rank ``r`` of ``W`` gets stream positions ``base + s*W + r`` (its
``s``-th item). States taken after the same number of steps on every rank
therefore describe one global position, and :func:`merge_states` rebuilds the
stream there:

- the pre-shard stages' state of the rank whose shard is furthest *behind*
  (its ``index`` is the smallest, ``c``): everything from ``c`` on comes out
  of those stages again;
- every item before ``c`` that no rank has delivered — in some rank's
  in-flight list, or in that rank's equalize round (with ``drop_last`` after
  the end of the epoch: the round it dropped) — back in central order, as the
  shard's ``queue``, each with the ``count`` totals it arrived with;
- the items at ``c`` or later that a rank further ahead already delivered, as
  the shard's ``drop`` list (only ``equalize=None`` has these: at most
  ``world_size - 1`` items, which the central stages compute again and the
  shard discards).

The result depends only on what each rank has delivered, never on how far its
feeder had read ahead: the old world size's end-of-epoch decision (which
round ``drop_last`` dropped, which items ``pad`` repeated) is undone, and the
new ranks' shard makes its own.

No worker is asked and nothing is replayed. The global state has no in-flight
items of its own; every rank of any world size loads it and its shard
splits the rebuilt stream anew, from position ``base`` (the first item no rank
delivered), so each item keeps its position and its ``with_rng`` stream.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from centralpipe import checkpoint
from centralpipe.checkpoint import compact, model
from centralpipe.errors import CheckpointError
from centralpipe.plan.specs import WORKER_KINDS
from centralpipe.stages import NODE_CLASSES, Parallel
from centralpipe.stages.shard import ANY_EQUALIZE, check_shard_state

__all__ = ["is_global", "merge_states"]

SHARD_KIND = "shard"
STAMPED_KINDS = ("count", "shard")


def is_global(state: Any) -> bool:
    """Whether ``state`` is a global state from :func:`merge_states`."""
    return model.is_global(state)


def merge_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One global state from the ``state_dict()`` of *every* rank of one job,
    all taken after the same number of steps (any order).

    Load it with ``loader.load_state_dict`` on every rank of a job of any world
    size, with any ``num_workers``. Every rank's state is first checked as
    ``load_state_dict`` checks a checkpoint, against what the state says of its
    pipeline (what needs the stages' own arguments is checked when the global
    state is loaded). Raises ``CheckpointError`` naming what is wrong: a damaged
    rank's state (``states[i] (rank r):`` and the words ``load_state_dict``
    would use), an incomplete set, a rank twice, states of different
    pipelines, seeds, epochs or step counts, or a pipeline that cannot be
    resumed elastically (no ``shard()``, or a central stage after it)."""
    if isinstance(states, Mapping) or not isinstance(states, Sequence):
        msg = (
            "merge_states needs a list of state_dict()s, one per rank, got "
            f"{type(states).__name__}."
        )
        raise CheckpointError(msg)
    if not states:
        raise CheckpointError("merge_states needs the state_dict() of every rank, got none.")
    for i, sd in enumerate(states):
        if not isinstance(sd, Mapping) or "distributed" not in sd:
            what = "a dict without 'distributed'" if isinstance(sd, Mapping) else type(sd).__name__
            msg = f"states[{i}] is not a centralpipe state_dict() (got {what})."
            raise CheckpointError(msg)
    ckpts = [_validate(i, sd) for i, sd in enumerate(states)]
    merged = [c.distributed.merged for c in ckpts]
    if any(merged):
        return _already_global(states, ckpts, merged)
    ranks = [_Rank(i, sd, ckpt) for i, (sd, ckpt) in enumerate(zip(states, ckpts))]
    _check_same_job(ranks)
    return _merge(ranks)


def _validate(i: int, sd: Mapping[str, Any]) -> model.Checkpoint:
    """Check ``states[i]`` as ``load_state_dict`` checks a checkpoint (the
    typed model, then :func:`~centralpipe.checkpoint.check_pipeline`) against
    what the state itself says of its pipeline; the error names the rank."""
    try:
        ckpt = checkpoint.structure(sd)
        checkpoint.check_pipeline(ckpt, _declared(ckpt))
        return ckpt
    except CheckpointError as exc:
        dist = sd.get("distributed")
        rank = dist.get("rank") if isinstance(dist, Mapping) else None
        who = f" (rank {rank})" if isinstance(rank, int) and not isinstance(rank, bool) else ""
        raise CheckpointError(f"states[{i}]{who}: {exc}") from None


@attrs.frozen
class _Declared:
    """A central stage as a checkpoint declares it (name and kind): its state
    class and stamp, and the checks that hold for every pipeline with such a
    stage (those that need the stage's arguments are made on load)."""

    name: str
    kind: str
    parallel: bool
    world_size: int
    counted: bool

    @property
    def State(self) -> Any:  # the CentralNode attribute check_pipeline reads
        cls = Parallel if self.parallel else NODE_CLASSES.get(self.kind)
        return None if cls is None else cls.State

    @property
    def stamped(self) -> bool:
        return self.kind in STAMPED_KINDS and not self.parallel

    def check_state(self, state: Any, states: Mapping[str, Any]) -> None:
        if self.kind == SHARD_KIND:  # its equalize mode is not in the checkpoint: any
            check_shard_state(state, ANY_EQUALIZE, world_size=self.world_size, counted=self.counted)

    def max_items_out(self, state: Any, bound_in: int | None) -> int | None:
        return None


def _declared(ckpt: checkpoint.Checkpoint) -> checkpoint.Expected:
    """What loading ``ckpt`` would check it against, as far as the checkpoint
    tells: its stages' kinds, its boundaries, its rank."""
    fp = [list(pair) for pair in ckpt.fingerprint]
    tip = _tip_boundary(fp)
    names = [name for name, _ in fp if name in ckpt.central]
    kinds = dict((name, kind) for name, kind in fp)
    parallel = [name for name in names if name in ckpt.in_flight and name != tip]
    nodes: list[_Declared] = []
    for name in names:
        counted = any(n.kind == "count" and n.stamped for n in nodes)
        world = ckpt.distributed.world_size
        nodes.append(_Declared(name, kinds[name], name in parallel, world, counted))
    at = next((k for k, (_, kind) in enumerate(fp) if kind == "dispatch"), len(fp))
    workers = [kind for _, kind in fp[at + 1 :]]
    return checkpoint.Expected(
        fingerprint=fp,
        seed=ckpt.seed,
        rank=ckpt.distributed.rank,
        world_size=ckpt.distributed.world_size,
        nodes=nodes,
        boundaries=[*parallel, tip],
        tip=tip,
        stamped=[n for n in nodes if n.stamped],
        multi_output=any(
            k not in WORKER_KINDS or WORKER_KINDS[k].outputs == "any" for k in workers
        ),
        length=None,
        segments={
            name: (
                [n for n in nodes[: names.index(name)] if n.stamped],
                kinds[name] == "flat_map",
            )
            for name in parallel
        },
    )


class _Rank:
    """What the merge reads from one rank's state: its typed checkpoint, and
    its wire dict (the global state is built on the furthest-behind rank's)."""

    def __init__(self, i: int, sd: Mapping[str, Any], ckpt: model.Checkpoint) -> None:
        self.i = i
        self.sd = sd
        self.rank = ckpt.distributed.rank
        self.world_size = ckpt.distributed.world_size
        self.fingerprint = [list(x) for x in ckpt.fingerprint]
        self.seed = ckpt.seed
        self.epoch = ckpt.epoch
        self.finished = ckpt.finished
        self.central = ckpt.central
        self.boundary = _tip_boundary(self.fingerprint)
        flight = ckpt.in_flight[self.boundary]
        self.first_seq = flight.first_seq
        self.items = flight.items
        self.stamps = flight.stamps
        self.skip_outputs = flight.skip_outputs
        self.poison = set(flight.skip)
        self.delivered_stamp = ckpt.delivered_stamp
        self.delivered = ckpt.position.delivered if model.has_step_count(sd) else self.first_seq


def _already_global(
    states: Sequence[Mapping[str, Any]], ckpts: list[model.Checkpoint], merged: list[bool]
) -> dict[str, Any]:
    # Every rank that loaded one global state and has not moved since reports it.
    if not all(merged):
        msg = (
            f"states[{merged.index(True)}] is already a global state (from merge_states) and "
            f"states[{merged.index(False)}] is a rank's own state: merge only the state_dict()s "
            "of the ranks of one job."
        )
        raise CheckpointError(msg)
    first = ckpts[0]
    for i, ckpt in enumerate(ckpts[1:], 1):
        if ckpt.central != first.central or ckpt.epoch != first.epoch:
            msg = f"states[0] and states[{i}] are different global states."
            raise CheckpointError(msg)
    return copy.copy(dict(states[0]))


def _check_same_job(ranks: list[_Rank]) -> None:
    first = ranks[0]
    for r in ranks[1:]:
        for what, a, b in (
            ("pipelines", first.fingerprint, r.fingerprint),
            ("seeds", first.seed, r.seed),
            ("world sizes", first.world_size, r.world_size),
            ("epochs", first.epoch, r.epoch),
        ):
            if a != b:
                msg = (
                    f"states of different {what}: states[0] (rank {first.rank}) has {a!r}, "
                    f"states[{r.i}] (rank {r.rank}) has {b!r}; merge the states of one job, "
                    "all taken after the same step."
                )
                raise CheckpointError(msg)
    world = first.world_size
    seen: dict[int, int] = {}
    for r in ranks:
        if not 0 <= r.rank < world:
            msg = f"states[{r.i}] is of rank {r.rank}, outside world size {world}."
            raise CheckpointError(msg)
        if r.rank in seen:
            msg = (
                f"rank {r.rank} appears twice (states[{seen[r.rank]}] and states[{r.i}]); "
                "merge_states needs each rank's state exactly once."
            )
            raise CheckpointError(msg)
        seen[r.rank] = r.i
    missing = sorted(set(range(world)) - set(seen))
    if missing:
        msg = (
            f"incomplete set: got the states of ranks {sorted(seen)} of world size {world}, "
            f"missing ranks {missing}; merge_states needs the state of every rank."
        )
        raise CheckpointError(msg)
    running = [r for r in ranks if not r.finished]
    steps = {r.delivered for r in running}
    late = [r for r in ranks if r.finished and running and r.delivered > min(steps)]
    if len(steps) > 1 or late:
        shown = ", ".join(f"rank {r.rank} after {r.delivered}" for r in sorted(ranks, key=_by_rank))
        msg = (
            f"states taken after different numbers of steps ({shown} items this epoch); "
            "merge_states needs every rank's state from the same step."
        )
        raise CheckpointError(msg)
    for r in ranks:
        if r.skip_outputs:
            msg = (
                f"rank {r.rank} was part-way through the outputs of one item (a worker "
                f"flat_map had delivered {r.skip_outputs} of them): such a state cannot be "
                "merged; take the checkpoint at a step where each rank has received every "
                "output of its last item."
            )
            raise CheckpointError(msg)


def _by_rank(r: _Rank) -> int:
    return r.rank


def _shard_layout(r: _Rank) -> tuple[str, int]:
    """The shard stage's name and its slot in a stamp; refuses pipelines that
    cannot be resumed elastically."""
    central = [name for name, _ in r.fingerprint if name in r.central]
    kinds = dict((name, kind) for name, kind in r.fingerprint)
    shards = [name for name in central if kinds[name] == SHARD_KIND]
    if not shards:
        msg = (
            "this pipeline has no shard(): every rank runs the whole stream, so there is "
            "nothing to merge; each rank resumes its own state (elastic resume needs "
            "shard() after the stateful central stages)."
        )
        raise CheckpointError(msg)
    shard = shards[0]
    after = central[central.index(shard) + 1 :]
    if after:
        name = after[0]
        msg = (
            f"this pipeline cannot be resumed elastically: central stage '{name}' "
            f"({kinds[name]}) comes after shard() '{shard}'. Its state and its in-flight "
            "outputs belong to one rank's slice of the stream; elastic resume needs shard() "
            "to be the last central stage (move a stateless map after dispatch(), where it "
            "runs in the workers, and stateful stages before shard())."
        )
        raise CheckpointError(msg)
    stamped = [name for name in central if kinds[name] in STAMPED_KINDS]
    return shard, stamped.index(shard)


def _arrival(stamp: Any, slot: int) -> list[list[Any]] | None:
    """The count totals an in-flight item arrived at the shard with."""
    if stamp is None:
        return None
    entry = stamp[slot]
    if isinstance(entry, (list, tuple)) and len(entry) > 1:
        return [list(pair) for pair in entry[1:]]
    return None


def _merge(ranks: list[_Rank]) -> dict[str, Any]:
    ranks = sorted(ranks, key=_by_rank)
    shard_name, slot = _shard_layout(ranks[0])
    world = ranks[0].world_size
    shards = [r.central[shard_name] for r in ranks]
    bases = {int(s.get("base", 0)) for s in shards}
    if len(bases) > 1:
        msg = f"states of different runs: their shards started at positions {sorted(bases)}."
        raise CheckpointError(msg)
    base = bases.pop()
    index = [int(s["index"]) for s in shards]
    m = min(range(world), key=lambda r: (index[r], r))
    behind, c = shards[m], index[m]
    counted = _counted(ranks[0], shard_name)

    def position(rank: int, seq: int) -> int:
        return base + seq * world + rank

    def delivered(p: int) -> bool:
        owner = (p - base) % world
        return (p - base) // world < ranks[owner].first_seq

    # Items before c that no rank delivered: in flight on their own rank ...
    pending: dict[int, tuple[Any, Any]] = {}
    for r in ranks:
        stamps = r.stamps or [None] * len(r.items)
        for k, (item, stamp) in enumerate(zip(r.items, stamps)):
            seq = r.first_seq + k
            p = position(r.rank, seq)
            if p < c and seq not in r.poison:  # a poison item was skipped: delivered as nothing
                pending[p] = (item, _arrival(stamp, slot))
    # ... or held in the furthest-behind rank's equalize round.
    rnd = compact.decode_items(behind.get("round", []))
    rnd_stamps = list(behind.get("round_stamps", ()))
    start = c - len(rnd)
    for t, item in enumerate(rnd):
        p = start + t
        if p not in pending and not delivered(p):
            pending[p] = (item, rnd_stamps[t] if t < len(rnd_stamps) else None)
    # A drop_last shard keeps the round it dropped at the end; in states from
    # before it did, that round is gone.
    lost_from = c - (c - base) % world if behind.get("done") else c
    # Items at c or later that a rank further ahead already delivered.
    ahead: set[int] = set()
    for r in ranks:
        s0 = max(0, -(-(c - base - r.rank) // world))
        ahead.update(position(r.rank, s) for s in range(s0, r.first_seq))
    # The rebuilt stream starts at the first item no rank delivered.
    first = c
    while first in ahead:
        first += 1
    first = min([first, *pending])
    for p in range(first, c):
        if p not in pending and not delivered(p) and p < lost_from:
            msg = (
                f"inconsistent states: central item {p} is neither delivered nor held by any "
                "rank; were they all taken after the same step of the same run?"
            )
            raise CheckpointError(msg)
    queue = compact.decode_items(behind.get("queue", []))
    queue_stamps = list(behind.get("queue_stamps", ()))
    gone = {p - c for p in ahead if p - c < len(queue)}
    drop = [int(x) for x in behind.get("drop", ())]
    source_index = int(behind.get("source_index", c))
    new_drop = [
        _source_number(p - c - len(queue), source_index, drop)
        for p in sorted(ahead)
        if p - c >= len(queue)
    ]
    order = sorted(pending)
    kept = [q for q in range(len(queue)) if q not in gone]
    stamps = [pending[p][1] for p in order] + [queue_stamps[q] for q in kept] if counted else []
    if any(s is None for s in stamps):
        raise CheckpointError("damaged states: an in-flight item has no count stamp.")
    shard_state: dict[str, Any] = {
        "index": first,
        "round": [],
        "done": False,
        "base": first,
        "queue": compact.encode_items([pending[p][0] for p in order] + [queue[q] for q in kept]),
        "queue_stamps": stamps,
        "round_stamps": [],
        "source_index": source_index,
        "drop": sorted(set(drop) | set(new_drop)),
    }
    src = ranks[m]
    return model.merged_wire(
        src.sd,
        boundary=src.boundary,
        central={**src.central, shard_name: shard_state},
        world_size=world,
        finished=all(r.finished for r in ranks),
        delivered_stamp=_delivered_stamp(ranks, slot, first, position),
        pre_shard_index=first,
    )


def _tip_boundary(fingerprint: list[list[str]]) -> str:
    """The name of the dispatch boundary, whose in-flight items are the rank's own."""
    return next((name for name, kind in fingerprint if kind == "dispatch"), "dispatch")


def _source_number(t: int, source_index: int, drop: list[int]) -> int:
    """The number of the source's ``t``-th item from ``source_index`` on,
    counting the ones ``drop`` discards."""
    n = source_index + t
    for d in sorted(drop):
        if d < source_index:
            continue
        if d <= n:
            n += 1
        else:
            break
    return n


def _delivered_stamp(ranks: list[_Rank], slot: int, first: int, position: Any) -> Any:
    """The stamp as of the last item any rank delivered (the global position)."""
    done = [r for r in ranks if r.first_seq > 0]
    src = max(done, key=lambda r: position(r.rank, r.first_seq - 1)) if done else ranks[0]
    stamp = src.delivered_stamp
    if stamp is None:
        return None
    out = list(stamp)
    entry = stamp[slot]
    if isinstance(entry, (list, tuple)):
        # The counts before the shard, as the last delivered item arrived there
        # (for that item they equal its delivered view).
        counts = [list(e) for e in stamp[:slot] if isinstance(e, (list, tuple))]
        out[slot] = [first, *counts]
    else:
        out[slot] = first
    return out


def _counted(r: _Rank, shard: str) -> bool:
    """Whether count stages precede the shard (items then carry arrival stamps)."""
    for name, kind in r.fingerprint:
        if name == shard:
            return False
        if kind == "count" and name in r.central:
            return True
    return False

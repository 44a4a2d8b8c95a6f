"""The checkpoint format and its validation.

A checkpoint is a plain dict of builtins (and whatever tensors the items hold),
safe for ``torch.save`` and ``torch.distributed.checkpoint``::

    {
      "format_version": 1,
      "fingerprint": [[stage name, kind], ...],   # the whole pipeline
      "seed": int, "epoch": int, "finished": bool,
      "distributed": {"rank": int, "world_size": int},
      "central": {stage name: that stage's own state, ...},
      "next_seq": int,                            # next dispatch index
      "in_flight": {"first_seq": int, "items": [...], "stamps": [...] | None,
                    "skip_outputs": int, "skip": [seq, ...]},
      "delivered_stamp": ... | None,              # count/shard totals as delivered
      "position": {"pre_shard_index": int | None},
    }

It describes the position after the last item the consumer received: the
central stages' state at the feeder's (possibly later) position plus the
inputs dispatched but not delivered, which a resume dispatches first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from centralpipe.errors import CheckpointError

__all__ = ["FORMAT_VERSION", "validate"]

FORMAT_VERSION = 1

_TOP: dict[str, type | tuple[type, ...]] = {
    "format_version": int,
    "fingerprint": list,
    "seed": int,
    "epoch": int,
    "finished": bool,
    "distributed": Mapping,
    "central": Mapping,
    "next_seq": int,
    "in_flight": Mapping,
}
_IN_FLIGHT: dict[str, type | tuple[type, ...]] = {
    "first_seq": int,
    "items": list,
    "skip_outputs": int,
    "skip": list,
}


def _type_name(t: type | tuple[type, ...]) -> str:
    return t.__name__ if isinstance(t, type) else " or ".join(x.__name__ for x in t)


def _check_keys(d: Mapping[str, Any], spec: dict[str, Any], where: str) -> None:
    for key, typ in spec.items():
        if key not in d:
            raise CheckpointError(f"damaged checkpoint: {where}missing key {key!r}.")
        value = d[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            msg = (
                f"damaged checkpoint: {where}{key!r} should be {_type_name(typ)}, "
                f"got {type(value).__name__}."
            )
            raise CheckpointError(msg)


def validate(
    sd: Any,
    *,
    fingerprint: list[list[str]],
    central_names: list[str],
    seed: int,
    rank: int,
    world_size: int,
) -> None:
    """Raise ``CheckpointError`` naming what is wrong or what differs."""
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"a checkpoint must be a dict, got {type(sd).__name__}.")
    version = sd.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        msg = (
            f"checkpoint format_version {version} is newer than this centralpipe reads "
            f"({FORMAT_VERSION}); upgrade centralpipe to resume it."
        )
        raise CheckpointError(msg)
    _check_keys(sd, _TOP, "")
    if sd["format_version"] < 1:
        raise CheckpointError(f"damaged checkpoint: format_version {sd['format_version']} < 1.")
    ckpt_fp = [list(x) if isinstance(x, (list, tuple)) else x for x in sd["fingerprint"]]
    if ckpt_fp != fingerprint:
        raise CheckpointError(_fingerprint_diff(ckpt_fp, fingerprint))
    if sd["seed"] != seed:
        msg = (
            f"checkpoint was taken with seed {sd['seed']}, this loader has seed {seed}; "
            "resuming would change the shuffle and with_rng streams."
        )
        raise CheckpointError(msg)
    dist = sd["distributed"]
    if dist.get("world_size") != world_size or dist.get("rank") != rank:
        msg = (
            f"checkpoint is of rank {dist.get('rank')} of {dist.get('world_size')}, this loader "
            f"is rank {rank} of {world_size}; resuming on another world size is not supported "
            "yet, and each rank must load its own checkpoint."
        )
        raise CheckpointError(msg)
    central = sd["central"]
    if sorted(central) != sorted(central_names):
        missing = [n for n in central_names if n not in central]
        extra = [n for n in central if n not in central_names]
        msg = f"damaged checkpoint: central states missing {missing}, unexpected {extra}."
        raise CheckpointError(msg)
    for name in central_names:
        if not isinstance(central[name], Mapping):
            msg = (
                f"damaged checkpoint: state of stage '{name}' should be a dict, "
                f"got {type(central[name]).__name__}."
            )
            raise CheckpointError(msg)
    in_flight = sd["in_flight"]
    _check_keys(in_flight, _IN_FLIGHT, "in_flight: ")
    stamps = in_flight.get("stamps")
    if stamps is not None and (
        not isinstance(stamps, list) or len(stamps) != len(in_flight["items"])
    ):
        raise CheckpointError("damaged checkpoint: in_flight stamps do not match its items.")
    if in_flight["first_seq"] + len(in_flight["items"]) > sd["next_seq"]:
        raise CheckpointError("damaged checkpoint: in_flight items go past next_seq.")
    if sd["epoch"] < 0 or sd["next_seq"] < 0 or in_flight["skip_outputs"] < 0:
        raise CheckpointError("damaged checkpoint: negative epoch, next_seq or skip_outputs.")


def _fingerprint_diff(ckpt: list[Any], current: list[list[str]]) -> str:
    for i, (a, b) in enumerate(zip(ckpt, current)):
        if a != b:
            name_a = a[0] if isinstance(a, list) and a else a
            return (
                f"checkpoint is of another pipeline: at position {i} the checkpoint has stage "
                f"'{name_a}' ({a[1] if isinstance(a, list) and len(a) > 1 else '?'}), this "
                f"pipeline has '{b[0]}' ({b[1]})."
            )
    if len(ckpt) != len(current):
        return (
            f"checkpoint is of another pipeline: it has {len(ckpt)} stages, this pipeline "
            f"has {len(current)}."
        )
    return "checkpoint is of another pipeline."  # pragma: no cover

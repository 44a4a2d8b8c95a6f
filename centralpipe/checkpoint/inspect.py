"""``python -m centralpipe inspect PATH``: a checkpoint file, summarised.

:func:`run` loads the file (``torch.load(weights_only=True)`` unless the user
trusts it), finds the checkpoint in it (itself, or once nested under a key),
and prints :func:`summarize_checked`: the facts of the typed model
(:class:`~centralpipe.checkpoint.model.Outline`), and, for a checkpoint that
does not pass the model, what can still be read of it and the damage, named
by key path (exit 1).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from centralpipe.checkpoint.model import Outline, structure, structure_state
from centralpipe.errors import CheckpointError

__all__ = ["run", "summarize", "summarize_checked"]

#: A value whose repr is at most this long is printed as is; longer ones are summarised.
SMALL_REPR = 60
#: The key that marks a dict as a checkpoint (found nested once inside a bigger dict).
_MARK = "format_version"


def run(path: str, *, unsafe_load: bool, prog: str) -> int:
    """Print the summary of the checkpoint in file ``path``; the exit status."""
    if not os.path.isfile(path):
        print(f"{prog} inspect: no such file: {path}", file=sys.stderr)
        return 1
    try:
        obj = torch.load(path, map_location="cpu", weights_only=not unsafe_load)
    except Exception as exc:
        hint = (
            ""
            if unsafe_load
            else " If the file is yours and holds items of your own classes, it needs pickle: "
            "rerun with --unsafe-load (it runs code from the file; only for files you trust)."
        )
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"{prog} inspect: cannot load {path}: {type(exc).__name__}: {first}{hint}",
            file=sys.stderr,
        )
        return 1
    sd, where = _find_state(obj)
    if sd is None:
        keys = ", ".join(repr(k) for k in list(obj)[:10]) if isinstance(obj, Mapping) else ""
        print(
            f"{prog} inspect: {path} holds no centralpipe checkpoint (a dict with "
            f"'{_MARK}'); found {type(obj).__name__}"
            + (f" with keys {keys}" if keys else "")
            + ". Save one with torch.save(loader.state_dict(), path).",
            file=sys.stderr,
        )
        return 1
    text, problem = summarize_checked(sd, source=f"{path} ({_size(os.path.getsize(path))})" + where)
    print(text)
    if problem:
        print(f"{prog} inspect: {problem}", file=sys.stderr)
        return 1
    return 0


def _find_state(obj: Any) -> tuple[Mapping[str, Any] | None, str]:
    """The checkpoint dict itself, or one nested (once) inside a bigger dict."""
    if isinstance(obj, Mapping):
        if _MARK in obj:
            return obj, ""
        for key, value in obj.items():
            if isinstance(value, Mapping) and _MARK in value:
                return value, f", under key {key!r}"
    return None, ""


def summarize_checked(sd: Mapping[str, Any], *, source: str = "") -> tuple[str, str]:
    """The summary of ``sd`` and, when it does not pass the checkpoint model
    (:mod:`centralpipe.checkpoint.model`), the reason (else ``""``)."""
    from centralpipe.stages import NODE_CLASSES

    try:
        ckpt = structure(sd)
        for name, kind in ckpt.fingerprint:
            cls = getattr(NODE_CLASSES.get(kind), "State", None)
            if cls is not None and name in ckpt.central:
                structure_state(ckpt.central[name], cls, name)
    except CheckpointError as exc:
        return summarize(Outline.loose(sd), source=source), str(exc)
    return summarize(Outline.of(ckpt), source=source), ""


def summarize(outline: Outline | Mapping[str, Any], *, source: str = "") -> str:
    """A readable, line-per-fact summary of a checkpoint (its outline, or a
    dict read leniently: damaged ones too)."""
    o = outline if isinstance(outline, Outline) else Outline.loose(outline)
    lines = [f"centralpipe checkpoint{': ' + source if source else ''}"]
    add = lines.append
    add(f"  format_version: {o.format_version!r}")
    state = "finished" if o.finished else "in progress" if o.finished is not None else "?"
    add(f"  epoch: {o.epoch!r} ({state})")
    if o.merged:
        add(
            f"  global state: merged from {o.world_size} ranks "
            "(cp.merge_states); loads on any world size"
        )
    else:
        add(f"  rank / world size: {o.rank} / {o.world_size}")
    add(f"  seed: {o.seed!r}")
    add(f"  pre_shard_index: {o.pre_shard_index!r}")
    if o.delivered is not None:
        add(f"  delivered this epoch: {o.delivered!r} items")
    for f in o.in_flight:
        add(
            f"  in-flight items at {f.name!r}: {f.items} (seqs from "
            f"{f.first_seq!r}, next_seq {f.next_seq!r}, "
            f"{f.skip_outputs!r} outputs of the first already delivered, "
            f"{'?' if f.skips is None else f.skips} to skip)"
        )
        if f.first:
            add(f"    first: {_short(f.first[0])}")
    if o.delivered_stamp is not None:
        add(f"  delivered stamp: {_short(o.delivered_stamp)}")
    kinds = {
        pair[0]: pair[1]
        for pair in o.fingerprint
        if isinstance(pair, (list, tuple)) and len(pair) == 2
    }
    add(f"  central stages ({len(o.central)}):")
    for name, stage_state in o.central.items():
        add(f"    {name} ({kinds.get(name, '?')}):" + ("" if stage_state else " no state"))
        if isinstance(stage_state, Mapping):
            for key, value in stage_state.items():
                add(f"      {key}: {_short(value)}")
        elif stage_state:
            add(f"      {_short(stage_state)}")
    # Stages inside a mix are named "<mix>/<source>/<stage>"; their states are in the mix's.
    mixes = tuple(f"{n}/" for n, k in kinds.items() if k == "mix")
    inside = [f"{n} ({k})" for n, k in kinds.items() if n not in o.central and n.startswith(mixes)]
    if inside:
        add(f"  stages inside mixes: {', '.join(inside)}")
    rest = [
        f"{n} ({k})" for n, k in kinds.items() if n not in o.central and not n.startswith(mixes)
    ]
    if rest:
        add(f"  dispatch and worker stages: {', '.join(rest)}")
    return "\n".join(lines)


def _short(value: Any) -> str:
    """``repr`` for small values; type and size for big ones."""
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    if len(text) <= SMALL_REPR:
        return text
    if isinstance(value, Mapping):
        return f"dict with {len(value)} keys: {', '.join(map(repr, list(value)[:5]))}" + (
            ", ..." if len(value) > 5 else ""
        )
    if isinstance(value, (list, tuple, set, frozenset, bytes, str)):
        return f"{type(value).__name__} of {len(value)}: {text[: SMALL_REPR - 20]}..."
    return f"{type(value).__name__}: {text[:SMALL_REPR]}..."


def _size(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} B"
    if nbytes < 1024**2:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{nbytes / 1024**2:.1f} MiB"

"""Command line: ``python -m centralpipe {bench,inspect,soak}``.

- ``bench``: throughput against torch's DataLoader and torchdata.nodes, and
  ``state_dict()`` latency (:mod:`centralpipe.tools.bench`); prints markdown.
- ``inspect PATH``: a readable summary of a checkpoint saved with ``torch.save``,
  checked against the checkpoint model; loads with ``weights_only=True`` unless
  ``--unsafe-load`` is given for a trusted file.
- ``soak``: long-running robustness run (:mod:`centralpipe.tools.soak`); its options
  are its own, passed through unchanged.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["main"]

#: A value whose repr is at most this long is printed as is; longer ones are summarised.
SMALL_REPR = 60
PROG = "python -m centralpipe"


def _parser() -> argparse.ArgumentParser:
    from centralpipe.tools import bench

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="centralpipe: PyTorch data loading with stateful stages in the main process.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    b = sub.add_parser(
        "bench",
        help="throughput vs DataLoader and ParallelMapper, and state_dict() latency",
        description=(
            "Compare centralpipe with torch's DataLoader and torchdata.nodes.ParallelMapper "
            "on the same workloads in one process, and time state_dict(); prints markdown "
            "(progress on stderr). A full run takes a few minutes on 2 cores."
        ),
    )
    bench.add_arguments(b)
    i = sub.add_parser(
        "inspect",
        help="summarise and check a checkpoint file",
        description=(
            "Print a summary of a checkpoint written with torch.save(loader.state_dict(), PATH) "
            "(or of a dict holding one) and check it against the checkpoint format; exits 1 "
            "if it is damaged. The file is loaded with torch.load(weights_only=True), which "
            "runs no code from it."
        ),
    )
    i.add_argument("path", help="checkpoint file")
    i.add_argument(
        "--unsafe-load",
        action="store_true",
        help=(
            "load with torch.load(weights_only=False), for checkpoints whose in-flight items "
            "are objects of your own classes. This runs pickle, which can run any code the "
            "file holds: only for files you trust."
        ),
    )
    sub.add_parser(
        "soak",
        help="long robustness run (options: soak --help)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "soak":
        return _soak(args_list[1:])
    parser = _parser()
    args = parser.parse_args(args_list)
    if args.command == "bench":
        from centralpipe.tools import bench

        return bench.main(args, args_list[1:])
    if args.command == "inspect":
        return _quiet_on_closed_pipe(lambda: _inspect(args.path, unsafe_load=args.unsafe_load))
    parser.print_help()
    return 0


def _quiet_on_closed_pipe(command: Callable[[], int]) -> int:
    """Run ``command``; a reader that went away (``| head``) ends it quietly."""
    try:
        code = command()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that
        # flush does not fail (and print a traceback) too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    return code


# -- soak ---------------------------------------------------------------------------------


def _soak(argv: list[str]) -> int:
    try:
        soak = importlib.import_module("centralpipe.tools.soak")
    except ModuleNotFoundError as exc:
        if exc.name != "centralpipe.tools.soak":
            raise
        print(
            f"{PROG} soak: this installation has no soak command (module centralpipe.tools.soak is "
            "missing); install a centralpipe version that includes it.",
            file=sys.stderr,
        )
        return 2
    code = soak.main(argv)
    return code if isinstance(code, int) else 0


# -- inspect ------------------------------------------------------------------------------


def _inspect(path: str, *, unsafe_load: bool) -> int:
    import torch

    if not os.path.isfile(path):
        print(f"{PROG} inspect: no such file: {path}", file=sys.stderr)
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
            f"{PROG} inspect: cannot load {path}: {type(exc).__name__}: {first}{hint}",
            file=sys.stderr,
        )
        return 1
    sd, where = _find_state(obj)
    if sd is None:
        keys = ", ".join(repr(k) for k in list(obj)[:10]) if isinstance(obj, Mapping) else ""
        print(
            f"{PROG} inspect: {path} holds no centralpipe checkpoint (a dict with "
            f"'format_version'); found {type(obj).__name__}"
            + (f" with keys {keys}" if keys else "")
            + ". Save one with torch.save(loader.state_dict(), path).",
            file=sys.stderr,
        )
        return 1
    text, problem = summarize_checked(sd, source=f"{path} ({_size(os.path.getsize(path))})" + where)
    print(text)
    if problem:
        print(f"{PROG} inspect: {problem}", file=sys.stderr)
        return 1
    return 0


def _find_state(obj: Any) -> tuple[Mapping[str, Any] | None, str]:
    """The checkpoint dict itself, or one nested (once) inside a bigger dict."""
    if isinstance(obj, Mapping):
        if "format_version" in obj:
            return obj, ""
        for key, value in obj.items():
            if isinstance(value, Mapping) and "format_version" in value:
                return value, f", under key {key!r}"
    return None, ""


def summarize_checked(sd: Mapping[str, Any], *, source: str = "") -> tuple[str, str]:
    """The summary of ``sd`` and, when it does not pass the checkpoint model
    (:mod:`centralpipe.checkpoint`), the reason (else ``""``)."""
    from centralpipe import checkpoint
    from centralpipe.errors import CheckpointError
    from centralpipe.stages import NODE_CLASSES

    try:
        ckpt = checkpoint.structure(sd)
        for name, kind in ckpt.fingerprint:
            cls = getattr(NODE_CLASSES.get(kind), "State", None)
            if cls is not None and name in ckpt.central:
                checkpoint.structure_state(ckpt.central[name], cls, name)
    except CheckpointError as exc:
        return summarize(sd, source=source), str(exc)
    return summarize(sd, source=source), ""


def summarize(sd: Mapping[str, Any], *, source: str = "") -> str:
    """A readable, line-per-fact summary of a checkpoint dict (damaged ones too)."""
    lines = [f"centralpipe checkpoint{': ' + source if source else ''}"]
    add = lines.append
    add(f"  format_version: {sd.get('format_version')!r}")
    finished = sd.get("finished")
    state = "finished" if finished else "in progress" if finished is not None else "?"
    add(f"  epoch: {sd.get('epoch')!r} ({state})")
    dist = _mapping(sd.get("distributed"))
    if dist.get("merged"):
        add(
            f"  global state: merged from {dist.get('world_size', '?')} ranks "
            "(cp.merge_states); loads on any world size"
        )
    else:
        add(f"  rank / world size: {dist.get('rank', '?')} / {dist.get('world_size', '?')}")
    add(f"  seed: {sd.get('seed')!r}")
    position = _mapping(sd.get("position"))
    add(f"  pre_shard_index: {position.get('pre_shard_index')!r}")
    if "delivered" in position:
        add(f"  delivered this epoch: {position['delivered']!r} items")
    for boundary, raw in _mapping(sd.get("in_flight")).items():
        flight = _mapping(raw)
        items = flight.get("items")
        items = items if isinstance(items, (list, tuple)) else []
        skip = flight.get("skip")
        add(
            f"  in-flight items at {boundary!r}: {len(items)} (seqs from "
            f"{flight.get('first_seq')!r}, next_seq {flight.get('next_seq')!r}, "
            f"{flight.get('skip_outputs', 0)!r} outputs of the first already delivered, "
            f"{len(skip) if isinstance(skip, (list, tuple)) else '?'} to skip)"
        )
        if items:
            add(f"    first: {_short(items[0])}")
    if sd.get("delivered_stamp") is not None:
        add(f"  delivered stamp: {_short(sd['delivered_stamp'])}")
    fingerprint = sd.get("fingerprint")
    kinds = {
        pair[0]: pair[1]
        for pair in (fingerprint if isinstance(fingerprint, (list, tuple)) else [])
        if isinstance(pair, (list, tuple)) and len(pair) == 2
    }
    central = _mapping(sd.get("central"))
    add(f"  central stages ({len(central)}):")
    for name, stage_state in central.items():
        add(f"    {name} ({kinds.get(name, '?')}):" + ("" if stage_state else " no state"))
        if isinstance(stage_state, Mapping):
            for key, value in stage_state.items():
                add(f"      {key}: {_short(value)}")
        elif stage_state:
            add(f"      {_short(stage_state)}")
    # Stages inside a mix are named "<mix>/<source>/<stage>"; their states are in the mix's.
    mixes = tuple(f"{n}/" for n, k in kinds.items() if k == "mix")
    inside = [f"{n} ({k})" for n, k in kinds.items() if n not in central and n.startswith(mixes)]
    if inside:
        add(f"  stages inside mixes: {', '.join(inside)}")
    rest = [f"{n} ({k})" for n, k in kinds.items() if n not in central and not n.startswith(mixes)]
    if rest:
        add(f"  dispatch and worker stages: {', '.join(rest)}")
    return "\n".join(lines)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _short(value: Any) -> str:
    """``repr`` for small values; type and size for big ones."""
    try:
        import torch

        if isinstance(value, torch.Tensor):
            return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
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


if __name__ == "__main__":
    sys.exit(main())

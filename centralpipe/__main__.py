"""Command line: ``python -m centralpipe {bench,inspect,soak}``.

- ``bench``: throughput against torch's DataLoader and torchdata.nodes, and
  ``state_dict()`` latency (:mod:`centralpipe.tools.bench`); prints markdown.
- ``inspect PATH``: a readable summary of a checkpoint saved with ``torch.save``,
  checked against the checkpoint model; loads with ``weights_only=True`` unless
  ``--unsafe-load`` is given for a trusted file
  (:mod:`centralpipe.checkpoint.inspect`).
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
    from centralpipe.checkpoint import inspect

    return inspect.run(path, unsafe_load=unsafe_load, prog=PROG)


def summarize_checked(sd: Mapping[str, Any], *, source: str = "") -> tuple[str, str]:
    """:func:`centralpipe.checkpoint.inspect.summarize_checked`."""
    from centralpipe.checkpoint import inspect

    return inspect.summarize_checked(sd, source=source)


if __name__ == "__main__":
    sys.exit(main())

"""Quickstart: build a pipeline, checkpoint it mid-epoch, resume in a fresh Loader.

The pipeline shuffles 1000 integers, counts them before batching, makes
batches of 8, and in the worker stages collates each batch into a tensor and
adds seeded noise. The example reads part of an epoch, saves ``state_dict()``
with ``torch.save``, loads it into a *new* Loader (optionally with another
number of workers) and checks that the two halves together equal an
uninterrupted run, tensor for tensor.

    python examples/quickstart.py                    # num_workers=0 (inline)
    python examples/quickstart.py --workers 2        # two worker processes
    python examples/quickstart.py --workers 2 --resume-workers 0

Worker-stage functions are defined at module level and the script body is
under ``if __name__ == "__main__":``, so the example works with every start
method (the default is forkserver where available, else spawn).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import centralpipe as cp

NUM_ITEMS = 1000
SHUFFLE_BUFFER = 100
BATCH_SIZE = 8
SEED = 1234


def add_noise(batch: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """Worker stage with randomness: ``rng`` is seeded from (seed, epoch, seq,
    stage name), so the result does not depend on which worker ran it."""
    return batch * 100 + torch.randint(0, 100, batch.shape, generator=rng)


def build_pipeline() -> cp.Pipeline:
    return (
        cp.Pipeline.from_iterable(range(NUM_ITEMS))  # a sequence: resumes by index
        .shuffle(SHUFFLE_BUFFER)  # central, stateful: buffer + generator are checkpointed
        .count("seen")  # central counter, queryable with loader.query("seen")
        .batch(BATCH_SIZE)  # central: lists of 8 ints
        .dispatch()  # everything below runs in the workers (or inline)
        .collate()  # list of ints -> tensor
        .map(add_noise, with_rng=True)
    )


def make_config(num_workers: int) -> cp.LoaderConfig:
    return cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=num_workers), seed=SEED)


def run_uninterrupted(num_workers: int) -> list[torch.Tensor]:
    with cp.Loader(build_pipeline(), make_config(num_workers)) as loader:
        batches = list(loader)
        # len() is known without iterating here: a sequence source, then
        # stages whose output count follows from their input count.
        print(f"uninterrupted run: {len(batches)} batches (len(loader) = {len(loader)})")
        return batches


def run_until_checkpoint(num_workers: int, stop_after: int, path: str) -> list[torch.Tensor]:
    """Read ``stop_after`` batches, then save a checkpoint to ``path``."""
    with cp.Loader(build_pipeline(), make_config(num_workers)) as loader:
        it = iter(loader)
        before = [next(it) for _ in range(stop_after)]
        # The live count runs ahead by what the feeder has already dispatched;
        # delivered=True is exact as of the last batch received.
        live = loader.query("seen")
        delivered = loader.query("seen", delivered=True)
        print(
            f"epoch {loader.epoch}: {len(before)} batches received; "
            f"'seen' delivered={delivered['items']} items, live={live['items']} items"
        )
        torch.save(loader.state_dict(), path)
    return before


def run_after_checkpoint(num_workers: int, path: str) -> list[torch.Tensor]:
    """A fresh Loader that resumes from the checkpoint at ``path``."""
    state = torch.load(path, weights_only=True)  # builtins and tensors only
    with cp.Loader(build_pipeline(), make_config(num_workers)) as loader:
        loader.load_state_dict(state)
        return list(loader)  # the rest of the same epoch


def same_batches(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=0, help="worker processes (default 0)")
    parser.add_argument(
        "--resume-workers",
        type=int,
        default=None,
        help="worker processes after resuming (default: same as --workers)",
    )
    parser.add_argument(
        "--stop-after", type=int, default=60, help="batches to read before the checkpoint"
    )
    args = parser.parse_args(argv)
    resume_workers = args.workers if args.resume_workers is None else args.resume_workers
    num_batches = -(-NUM_ITEMS // BATCH_SIZE)
    if not 0 <= args.stop_after <= num_batches:
        parser.error(f"--stop-after must be in [0, {num_batches}], got {args.stop_after}")

    full = run_uninterrupted(args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "loader.pt")
        before = run_until_checkpoint(args.workers, args.stop_after, path)
        after = run_after_checkpoint(resume_workers, path)

    combined = before + after
    if not same_batches(combined, full):
        print(
            f"MISMATCH: {len(before)} batches before the checkpoint + {len(after)} after "
            f"= {len(combined)}, but the uninterrupted run has {len(full)}",
            file=sys.stderr,
        )
        return 1
    print(
        f"resumed exactly: {len(before)} batches before the checkpoint + {len(after)} after "
        f"= {len(combined)} = uninterrupted run"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

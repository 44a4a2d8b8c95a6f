"""The motivating pipeline: token buckets, sharded, checkpointed and resumed.

Lines of a text corpus are tokenized and bucketed into batches of at most
``--max-tokens`` tokens from a 50k-line buffer, counted before sharding (the
progress bar's value), split across ranks, and padded into ``LongTensor``
batches by worker processes. The script then shows that a checkpoint taken
half-way through the epoch resumes exactly::

    python examples/token_buckets.py --workers 2
    python examples/token_buckets.py --workers 0 --buffer-size unlimited
    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=29533 examples/token_buckets.py --workers 2 --distributed
    python -m torch.distributed.run --nproc_per_node=2 --master_addr=127.0.0.1 \\
        --master_port=29533 examples/token_buckets.py --workers 2 --distributed --central node

It exits with status 1 if the resumed run differs from the uninterrupted one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import attrs
import numpy as np
import torch

import centralpipe as cp

DATA_GLOB = str(Path(__file__).resolve().parent / "data" / "*.txt")
VOCAB_SIZE = 32_000
PAD_ID = 0
BUCKET_BUFFER = 50_000


def tokenize(line: str) -> np.ndarray:
    """A toy tokenizer: whitespace words to ids in ``[1, VOCAB_SIZE)``, by a
    stable hash (``hash()`` is salted per process; ``crc32`` is not).

    It returns an ``int32`` numpy array, the fast form: a chunk of arrays
    comes back from the workers as one buffer plus offsets (not one pickle per
    line), buckets of them go to ``collate_pad`` the same way, and the
    checkpoint holds the 50k-line bucket buffer as one flat tensor. (A real
    tokenizer: ``np.array(tok.encode(line).ids, dtype=np.int32)``, or
    ``encode_batch`` with ``map(..., batched=True)`` and thread workers.)"""
    ids = [1 + zlib.crc32(word.encode("utf-8")) % (VOCAB_SIZE - 1) for word in line.split()]
    return np.array(ids, dtype=np.int32)


def collate_pad(batch: list[np.ndarray]) -> torch.Tensor:
    """Pad token arrays with ``PAD_ID`` into a ``LongTensor`` ``[batch, longest]``."""
    longest = max(len(seq) for seq in batch)
    out = torch.full((len(batch), longest), PAD_ID, dtype=torch.long)
    for row, seq in enumerate(batch):
        out[row, : len(seq)] = torch.from_numpy(seq)
    return out


def build_pipeline(data: str, max_tokens: int) -> cp.Pipeline:
    return (
        cp.Pipeline.from_files(data)
        .read_lines()
        .map(tokenize, parallel=True)  # in the workers; outputs come back in order
        # min_len=1: blank lines tokenize to nothing and are dropped here.
        .bucket_by_max_tokens(max_tokens, len_fn=len, buffer_size=BUCKET_BUFFER, min_len=1)
        .count("pre_shard", weight_fn=len)  # sequences, summed over all ranks
        .shard(equalize="drop_last")
        .dispatch()
        .map(collate_pad)
    )


def count_sequences(data: str) -> int:
    """Non-blank lines of the corpus: the pre-shard count at the end of an epoch."""
    import glob

    total = 0
    for path in sorted(glob.glob(data)):
        text = Path(path).read_text(encoding="utf-8")
        total += sum(1 for line in text.split("\n") if line.split())
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--buffer-size",
        type=buffer_size,
        default=argparse.SUPPRESS,
        help="most batches dispatched but not yet delivered: an int or 'unlimited' "
        "(default: centralpipe's default bound)",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="take rank and world size from torchrun (DistributedConfig.from_env())",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="checkpoint file (default: a temporary file); under torchrun each rank "
        "writes PATH with '.rank<r>' added",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=1024, help="tokens per batch at most (default 1024)"
    )
    parser.add_argument("--data", default=DATA_GLOB, help="corpus glob (default: examples/data)")
    parser.add_argument(
        "--central",
        choices=("process", "service", "node"),
        default="process",
        help="where the central stages run (default: this process; 'node': once per node, "
        "shared by torchrun's local ranks)",
    )
    parser.add_argument(
        "--start-method",
        choices=("fork", "forkserver", "spawn"),
        default=None,
        help="worker start method (default: centralpipe's, forkserver on Linux)",
    )
    return parser.parse_args(argv)


def buffer_size(text: str) -> int | None:
    """``--buffer-size``: an int >= 1, or ``unlimited`` (``None``)."""
    if text == "unlimited":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or 'unlimited', got {text!r}")
    return value


def distributed_config(enabled: bool) -> cp.DistributedConfig:
    if not enabled:
        return cp.DistributedConfig()
    launched = all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
    if launched:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
    # The process group (if any) first, then RANK/WORLD_SIZE, else rank 0 of 1.
    return cp.DistributedConfig.from_env()


def checkpoint_path(given: Path | None, tmp: str, dist: cp.DistributedConfig) -> Path:
    path = given if given is not None else Path(tmp) / "token_buckets.pt"
    if dist.world_size > 1:
        path = path.with_name(f"{path.name}.rank{dist.rank}")
    return path


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dist = distributed_config(args.distributed)
    where = f"rank {dist.rank}/{dist.world_size}"
    prefix = f"[rank {dist.rank}] " if dist.world_size > 1 else ""

    def say(text: str) -> None:
        print(prefix + text, flush=True)

    workers = cp.WorkerConfig(num_workers=args.workers, start_method=args.start_method)
    if "buffer_size" in vars(args):
        workers = attrs.evolve(workers, buffer_size=args.buffer_size)
    config = cp.LoaderConfig(workers=workers, distributed=dist, central=args.central)
    pipe = build_pipeline(args.data, args.max_tokens)
    # The bar's end. loader.total("pre_shard", weight=True) knows only an upper
    # bound here (the lines of the files): min_len=1 drops the blank ones, so
    # they are counted once instead. Without min_len, cp.progress would take
    # the exact total from the pipeline itself.
    total = count_sequences(args.data)
    if dist.rank == 0:
        say(f"pipeline ({args.workers} workers, buffer {workers.buffer_size or 'unlimited'}):")
        for line in pipe.describe().splitlines():
            say("  " + line)

    with tempfile.TemporaryDirectory(prefix="token_buckets-") as tmp:
        path = checkpoint_path(args.checkpoint, tmp, dist)
        started = time.perf_counter()

        # 1. The uninterrupted epoch, for reference.
        with cp.Loader[torch.Tensor](pipe, config) as loader:
            full = list(loader)
            high_water = loader.metrics()["dispatch"]["buffer_high_water"]
        stop_at = max(1, len(full) // 2)

        # 2. Train with the pre-shard progress bar; stop half-way and checkpoint.
        head: list[torch.Tensor] = []
        with cp.Loader[torch.Tensor](pipe, config) as loader:
            batches = cp.progress(loader, total=total, unit="seq", desc=f"{prefix}epoch 1")
            for batch in batches:
                head.append(batch)
                if len(head) == stop_at:
                    break
            batches.close()  # ends the generator: the bar shows the exact value and closes
            seen = loader.query("pre_shard", delivered=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(loader.state_dict(), path)
        say(
            f"checkpoint: saved at batch {len(head)} to {path} ({path.stat().st_size} bytes); "
            f"pre-shard: {seen['weight']}/{total} sequences in {seen['items']} batches"
        )

        # 3. A fresh loader (as after a restart) resumes from the file.
        tail: list[torch.Tensor] = []
        with cp.Loader[torch.Tensor](pipe, config) as loader:
            # Builtins and tensors only, so the safe loader reads it.
            loader.load_state_dict(torch.load(path, weights_only=True))
            for batch in cp.progress(loader, total=total, unit="seq", desc=f"{prefix}resumed"):
                tail.append(batch)
            done = loader.query("pre_shard", delivered=True)
        elapsed = time.perf_counter() - started

    tokens = sum(int((b != PAD_ID).sum()) for b in full)
    padded = sum(b.numel() for b in full)
    say(
        f"epoch: {len(full)} batches on this rank, {tokens} tokens "
        f"({tokens / max(padded, 1):.0%} of padded), pre-shard {done['weight']} sequences "
        f"in {done['items']} batches; buffer high-water {high_water} batches; "
        f"3 passes in {elapsed:.1f} s"
    )
    if not same(head + tail, full):
        say(
            f"resume MISMATCH: {len(head)} batches before the checkpoint + {len(tail)} after "
            f"differ from the uninterrupted run of {len(full)} ({where}, {args.workers} workers)"
        )
        return 1
    say(
        f"resumed exactly: {len(head)} batches before the checkpoint + {len(tail)} after = "
        f"{len(full)} = uninterrupted run ({where}, {args.workers} workers)"
    )
    return 0


if __name__ == "__main__":
    code = main()
    if "torch.distributed" in sys.modules:
        import torch.distributed as torch_dist

        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
    sys.exit(code)

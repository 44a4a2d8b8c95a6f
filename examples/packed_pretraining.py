"""A packed pre-training pipeline, end to end: mixed, packed, checkpointed, resumed.

The bundled corpus is split into two "corpora" (``web``: the first half of its
files, ``books``: the rest), mixed by weight (``Pipeline.mix``), tokenized,
truncated to ``--max-tokens`` and packed (``best_fit`` by default) into rows of
at most ``--max-tokens`` tokens; rows are batched and counted before sharding.
Worker processes turn each row into ``tokens``, ``segment_ids`` and
``positions`` (``cp.packing.segments``), and the training step builds a
block-diagonal causal mask from the segment ids, so no sequence attends into
another. The script prints the packer's fill rate and the known totals, shows
that a checkpoint taken half-way resumes exactly, and then resumes the same
checkpoint under new mixture weights::

    python examples/packed_pretraining.py --workers 2
    python examples/packed_pretraining.py --strategy first_fit --workers 0

It exits with status 1 if the resumed run differs from the uninterrupted one,
or if the run under new weights loses or repeats a line.
"""

from __future__ import annotations

import argparse
import functools
import glob
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch

import centralpipe as cp

DATA_GLOB = str(Path(__file__).resolve().parent / "data" / "*.txt")
VOCAB_SIZE = 32_000
PAD_ID = 0
ROWS_PER_BATCH = 8
PACK_BUFFER = 4096
WEIGHTS = {"web": 0.7, "books": 0.3}
NEW_WEIGHTS = {"web": 0.2, "books": 0.8}

Batch = dict[str, torch.Tensor]


def tokenize(line: str) -> list[int]:
    """A toy tokenizer: whitespace words to ids in ``[1, VOCAB_SIZE)``, by a stable hash."""
    return [1 + zlib.crc32(word.encode("utf-8")) % (VOCAB_SIZE - 1) for word in line.split()]


def truncate(tokens: list[int], max_tokens: int) -> list[int]:
    return tokens[:max_tokens]


def collate_packed(rows: list[list[list[int]]], max_tokens: int) -> Batch:
    """Rows of packed sequences to ``[rows, max_tokens]`` tensors (padded)."""
    parts = [cp.packing.segments(row, pad_to=max_tokens, pad_id=PAD_ID) for row in rows]
    return {
        key: torch.stack([p[key] for p in parts]) for key in ("tokens", "segment_ids", "positions")
    }


def corpus(paths: list[str], max_tokens: int) -> cp.Pipeline:
    """One corpus: its lines, tokenized, blank lines dropped, truncated."""
    return (
        cp.Pipeline.from_files(paths)
        .read_lines(name="lines")  # queried as "mix/<corpus>/lines"
        .map(tokenize, name="tokenize")
        .filter(bool, name="non_blank")  # blank lines tokenize to nothing
        .map(functools.partial(truncate, max_tokens=max_tokens), name="truncate")
    )


def build_pipeline(
    data: str, max_tokens: int, strategy: str, weights: dict[str, float]
) -> cp.Pipeline:
    paths = sorted(glob.glob(data))
    half = max(1, len(paths) // 2)
    corpora = {"web": corpus(paths[:half], max_tokens), "books": corpus(paths[half:], max_tokens)}
    return (
        cp.Pipeline.mix(corpora, weights, stop="all_exhausted", name="mix")
        .pack(max_tokens, strategy=strategy, buffer_size=PACK_BUFFER, name="pack")
        .batch(ROWS_PER_BATCH)
        .count("pre_shard", weight_fn=len)  # packed rows, summed over all ranks
        .shard(equalize="drop_last")
        .dispatch()
        .map(functools.partial(collate_packed, max_tokens=max_tokens))
    )


def train_step(batch: Batch) -> int:
    """Stands in for a model: builds the attention mask and returns the number
    of (query, key) pairs attended, which padding and packing both affect."""
    mask = cp.packing.attention_mask(batch["segment_ids"])
    return int(mask.sum())


def same(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def token_counts(batches: list[Batch]) -> dict[int, int]:
    """How often each token id occurs in ``batches`` (padding excluded)."""
    ids = torch.cat([b["tokens"][b["segment_ids"] >= 0] for b in batches]) if batches else None
    if ids is None or not len(ids):
        return {}
    values, counts = torch.unique(ids, return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per row (default 512)")
    parser.add_argument(
        "--strategy", choices=("best_fit", "first_fit"), default="best_fit", help="packing rule"
    )
    parser.add_argument("--data", default=DATA_GLOB, help="corpus glob (default: examples/data)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=args.workers))
    pipe = build_pipeline(args.data, args.max_tokens, args.strategy, WEIGHTS)

    with cp.Loader[Batch](pipe, config) as loader:
        lines = {k: loader.total(f"mix/{k}/lines") for k in WEIGHTS}
        rows = loader.total("pre_shard")
        full = list(loader)
        packed: dict[str, Any] = loader.query("pack")
        drawn = loader.query("mix")["drawn"]
    attended = sum(train_step(b) for b in full)
    shown = ", ".join(f"{k} {t.items}" for k, t in lines.items() if t is not None)
    bound = f"at most {rows.items} (bound by '{rows.bound_by}')" if rows else "unknown"
    print(f"known totals: lines {shown}; batches {bound}", flush=True)
    print(
        f"mixed {drawn} sequences; packed ({args.strategy}, max_tokens={args.max_tokens}): "
        f"{packed['groups']} rows, {packed['tokens']} tokens, fill rate {packed['fill_rate']:.1%}; "
        f"{len(full)} batches of {ROWS_PER_BATCH} rows; {attended} attended pairs",
        flush=True,
    )

    stop_at = max(1, len(full) // 2)
    with tempfile.TemporaryDirectory(prefix="packed-") as tmp:
        path = Path(tmp) / "packed.pt"
        head: list[Batch] = []
        with cp.Loader[Batch](pipe, config) as loader:
            for batch in loader:
                train_step(batch)
                head.append(batch)
                if len(head) == stop_at:
                    break
            torch.save(loader.state_dict(), path)
        print(f"checkpoint: saved at batch {len(head)} ({path.stat().st_size} bytes)", flush=True)
        with cp.Loader[Batch](pipe, config) as loader:
            loader.load_state_dict(torch.load(path, weights_only=True))
            tail = [batch for batch in loader if train_step(batch) >= 0]

        # The same checkpoint under new weights: every corpus continues where it was.
        reweighted = build_pipeline(args.data, args.max_tokens, args.strategy, NEW_WEIGHTS)
        with cp.Loader[Batch](reweighted, config) as loader:
            loader.load_state_dict(torch.load(path, weights_only=True))
            new_tail = list(loader)
            new_drawn = loader.query("mix")["drawn"]

    if not same(head + tail, full):
        print(f"resume MISMATCH: {len(head)} + {len(tail)} batches vs {len(full)}", flush=True)
        return 1
    print(
        f"resumed exactly: {len(head)} batches before the checkpoint + {len(tail)} after = "
        f"{len(full)} = uninterrupted run ({args.workers} workers)",
        flush=True,
    )
    # Every line is delivered once either way (up to the rows drop_last leaves out).
    if new_drawn != drawn or token_counts(head + new_tail) != token_counts(full):
        print(f"new weights LOST or REPEATED lines: drawn {new_drawn} vs {drawn}", flush=True)
        return 1
    print(
        f"resumed under weights {NEW_WEIGHTS}: {len(head)} + {len(new_tail)} batches, every "
        f"sequence of both corpora delivered once ({new_drawn})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

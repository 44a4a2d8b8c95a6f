"""Two ranks of ``tests/integrations/test_lightning.py``'s DDP test, under torchrun (gloo).

Usage: ``torchrun --nproc_per_node=2 ... tests/scripts/lightning_ddp.py OUT_DIR``

For a pipeline of known and one of unknown length: an uninterrupted 2-epoch
``strategy="ddp"`` run that saves a checkpoint after every step (rank 0 writes
them), then fresh models resumed from a mid-epoch checkpoint and from one on an
epoch's last batch. Each rank writes ``OUT_DIR/rank<r>.json`` with the batches
it trained and whether the final weights equal the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import centralpipe as cp
from tests.support.lightning_app import Model, make_pipe, make_trainer, weights


def _trainer(ckpt: Path | None) -> Any:
    return make_trainer(ckpt, accelerator="cpu", devices=2, strategy="ddp")


def run_case(out: Path, known_len: bool) -> list[dict[str, Any]]:
    pipe = make_pipe(known_len=known_len, sharded=True)
    ckpt = out / ("known" if known_len else "unknown") / "ckpt"
    full = Model(pipe, num_workers=2)
    _trainer(ckpt).fit(full)
    per_epoch = len(full.seen) // 2
    cases = []
    for step in (per_epoch - 2, per_epoch):
        path = ckpt / f"step={step}.ckpt"
        resumed = Model(pipe, num_workers=2)
        _trainer(None).fit(resumed, ckpt_path=path)
        same = all(
            torch.equal(a, b) for a, b in zip(weights(resumed).values(), weights(full).values())
        )
        cases.append(
            {
                "name": f"{'known' if known_len else 'unknown'}-len step {step}",
                "step": step,
                "full": full.seen,
                "seen_after": resumed.seen,
                "same_weights": same,
            }
        )
    return cases


def main() -> None:
    out = Path(sys.argv[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cp.Loader(make_pipe(known_len=True)).close()  # built before fit: rank 0 of 1
    warned = any("SAME items" in str(w.message) for w in caught)
    cases = run_case(out, known_len=True) + run_case(out, known_len=False)
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(
        json.dumps({"warned_duplicates": warned, "cases": cases, "env_rank": os.environ["RANK"]})
    )


if __name__ == "__main__":
    main()

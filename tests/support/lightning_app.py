"""A tiny Lightning model and pipelines for the Lightning tests (also run by
``tests/scripts/lightning_ddp.py`` under torchrun): every trained batch is recorded,
so a resumed run can be compared with the uninterrupted one step for step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

import centralpipe as cp
import centralpipe.lightning as cpl

N_ITEMS = 48
BATCH = 4


def to_tensor(batch: list[int]) -> torch.Tensor:
    return torch.tensor(batch, dtype=torch.int64)


def keep(x: int) -> bool:
    return x % 5 != 3


def make_pipe(*, known_len: bool, sharded: bool = False, n: int = N_ITEMS) -> cp.Pipeline:
    """Shuffled items in batches of ``BATCH``; with ``known_len=False`` a
    central filter hides the length from Lightning."""
    pipe = cp.Pipeline.from_iterable(range(n)).shuffle(16)
    if not known_len:
        pipe = pipe.filter(keep)
    pipe = pipe.batch(BATCH).count("pre_shard", weight_fn=len)
    if sharded:
        pipe = pipe.shard(equalize="drop_last")
    return pipe.dispatch().map(to_tensor)


class Model(pl.LightningModule):
    """Linear regression on the item ids; records each trained batch."""

    def __init__(
        self,
        pipe: cp.Pipeline,
        *,
        num_workers: int = 0,
        crash_at_step: int | None = None,
        val_pipe: cp.Pipeline | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.pipe = pipe
        self.val_pipe = val_pipe
        self.num_workers = num_workers
        self.crash_at_step = crash_at_step
        self.seen: list[list[int]] = []
        self.loaders: list[Any] = []

    def _config(self) -> cp.LoaderConfig:
        return cp.LoaderConfig(
            workers=cp.WorkerConfig(num_workers=self.num_workers, start_method="fork"), seed=3
        )

    def train_dataloader(self) -> Any:
        loader = cpl.loader(self.pipe, self._config(), trainer=self.trainer)
        self.loaders.append(loader)
        return loader

    def val_dataloader(self) -> Any:
        if self.val_pipe is None:
            return []
        loader = cpl.loader(self.val_pipe, self._config(), trainer=self.trainer)
        self.loaders.append(loader)
        return loader

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.crash_at_step is not None and self.global_step == self.crash_at_step:
            raise RuntimeError("crash for the test")
        self.seen.append(batch.tolist())
        x = batch.to(torch.float32)[:, None] / N_ITEMS
        return ((self.layer(x) - x * 3.0) ** 2).mean()

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.seen_val = getattr(self, "seen_val", [])
        self.seen_val.append(batch.tolist())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def make_trainer(ckpt_dir: Path | None, *, max_epochs: int = 2, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU trainer that saves a checkpoint after every step into ``ckpt_dir``."""
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=ckpt_dir,
                filename="{step}",
                every_n_train_steps=1,
                save_top_k=-1,
            )
        )
    kwargs.setdefault("accelerator", "cpu")
    kwargs.setdefault("devices", 1)
    kwargs.setdefault("enable_checkpointing", ckpt_dir is not None)
    return pl.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}

"""Exact resume inside PyTorch Lightning: ``loader(pipeline, config, trainer=...)``.

Return it from ``LightningModule.train_dataloader()`` (or ``val_dataloader()``)
with ``trainer=self.trainer``; Lightning's own checkpoints (``ModelCheckpoint``,
``ckpt_path=``) then resume the data exactly, single process or DDP. Optional
extra: ``pip install 'centralpipe[lightning]'``; ``import centralpipe`` never
imports Lightning.

What the wrapper adds to a plain :class:`~centralpipe.Loader`:

- **Ranks from the trainer** (``trainer.global_rank``/``world_size``), read
  when Lightning first asks for the length or the first batch, when they are
  settled under every launcher; a ``config.distributed`` that says otherwise
  is a ``ConfigError``.
- **State as of the last batch Lightning trained.** Lightning's fetcher reads
  a batch ahead when the length is unknown, and stops early with
  ``limit_train_batches``. The trained count is read from the trainer's
  progress (``fit_loop.epoch_loop.batch_progress.current.ready``), and the
  state is the loader's state after exactly that many batches (a state is
  kept after each delivered batch, for the few that are fetched ahead).
- **Epochs follow the trainer**: the pass for Lightning's epoch ``e`` is the
  loader's epoch ``e + 1``, so a checkpoint on an epoch's last batch, or one
  Lightning restores without the loader's state, resumes the next epoch
  exactly as the uninterrupted run.
- **One state for every rank**: ``state_dict()`` gathers every rank's state
  (``torch.distributed.all_gather_object``; Lightning calls it on all ranks),
  so the checkpoint rank 0 writes alone holds each rank's part.
- **Nothing starts before the first batch** (Lightning probes ``iter()``),
  and the loader is closed when fitting ends or fails.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import attrs

from centralpipe.checkpoint.elastic import merge_states
from centralpipe.config import DistributedConfig, LoaderConfig
from centralpipe.errors import CheckpointError, ConfigError, PipelineError
from centralpipe.loader import Loader
from centralpipe.plan.pipeline import Pipeline

try:
    import pytorch_lightning as _pl
except ImportError:  # pragma: no cover - the unified `lightning` package only
    try:
        import lightning.pytorch as _pl  # type: ignore[no-redef]
    except ImportError:
        msg = (
            "centralpipe.lightning needs PyTorch Lightning: "
            "pip install 'centralpipe[lightning]' (or pytorch-lightning)."
        )
        raise ImportError(msg) from None

__all__ = ["LightningLoader", "loader"]

logger = logging.getLogger("centralpipe")

T = TypeVar("T")

STATE_FORMAT = "centralpipe.lightning"
STATE_VERSION = 1
#: States kept for batches fetched but not yet trained (Lightning prefetches one).
KEPT_STATES = 4
_EVAL_STAGES = ("validate", "sanity_check", "test", "predict")


def loader(
    pipeline: Pipeline, config: LoaderConfig | None = None, *, trainer: Any
) -> LightningLoader[Any]:
    """A loader for ``trainer`` whose Lightning checkpoints resume exactly.

    Args:
        pipeline: the pipeline to load.
        config: as for :class:`~centralpipe.Loader`; its ``distributed`` part
            may be left at the default (it is taken from the trainer) or must
            agree with the trainer.
        trainer: the ``Trainer`` that iterates it (``self.trainer`` in a
            ``LightningModule``).

    Returns:
        A :class:`LightningLoader`. Returned from ``train_dataloader()`` (or
        given to ``fit(train_dataloaders=...)``) it tracks training progress;
        returned from ``val_dataloader()``/``test_dataloader()`` it is a plain
        pass per evaluation run. Either way it is closed when fitting ends.

    Raises:
        PipelineError: ``pipeline`` is not a Pipeline.
        TypeError: ``trainer`` is not a Lightning ``Trainer``.
        ConfigError: ``config`` is not a LoaderConfig.
    """
    if not isinstance(pipeline, Pipeline):
        msg = f"loader() needs a centralpipe.Pipeline, got {type(pipeline).__name__}."
        raise PipelineError(msg)
    if config is None:
        config = LoaderConfig()
    if not isinstance(config, LoaderConfig):
        msg = f"`config` must be a centralpipe.LoaderConfig, got {type(config).__name__}."
        raise ConfigError(msg)
    if not all(hasattr(trainer, a) for a in ("fit_loop", "global_rank", "world_size", "state")):
        msg = (
            f"`trainer` must be a Lightning Trainer (pass trainer=self.trainer), got "
            f"{type(trainer).__name__}."
        )
        raise TypeError(msg)
    stage = getattr(trainer.state.stage, "value", None)
    out: LightningLoader[Any] = LightningLoader(
        pipeline, config, trainer, train=stage not in _EVAL_STAGES
    )
    _closer_of(trainer).loaders.add(out)
    return out


class LightningLoader(Generic[T]):
    """A :class:`~centralpipe.Loader` driven by a Lightning ``Trainer``; see
    the module docstring. Build it with :func:`loader`."""

    def __init__(self, pipeline: Pipeline, config: LoaderConfig, trainer: Any, *, train: bool):
        self._pipeline = pipeline
        self._config = config
        self._trainer = weakref.ref(trainer)
        self.train = train
        self._loader: Loader[T] | None = None
        self._closed = False
        # Progress of the current pass: batches delivered, Lightning's trained
        # count when the pass started (a resumed pass starts mid-epoch), the
        # loader's epoch, whether the pass ran out, and states after the last
        # few delivered batches as (delivered count, state).
        self._delivered = 0
        self._base = 0
        self._pass_epoch = 0
        self._exhausted = False
        self._kept: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(
            maxlen=KEPT_STATES
        )
        # A loaded state not yet started: this rank's part.
        self._pending: dict[str, Any] | None = None

    # -- the wrapped loader ------------------------------------------------------

    @property
    def loader(self) -> Loader[T]:
        """The :class:`~centralpipe.Loader` (built at first use, with the trainer's ranks)."""
        if self._loader is None:
            if self._closed:
                raise RuntimeError("this loader is closed (fitting ended).")
            trainer = self._get_trainer()
            rank, world = int(trainer.global_rank), int(trainer.world_size)
            dist = self._config.distributed
            if dist != DistributedConfig() and (dist.rank, dist.world_size) != (rank, world):
                msg = (
                    f"config.distributed says rank {dist.rank} of {dist.world_size}, but the "
                    f"trainer says rank {rank} of {world}; leave `distributed` at its default "
                    "(the trainer's ranks are used)."
                )
                raise ConfigError(msg)
            local = getattr(trainer, "local_rank", None)
            config = attrs.evolve(
                self._config,
                distributed=DistributedConfig(rank=rank, world_size=world, local_rank=local),
            )
            self._loader = Loader(self._pipeline, config)
        return self._loader

    def _get_trainer(self) -> Any:
        trainer = self._trainer()
        if trainer is None:
            raise RuntimeError("the Trainer of this loader no longer exists.")
        return trainer

    def __len__(self) -> int:
        return len(self.loader)

    def query(self, name: str, *, delivered: bool = False) -> dict[str, Any]:
        """``Loader.query``: e.g. ``query("pre_shard", delivered=True)`` for progress."""
        return self.loader.query(name, delivered=delivered)

    def metrics(self) -> dict[str, Any]:
        """``Loader.metrics()``."""
        return self.loader.metrics()

    def close(self) -> None:
        """Close the wrapped loader (workers, files); idempotent."""
        self._closed = True
        if self._loader is not None:
            self._loader.close()

    # -- iteration -------------------------------------------------------------------

    def __iter__(self) -> Iterator[T]:
        # Lazy: Lightning calls iter() once only to probe the loader.
        return self._pass()

    def _pass(self) -> Iterator[T]:
        loader = self.loader
        if not self.train:
            yield from loader
            return
        self._start_pass(loader)
        it = iter(loader)
        self._delivered = 0
        self._exhausted = False
        self._kept.clear()
        for batch in it:
            self._delivered += 1
            self._pass_epoch = loader.epoch
            yield batch
            # Lightning asked for the next batch: keep the state after this
            # one, for when it trains this one only after fetching ahead.
            self._kept.append((self._delivered, loader.state_dict()))
        self._exhausted = True

    def _start_pass(self, loader: Loader[T]) -> None:
        """Line the loader's epoch up with the trainer's before a pass."""
        pending, self._pending = self._pending, None
        self._base = 0
        if pending is not None and not pending["epoch_done"]:
            self._base = pending["batches"]  # the loader resumes the loaded position
            return
        if pending is not None:
            target = pending["epoch"] + 1
        else:
            target = self._get_trainer().fit_loop.epoch_progress.current.processed + 1
        if loader.epoch + 1 != target:
            loader._set_next_epoch(target)

    # -- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch the trainer trained, for every rank.

        Lightning calls this on every rank at once when it saves a checkpoint;
        with several ranks it gathers their states (a collective call)."""
        if not self.train:
            raise RuntimeError("an evaluation loader keeps no state; Lightning does not save it.")
        local = self._local_state()
        world = int(self.loader.config.distributed.world_size)
        parts: list[Any] = [local]
        if world > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                msg = f"this loader has {world} ranks but torch.distributed is not initialised."
                raise RuntimeError(msg)
            parts = [None] * world
            dist.all_gather_object(parts, local)
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "world_size": world,
            "ranks": parts,
        }

    def _local_state(self) -> dict[str, Any]:
        loader = self.loader
        if self._pending is not None:
            return dict(self._pending)
        trainer = self._get_trainer()
        trained = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        k = trained - self._base
        total = trainer.num_training_batches
        at_end = self._exhausted and k == self._delivered
        if trained > 0 and (trained >= total or at_end):
            return {
                "epoch_done": True,
                "epoch": self._pass_epoch,
                "batches": trained,
                "loader": None,
            }
        if k == self._delivered:
            state = loader.state_dict()
        else:
            kept = dict(self._kept)
            if k not in kept:
                msg = (
                    f"the trainer has trained {trained} batches of this epoch, but this loader "
                    f"delivered {self._base + self._delivered} and keeps states only for the last "
                    f"{KEPT_STATES}; cannot describe the position after batch {trained}."
                )
                raise RuntimeError(msg)
            state = kept[k]
        return {"epoch_done": False, "epoch": state["epoch"], "batches": trained, "loader": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the position of ``state_dict`` (from :meth:`state_dict` on
        any rank) at the next pass; a damaged or foreign state is a
        ``CheckpointError``."""
        if not self.train:
            raise RuntimeError("an evaluation loader keeps no state.")
        part = self._my_part(state_dict)
        if not part["epoch_done"]:
            self.loader.load_state_dict(part["loader"])
        self._pending = part

    def _my_part(self, sd: Any) -> dict[str, Any]:
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            msg = (
                "not a centralpipe.lightning state (no format "
                f"{STATE_FORMAT!r}); was it saved by a plain Loader?"
            )
            raise CheckpointError(msg)
        if sd.get("version") != STATE_VERSION:
            got = sd.get("version")
            msg = f"centralpipe.lightning state version {got!r}, expected {STATE_VERSION}."
            raise CheckpointError(msg)
        parts, world = sd.get("ranks"), sd.get("world_size")
        if not isinstance(parts, list) or not isinstance(world, int) or len(parts) != world:
            raise CheckpointError(
                "damaged centralpipe.lightning state: `ranks` must list every rank."
            )
        for i, part in enumerate(parts):
            if not (
                isinstance(part, dict)
                and isinstance(part.get("epoch_done"), bool)
                and isinstance(part.get("batches"), int)
                and isinstance(part.get("epoch"), int)
                and part["batches"] >= 0
                and part["epoch"] >= 0
                and (part["epoch_done"] or isinstance(part.get("loader"), dict))
            ):
                msg = f"damaged centralpipe.lightning state: the part of rank {i} is malformed."
                raise CheckpointError(msg)
        if len({(p["epoch_done"], p["batches"], p["epoch"]) for p in parts}) != 1:
            raise CheckpointError(
                "damaged centralpipe.lightning state: the ranks' parts are at different steps."
            )
        cfg = self.loader.config.distributed
        if world == cfg.world_size:
            return dict(parts[cfg.rank])
        self._check_world_change(world, cfg.world_size)
        if parts[0]["epoch_done"]:
            return dict(parts[0])
        merged = merge_states([p["loader"] for p in parts])
        return {**parts[0], "loader": merged, "epoch": merged["epoch"]}

    def _check_world_change(self, saved: int, now: int) -> None:
        """Refuse a change of world size that Lightning would count wrongly.

        Lightning restores its own count of batches trained per rank and, when
        the loader has a length, ends the epoch when that count reaches the
        length: on another number of ranks both mean other central positions,
        and the epoch would end early (items never trained) or run into the
        next one. With an unknown length Lightning runs each pass to the end,
        so the merged global state resumes exactly."""
        try:
            length: int | None = len(self.loader)
        except TypeError:
            length = None
        if length is None:
            return
        msg = (
            f"this checkpoint was saved by {saved} ranks and this job has {now}; Lightning "
            f"counts the batches of an epoch per rank, and this loader's length is known "
            f"({length} batches a rank), so Lightning would end the resumed epoch at the wrong "
            f"place and lose or repeat items. Resume on {saved} devices, or on another number "
            "of ranks with a pipeline whose length Lightning does not know, or with a plain "
            "Loader and cp.merge_states (docs/distributed.md)."
        )
        raise CheckpointError(msg)


class _Closer(_pl.Callback):
    """Closes a trainer's centralpipe loaders when its run ends or fails."""

    def __init__(self) -> None:
        self.loaders: weakref.WeakSet[LightningLoader[Any]] = weakref.WeakSet()

    def _close_all(self) -> None:
        for lo in list(self.loaders):
            lo.close()
        self.loaders.clear()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close_all()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close_all()


def _closer_of(trainer: Any) -> _Closer:
    for cb in trainer.callbacks:
        if isinstance(cb, _Closer):
            return cb
    closer = _Closer()
    trainer.callbacks.append(closer)
    return closer

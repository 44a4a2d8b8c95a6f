"""centralpipe.lightning: real `Trainer.fit` runs resume exactly from Lightning checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pytorch_lightning")

import centralpipe as cp
import centralpipe.lightning as cpl
from tests.support.lightning_app import Model, make_pipe, make_trainer, weights
from tests.support.torchrun import torchrun

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::DeprecationWarning", "ignore:.*LeafSpec"
)

REPO = Path(__file__).resolve().parents[2]


def _step(path: Path) -> int:
    return int(path.stem.split("=")[1])


def _checkpoints(directory: Path) -> dict[int, Path]:
    return {_step(p): p for p in directory.glob("*.ckpt")}


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _full_run(tmp_path: Path, pipe: cp.Pipeline, **kw: Any) -> tuple[Model, dict[int, Path]]:
    workers = kw.pop("num_workers", 0)
    model = Model(pipe, num_workers=workers)
    make_trainer(tmp_path / "ckpt", **kw).fit(model)
    return model, _checkpoints(tmp_path / "ckpt")


def _resume(pipe: cp.Pipeline, path: Path, **kw: Any) -> Model:
    workers = kw.pop("num_workers", 0)
    model = Model(pipe, num_workers=workers)
    make_trainer(None, **kw).fit(model, ckpt_path=path)
    return model


@pytest.mark.parametrize("known_len", [True, False], ids=["len-known", "len-unknown"])
def test_every_step_checkpoint_resumes_exactly(tmp_path: Path, known_len: bool) -> None:
    """A checkpoint after any step (mid-epoch or an epoch's last batch) resumes step for step."""
    pipe = make_pipe(known_len=known_len)
    full, ckpts = _full_run(tmp_path, pipe)
    assert len(ckpts) == len(full.seen) >= 20
    per_epoch = len(full.seen) // 2
    assert per_epoch in ckpts, "a checkpoint on the first epoch's last batch"
    for step, path in sorted(ckpts.items()):
        resumed = _resume(pipe, path)
        assert resumed.seen == full.seen[step:], f"step {step}"
        assert _same_weights(weights(resumed), weights(full)), f"step {step}"


@pytest.mark.parametrize("known_len", [True, False], ids=["len-known", "len-unknown"])
def test_resume_with_workers(tmp_path: Path, known_len: bool) -> None:
    """With 2 workers, mid-epoch and epoch-end checkpoints resume exactly too."""
    pipe = make_pipe(known_len=known_len)
    full, ckpts = _full_run(tmp_path, pipe, num_workers=2)
    per_epoch = len(full.seen) // 2
    for step in (1, per_epoch - 1, per_epoch, per_epoch + 3):
        resumed = _resume(pipe, ckpts[step], num_workers=2)
        assert resumed.seen == full.seen[step:], f"step {step}"
        assert _same_weights(weights(resumed), weights(full))


def test_crash_resumes_from_the_last_checkpoint(tmp_path: Path) -> None:
    """A run that crashes mid-epoch closes its loader; its last checkpoint resumes exactly."""
    pipe = make_pipe(known_len=False)
    full = Model(pipe, num_workers=2)
    make_trainer(None).fit(full)
    crashed = Model(pipe, num_workers=2, crash_at_step=7)
    with pytest.raises(RuntimeError, match="crash for the test"):
        make_trainer(tmp_path / "ckpt").fit(crashed)
    assert all(lo._closed for lo in crashed.loaders), "closed when fitting failed"
    ckpts = _checkpoints(tmp_path / "ckpt")
    assert max(ckpts) == 7
    resumed = _resume(pipe, ckpts[7], num_workers=2)
    assert crashed.seen + resumed.seen == full.seen
    assert _same_weights(weights(resumed), weights(full))


@pytest.mark.parametrize("known_len", [True, False], ids=["len-known", "len-unknown"])
def test_limit_train_batches(tmp_path: Path, known_len: bool) -> None:
    """With `limit_train_batches`, each epoch is the loader's next epoch and resumes exactly."""
    pipe = make_pipe(known_len=known_len)
    full, ckpts = _full_run(tmp_path, pipe, max_epochs=3, limit_train_batches=3)
    assert len(full.seen) == 9
    with cp.Loader(pipe, full._config()) as plain:
        epochs = [[b.tolist() for b in plain] for _ in range(3)]
    assert full.seen == [b for e in epochs for b in e[:3]], "epoch e is the loader's epoch e + 1"
    for step in (2, 3, 4, 8):
        resumed = _resume(pipe, ckpts[step], max_epochs=3, limit_train_batches=3)
        assert resumed.seen == full.seen[step:], f"step {step}"
        assert _same_weights(weights(resumed), weights(full))


def test_epoch_end_checkpoint_without_loader_state(tmp_path: Path) -> None:
    """An end-of-epoch checkpoint (Lightning restores no loader state) resumes the next epoch."""
    pipe = make_pipe(known_len=False)
    full = Model(pipe)
    make_trainer(None, max_epochs=3).fit(full)
    first = Model(pipe)
    trainer = make_trainer(None, max_epochs=1)
    trainer.fit(first)
    path = tmp_path / "epoch.ckpt"
    trainer.save_checkpoint(path)
    resumed = _resume(pipe, path, max_epochs=3)
    assert first.seen + resumed.seen == full.seen
    assert _same_weights(weights(resumed), weights(full))


def test_probe_iter_starts_nothing() -> None:
    """`iter()` (Lightning's probe) starts no epoch and no worker; the first batch does."""
    pipe = make_pipe(known_len=True)
    trainer = make_trainer(None)
    # start_inline=False: the first batch comes from the workers, not from the
    # main process while they start (the inline warm start).
    workers = cp.WorkerConfig(num_workers=2, start_inline=False)
    lo = cpl.loader(pipe, cp.LoaderConfig(workers=workers), trainer=trainer)
    try:
        for _ in range(3):
            iter(lo)
        assert lo.loader.worker_pids() == [] and lo.loader.epoch == 0
        next(iter(lo))
        assert len(lo.loader.worker_pids()) == 2 and lo.loader.epoch == 1
    finally:
        lo.close()


def test_validation_loaders_run_and_close(tmp_path: Path) -> None:
    """Validation loaders give every item each run, and every loader is closed after fit."""
    val = make_pipe(known_len=True, n=12)
    model = Model(make_pipe(known_len=True), num_workers=2, val_pipe=val)
    make_trainer(None, max_epochs=2).fit(model)
    assert sorted(x for b in model.seen_val for x in b) == sorted(list(range(12)) * 2)
    assert len(model.loaders) == 2 and all(lo._closed for lo in model.loaders)
    with pytest.raises(RuntimeError, match="closed"):
        iter(model.loaders[0]).__next__()


def test_ranks_come_from_the_trainer_and_disagreement_is_refused() -> None:
    """The trainer's ranks are used; a `config.distributed` that disagrees is a `ConfigError`."""
    trainer = make_trainer(None)
    lo = cpl.loader(make_pipe(known_len=True), trainer=trainer)
    assert lo.loader.config.distributed == cp.DistributedConfig(rank=0, world_size=1, local_rank=0)
    lo.close()
    bad = cp.LoaderConfig(distributed=cp.DistributedConfig(rank=1, world_size=2))
    lo = cpl.loader(make_pipe(known_len=True), bad, trainer=trainer)
    with pytest.raises(cp.ConfigError, match=r"rank 1 of 2.*rank 0 of 1"):
        len(lo)


def test_bad_arguments() -> None:
    """A non-Pipeline, a non-config or a missing Trainer is refused with a clear error."""
    trainer = make_trainer(None)
    with pytest.raises(cp.PipelineError, match=r"needs a centralpipe\.Pipeline"):
        cpl.loader([1, 2], trainer=trainer)  # type: ignore[arg-type]
    with pytest.raises(cp.ConfigError, match=r"must be a centralpipe\.LoaderConfig"):
        cpl.loader(make_pipe(known_len=True), {"seed": 1}, trainer=trainer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"trainer=self\.trainer"):
        cpl.loader(make_pipe(known_len=True), trainer=None)


@pytest.mark.parametrize(
    "damage",
    ["plain-loader-state", "no-ranks", "wrong-version", "rank-part", "different-steps"],
)
def test_damaged_states_are_refused(damage: str) -> None:
    """A state that is not a centralpipe.lightning state, or is damaged, is a `CheckpointError`."""
    pipe = make_pipe(known_len=True)
    trainer = make_trainer(None)
    lo = cpl.loader(pipe, trainer=trainer)
    try:
        good = lo.state_dict()
        state: Any
        if damage == "plain-loader-state":
            state = lo.loader.state_dict()
        elif damage == "no-ranks":
            state = {**good, "ranks": None}
        elif damage == "wrong-version":
            state = {**good, "version": 99}
        elif damage == "rank-part":
            state = {**good, "ranks": [{"epoch_done": "no"}]}
        else:
            part = good["ranks"][0]
            state = {**good, "world_size": 2, "ranks": [part, {**part, "batches": 5}]}
        with pytest.raises(cp.CheckpointError):
            lo.load_state_dict(state)
        lo.load_state_dict(good)
    finally:
        lo.close()


def test_import_centralpipe_does_not_import_lightning() -> None:
    """`import centralpipe` never imports Lightning (an optional extra)."""
    code = (
        "import sys, centralpipe; "
        "assert not any(m.split('.')[0] in ('pytorch_lightning', 'lightning') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ddp_resumes_from_the_rank0_checkpoint(tmp_path: Path) -> None:
    """2-rank DDP (gloo): rank 0's checkpoint resumes both ranks step for step, weights equal."""
    proc = torchrun(
        REPO / "tests" / "scripts" / "lightning_ddp.py", str(tmp_path), nproc=2, timeout_s=280
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["warned_duplicates"], f"rank {r}: a world-size-1 Loader must warn"
        for case in res["cases"]:
            assert case["seen_after"] == case["full"][case["step"] :], (r, case["name"])
            assert case["same_weights"], (r, case["name"])
    seen = [set(map(tuple, c["full"])) for c in (res["cases"][0] for res in results)]
    assert not seen[0] & seen[1], "the ranks train on different batches"
    assert (tmp_path / "known" / "ckpt").is_dir()
    _resume_on_one_device(tmp_path, results)


def _resume_on_one_device(out: Path, results: list[dict[str, Any]]) -> None:
    """The 2-rank checkpoints on 1 device: exact when Lightning does not know
    the length, a clear refusal when it does (it counts batches per rank)."""
    full = Model(make_pipe(known_len=False, sharded=True), num_workers=1)
    make_trainer(None).fit(full)
    for r0, r1 in zip(results[0]["cases"], results[1]["cases"]):
        if not r0["name"].startswith("unknown"):
            continue
        step = r0["step"]  # every rank trained `step` batches: 2 * step central batches
        before = sorted(map(tuple, r0["full"][:step] + r1["full"][:step]))
        assert before == sorted(map(tuple, full.seen[: 2 * step])), r0["name"]
        resumed = _resume(
            make_pipe(known_len=False, sharded=True),
            out / "unknown" / "ckpt" / f"step={step}.ckpt",
            num_workers=1,
        )
        assert resumed.seen == full.seen[2 * step :], r0["name"]
    step = results[0]["cases"][0]["step"]
    with pytest.raises(cp.CheckpointError, match="saved by 2 ranks and this job has 1"):
        _resume(
            make_pipe(known_len=True, sharded=True), out / "known" / "ckpt" / f"step={step}.ckpt"
        )

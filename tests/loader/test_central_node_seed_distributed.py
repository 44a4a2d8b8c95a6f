"""The seed pipeline in ``central="node"`` under torchrun (2 local ranks, gloo
on loopback): its parallel tokenizer runs once per node, and each rank still
gets process mode's batches, resumes bit-identically after a rank is killed
with SIGKILL (the kill and restart run in every central mode), resumes on 1
and 3 ranks, and sees a stalled local rank as an error naming it.

The ranks run ``tests/scripts/dist_node_seed.py`` (one launch per phase) and write
digests of their batches; the assertions are made here.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from centralpipe.dispatch.worker.loop import main_alive
from tests.scripts.dist_node_seed import STALL_S, STEP
from tests.support.torchrun import torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dist_node_seed.py"
LAUNCH_TIMEOUT_S = 240

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.timeout(2 * LAUNCH_TIMEOUT_S + 60),
]


def _launch(out: Path, phase: str, nproc: int, mode: str | None = None) -> list[dict[str, Any]]:
    args = [phase] if mode is None else [phase, mode]
    proc = torchrun(SCRIPT, str(out), *args, nproc=nproc, timeout_s=LAUNCH_TIMEOUT_S)
    phase_id = "-".join(args)
    errors = "".join(p.read_text() for p in sorted(out.glob(f"{phase_id}-error-rank*.txt")))
    assert proc.returncode == 0, errors + proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads((out / f"{phase_id}-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("node-seed")


@pytest.fixture(scope="module")
def compared(out: Path) -> list[dict[str, Any]]:
    return _launch(out, "compare", 2)


@pytest.fixture(scope="module", params=["node", "service", "process"])
def killed(out: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The ``kill`` launch in each central mode (it fails: a rank died), then
    the ``restart`` one in the same mode."""
    mode = request.param
    proc = torchrun(SCRIPT, str(out), "kill", mode, nproc=2, timeout_s=LAUNCH_TIMEOUT_S)
    heads = [json.loads((out / f"kill-{mode}-head-rank{r}.json").read_text()) for r in range(2)]
    pids = [p for h in heads for p in h["pids"]]
    deadline = time.monotonic() + 10
    while any(main_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if main_alive(p)]
    return {
        "mode": mode,
        "rc": proc.returncode,
        "heads": heads,
        "left": left,
        "restart": _launch(out, "restart", 2, mode),
    }


@pytest.mark.parametrize("workers", [2, 3])
def test_each_rank_gets_process_mode_batches(compared: list[dict[str, Any]], workers: int) -> None:
    """The example's seed pipeline: each rank's epoch in node mode is its
    process-mode epoch batch for batch, at 2 and 3 workers per node (0 and 1
    in one process: tests/dispatch/test_central_node.py)."""
    for result in compared:
        full = result["full"]
        assert full[f"node-{workers}"] == full[f"process-{workers}"]
        assert len(full["process-2"]) >= 20  # 23 batches a rank on the two files
    assert not set(compared[0]["full"]["node-2"]) & set(compared[1]["full"]["node-2"])


def test_small_bucket_buffer_equals_process_mode(compared: list[dict[str, Any]]) -> None:
    """With a 64-line bucket buffer (the tokenizer's lines in flight at every
    checkpoint) and 1 worker, node mode equals process mode too."""
    for result in compared:
        assert result["full"]["small-node-1"] == result["full"]["small-process-1"]
        assert result["tokenizer_in_flight"]


def test_two_node_ranks_resume_on_one_process_rank(compared: list[dict[str, Any]]) -> None:
    """Both ranks' node-mode states after STEP batches, merged, resume on one
    rank in process mode with every batch neither rank delivered, and in
    service mode with the same batches."""
    heads = compared[0]["head"] + compared[1]["head"]
    rest = compared[0]["merged_rest_one_rank"]
    assert Counter(heads + rest) == Counter(compared[0]["whole_epoch_one_rank"])
    assert compared[0]["merged_rest_one_rank_service"] == rest


def test_two_node_ranks_resume_on_three_ranks(out: Path, compared: list[dict[str, Any]]) -> None:
    """The merged node-mode states resume on 3 ranks in node and service mode
    exactly as in process mode, and with the 2 ranks' heads they make the epoch (less
    the at most 2 batches drop_last drops on 3 ranks)."""
    three = _launch(out, "three", 3)
    for result in three:
        assert result["node"] == result["process"] == result["service"]
        assert result["node"]
    together = Counter(compared[0]["head"] + compared[1]["head"])
    for result in three:
        together.update(result["node"])
    whole = Counter(compared[0]["whole_epoch_one_rank"])
    assert not together - whole
    assert sum((whole - together).values()) < 3


def test_a_stalled_rank_is_named_within_the_bound(compared: list[dict[str, Any]]) -> None:
    """Local rank 1 stops reading: local rank 0, whose feeder runs the shared
    tokenizer, gets a ``ServiceError`` naming local rank 1 after the stall
    timeout, not much later."""
    error, waited = compared[0]["stalled"]
    assert error.startswith(
        f"ServiceError: local rank 1 (global rank 1) has not read for {STALL_S}"
    )
    assert STALL_S <= waited < STALL_S + 30


def test_kill_9_a_rank_then_restart_resumes_bit_identically(killed: dict[str, Any]) -> None:
    """SIGKILL of local rank 1 mid-epoch fails the launch; restarting both
    ranks from the states they saved at step STEP gives, after the STEP
    batches before it, exactly each rank's uninterrupted epoch."""
    assert killed["rc"] != 0
    for head, result in zip(killed["heads"], killed["restart"], strict=True):
        assert len(head["head"]) == STEP
        assert head["head"] + result["rest"] == result["full"]


def test_kill_9_leaves_no_service_or_worker(killed: dict[str, Any]) -> None:
    """After the killed launch ends, no service (the node's, or each rank's)
    and no worker (the ranks' and the node-wide tokenizer pool) is alive
    within 10 s."""
    assert killed["left"] == []
    # rank 0 knew its workers, and in "node"/"service" mode a service too
    assert len(killed["heads"][0]["pids"]) >= (2 if killed["mode"] == "process" else 3)

"""Elastic resume under torchrun (gloo on loopback): 2 ranks → 3 ranks → 2 ranks,
and 2 ranks → 1 process (also with the feeder read to the end of the epoch),
with different ``num_workers`` in each run.

The ranks run ``tests/scripts/dist_elastic_worker.py`` and write what they saw; the
reference is one uninterrupted pass in this process (``tests/checkpoint/test_elastic.py``
has the exhaustive single-process checks).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import centralpipe as cp
from tests.checkpoint.test_elastic import model, pipe
from tests.support.configs import loader_config
from tests.support.torchrun import RUN_TIMEOUT_S, rank_results

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "dist_elastic_worker.py"
EQUALIZE = ("drop_last", "pad")
#: (world size, steps per rank or -1 for the rest of the epoch, num_workers) per phase.
PHASES = ((2, 3, 1), (3, 2, 0), (2, -1, 2))

pytestmark = pytest.mark.distributed


def _lists(value: Any) -> Any:
    """JSON turns tuples into lists; compare like with like."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value


@pytest.fixture(scope="module")
def phases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each phase's per-rank results, and the saved global states' directory."""
    out = tmp_path_factory.mktemp("elastic")
    results = [
        rank_results(
            WORKER, out, *map(str, (phase, steps, workers)), nproc=world, prefix=f"{phase}-"
        )
        for phase, (world, steps, workers) in enumerate(PHASES)
    ]
    return {"out": out, "results": results}


@pytest.fixture(scope="module")
def stream() -> list[Any]:
    """The central stream of one uninterrupted pass on one rank."""
    with cp.Loader(pipe(None), loader_config()) as loader:
        return _lists(list(loader))


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("equalize", EQUALIZE)
def test_two_to_three_to_two_ranks_equals_one_uninterrupted_pass(
    phases: dict[str, Any], stream: list[Any], equalize: str
) -> None:
    """Across 2 → 3 → 2 ranks every central item is delivered once, and each
    run's ranks split the rest of the stream exactly as shard() would."""
    start = 0
    delivered: list[Any] = []
    for phase, (world, steps, _) in enumerate(PHASES):
        ranks = phases["results"][phase]
        want = model(stream[start:], equalize, world)
        for r in range(world):
            got = ranks[r][equalize]["items"]
            assert got == (want[r] if steps < 0 else want[r][:steps]), (phase, r)
            delivered += got
        if steps >= 0:
            start += world * steps
            assert ranks[0][equalize]["position"]["pre_shard_index"] == start
    if equalize == "pad":
        assert set(map(tuple, delivered)) == set(map(tuple, stream))
    else:
        assert Counter(map(tuple, delivered)) == Counter(map(tuple, stream[: len(delivered)]))
        assert len(stream) - len(delivered) < 2  # only the last incomplete round of 2


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("equalize", EQUALIZE)
def test_two_ranks_resume_on_one_process(
    phases: dict[str, Any], stream: list[Any], equalize: str
) -> None:
    """The global state saved by rank 0 of two resumes in a single process
    (with two workers) on the rest of the stream."""
    state = torch.load(phases["out"] / f"{equalize}-0.pt", weights_only=True)
    with cp.Loader(pipe(equalize), loader_config(num_workers=2)) as loader:
        loader.load_state_dict(state)
        assert _lists(list(loader)) == stream[6:]


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("equalize", EQUALIZE)
def test_gathered_with_the_feeder_at_the_end_resumes_on_one_process(
    phases: dict[str, Any], stream: list[Any], equalize: str
) -> None:
    """gather_states after 3 steps of 2 ranks whose feeders had read to the end
    of the epoch (so 2-rank drop_last had dropped the last round) resumes in
    one process on the whole rest of the stream: nothing is dropped on 1 rank."""
    state = torch.load(phases["out"] / f"{equalize}-end.pt", weights_only=True)
    with cp.Loader(pipe(equalize), loader_config()) as loader:
        loader.load_state_dict(state)
        assert _lists(list(loader)) == stream[6:]


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
@pytest.mark.parametrize("equalize", EQUALIZE)
def test_distributed_checkpoint_recipes(
    phases: dict[str, Any], stream: list[Any], equalize: str
) -> None:
    """With torch.distributed.checkpoint, per-rank keys and one global state
    both resume; one key shared by every rank is refused on the rank whose
    copy DCP dropped, with a message that says so and shows both recipes."""
    want = model(stream[6:], equalize, 2)
    refusals = []
    for r, result in enumerate(phases["results"][0]):
        recipes = result[equalize]["dcp"]
        assert recipes["per-rank"] == want[r]
        assert recipes["global"] == want[r]
        if recipes["shared-key"] != "loaded":
            refusals.append(recipes["shared-key"])
    assert len(refusals) == 1  # DCP kept one rank's copy: that rank loads it
    text = refusals[0]
    assert "each rank must load its own state" in text
    assert "per-rank key" in text and "cp.gather_states" in text
    assert "another world size" not in text

"""With ``num_workers > 0`` user code runs only in the workers, from the first
item on (``WorkerConfig.start_inline`` is off by default): a worker stage that
ends its process costs one worker restart, never the main process, and no
item's stage runs in the main process, in the first epoch or a later one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import centralpipe as cp
from centralpipe.testing import collect
from tests.fns import faulty

N = 200
#: The item whose worker-stage function ends its process, the first time.
AT = 50
#: Bound on the child process (a loaded machine: interpreter, forkserver, workers).
CHILD_TIMEOUT_S = 120.0

#: Ways a worker-stage function ends its process (``tests.fns.faulty``), on item AT once.
ENDINGS = {"os._exit": "exit_once", "segfault": "segfault_once"}

#: For each function named on the command line, iterates a default forkserver
#: loader whose stage ends its process on item AT once, and prints the output
#: and the restarts. Run as a child process (one for all: it imports torch
#: once), so a main process that ran the item itself dies there, not in the test.
_CHILD = """
import functools, json, os, sys
import centralpipe as cp
from tests.fns import faulty

def main():
    at, n, marker_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=2, start_method="forkserver"))
    for kind in sys.argv[4:]:
        marker = os.path.join(marker_dir, kind)
        fn = functools.partial(getattr(faulty, kind), at=at, marker=marker)
        pipe = cp.Pipeline.from_iterable(range(n)).dispatch().map(fn)
        with cp.Loader(pipe, config) as loader:
            out = list(loader)
            restarts = loader.metrics()["dispatch"]["restarts"]
        ended = os.path.exists(marker)
        print(json.dumps({"out": out, "restarts": restarts, "ended": ended}), flush=True)

if __name__ == "__main__":
    main()
"""


@pytest.mark.timeout(180)
def test_a_stage_that_ends_its_process_costs_one_worker_restart(tmp_path: Path) -> None:
    """A worker-stage function that calls os._exit (or segfaults) on item 50,
    default config with forkserver: one worker restart, the output exact, and
    the main process lives."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(_CHILD))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, str(script), str(AT), str(N), str(tmp_path), *ENDINGS.values()],
        capture_output=True,
        text=True,
        env=env,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"the main process died ({proc.returncode}): {proc.stderr}"
    lines = proc.stdout.splitlines()
    assert len(lines) == len(ENDINGS), proc.stdout
    expected = {"out": list(range(N)), "restarts": 1, "ended": True}
    for how, line in zip(ENDINGS, lines):
        assert json.loads(line) == expected, how


#: Where the function runs: a worker stage, or a parallel central stage.
STAGES = {
    "worker-stage": lambda src: src.dispatch().map(faulty.with_pid),
    "parallel-stage": lambda src: src.map(faulty.with_pid, parallel=True).dispatch(),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_no_item_runs_in_the_main_process(method: str, stage: str) -> None:
    """num_workers=2 with the default config: every item of epoch 1 and epoch
    2 ran in a worker, never in the main process, and both workers ran items
    in each epoch (N items make several chunks, sent round-robin); for a
    worker stage and a parallel central stage."""
    pipe = STAGES[stage](cp.Pipeline.from_iterable(range(N)))
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=2, start_method=method))
    with cp.Loader(pipe, config) as loader:
        for epoch in (1, 2):
            got = collect(loader)
            assert [x for x, _ in got] == list(range(N))
            pids = {pid for _, pid in got}
            assert os.getpid() not in pids, f"epoch {epoch} ran items in the main process"
            assert pids == set(loader.worker_pids()), f"epoch {epoch}"
            assert len(pids) == 2, f"epoch {epoch}"
            assert loader.metrics()["dispatch"]["inline_items"] == 0


def test_start_inline_is_off_by_default() -> None:
    """The default WorkerConfig (and LoaderConfig, and an empty TOML table)
    never runs worker stages in the main process."""
    assert cp.WorkerConfig().start_inline is False
    assert cp.LoaderConfig().workers.start_inline is False
    assert cp.LoaderConfig.from_dict({"workers": {"num_workers": 2}}).workers.start_inline is False

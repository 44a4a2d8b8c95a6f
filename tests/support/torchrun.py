"""Launching test scripts under torchrun (gloo, CPU), and the harness each rank runs.

The test side: `torchrun` starts a script on local ranks with a free port and
an environment cleared of any outer launcher's variables; `rank_results` runs
it and reads what each rank wrote, showing every rank's traceback on failure.
The rank side: `rank_main` joins the gloo process group, runs the rank's body,
waits for every rank and writes ``OUT/<prefix>rank<r>.json``, or on an error
``OUT/<prefix>error-rank<r>.txt`` with the traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.configs import LAUNCHER_ENV_NAMES

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(
    script: Path, *args: str, nproc: int, timeout_s: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` on ``nproc`` local ranks from the repository root, with the
    repository on ``PYTHONPATH`` (so a rank can import ``tests``); launcher
    variables of an outer job must not leak in."""
    cleared = (*LAUNCHER_ENV_NAMES, "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in cleared}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        # The rendezvous binds a port the kernel picks (port 0): two launches at
        # once (parallel test sessions) never race for one "free" port.
        "--nnodes=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        # A job id of its own (torchrun's default is "none" for every job), as
        # a scheduler would give: what is keyed by the job stays per launch.
        f"--rdzv-id={uuid.uuid4().hex}",
        str(script),
        *args,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def rank_results(
    script: Path, out: Path, *args: str, nproc: int, prefix: str = ""
) -> list[dict[str, Any]]:
    """Run a script whose ranks use `rank_main` (``script OUT *args``) and
    return each rank's result, in rank order."""
    proc = torchrun(script, str(out), *args, nproc=nproc)
    errors = "".join(p.read_text() for p in sorted(out.glob(f"{prefix}error-rank*.txt")))
    assert proc.returncode == 0, errors + proc.stdout + proc.stderr
    return [json.loads((out / f"{prefix}rank{r}.json").read_text()) for r in range(nproc)]


def rank_main(run: Callable[[], dict[str, Any]], out: Path, prefix: str = "") -> int:
    """The body of a rank's ``main()``: ``run()`` inside the gloo process group."""
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo")
        result = run()
        # Every rank reached the end; the parent reads the files after all exit.
        dist.barrier()
        (out / f"{prefix}rank{dist.get_rank()}.json").write_text(json.dumps(result))
        return 0
    except Exception:
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "unknown")
        (out / f"{prefix}error-rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

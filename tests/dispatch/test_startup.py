"""The forkserver starts when a Loader is created and preloads only what the
workers need, so the first item is fast."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import centralpipe as cp
from centralpipe.dispatch.executors.preload import TORCH, WORKER_MODULE, needs_torch, server_preload
from tests.fns import startup_fns, startup_indirect_fns, startup_torch_fns
from tests.fns.startup_pkg import fns as startup_pkg_fns

ROOT = str(Path(__file__).parents[2])

CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {root!r})
    import centralpipe as cp
    from tests.support.leaks import child_pids, is_helper

    def servers():
        return [p for p in child_pids() if is_helper(p) and "forkserver" in open(
            f"/proc/{{p}}/cmdline", "rb").read().decode(errors="replace")]

    def main():
        assert not servers(), "no forkserver before the Loader"
        pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map(abs)
        config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers={workers},
                                                         start_method="forkserver"))
        loader = cp.Loader(pipe, config)
        print(len(servers()), flush=True)
        assert list(loader) == [0, 1, 2, 3]
        loader.close()

    if __name__ == "__main__":
        main()
    """
)


def _servers_after_loader(tmp_path: Path, workers: int) -> int:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(Path(__file__).parents[2]), workers=workers))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True
    )
    return int(done.stdout.split()[0])


def test_loader_starts_the_forkserver_before_iteration(tmp_path: Path) -> None:
    """Creating a Loader with forkserver workers starts the server at once, so
    it imports torch while the program does other work."""
    assert _servers_after_loader(tmp_path, workers=2) == 1


def test_inline_loader_starts_no_server(tmp_path: Path) -> None:
    """num_workers=0 starts no process at all."""
    assert _servers_after_loader(tmp_path, workers=0) == 0


PRELOAD_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {root!r})
    import centralpipe as cp
    from tests.fns import {module}
    from tests.support.leaks import child_pids, is_helper

    def server():
        (pid,) = [p for p in child_pids() if is_helper(p) and "forkserver" in open(
            f"/proc/{{p}}/cmdline", "rb").read().decode(errors="replace")]
        return pid

    def main():
        pipe = cp.Pipeline.from_iterable(range(4)).dispatch().map({module}.torch_loaded)
        # Every item in a worker (none inline while the workers start).
        config = cp.LoaderConfig(workers=cp.WorkerConfig(
            num_workers=2, start_method="forkserver", start_inline=False))
        with cp.Loader(pipe, config) as loader:
            workers = list(loader)
            with open(f"/proc/{{server()}}/maps") as f:
                server_has_torch = "libtorch" in f.read()
        print(server_has_torch, all(workers), any(workers))

    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        pytest.param("startup_fns", "False False False", id="no-torch"),
        pytest.param("startup_torch_fns", "True True True", id="torch-module"),
    ],
)
def test_server_preloads_torch_only_for_workers_that_need_it(
    tmp_path: Path, module: str, expected: str
) -> None:
    """A fresh process's forkserver loads torch only when the worker function's
    module imports it; otherwise neither the server nor its workers import torch."""
    script = tmp_path / "child.py"
    script.write_text(PRELOAD_CHILD.format(root=ROOT, module=module))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == expected.split()


def test_worker_loop_imports_no_torch() -> None:
    """The worker loop, its messages and the package itself import no torch
    (the public names load on first use)."""
    code = (
        f"import sys; sys.path.insert(0, {ROOT!r}); import centralpipe, {WORKER_MODULE}, "
        "centralpipe.plan.specs; print('torch' in sys.modules); centralpipe.Loader; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", "True"]


def _workers(pipe: cp.Pipeline) -> list[object]:
    return list(pipe.worker_stages)


_BASE = cp.Pipeline.from_iterable(range(4)).dispatch()


@pytest.mark.parametrize(
    ("pipe", "expected"),
    [
        pytest.param(_BASE.map(abs), False, id="builtin"),
        pytest.param(_BASE.map(startup_fns.torch_loaded), False, id="torch-free-module"),
        pytest.param(_BASE.map(startup_torch_fns.scale), True, id="torch-module"),
        pytest.param(_BASE.map(startup_indirect_fns.double), True, id="through-another-module"),
        pytest.param(_BASE.map(startup_pkg_fns.triple), True, id="through-its-package"),
        pytest.param(_BASE.map(abs, with_rng=True), True, id="with-rng"),
        pytest.param(_BASE.map(abs).collate(), True, id="default-collate"),
        pytest.param(_BASE.map(lambda x: x), False, id="unpicklable"),
    ],
)
def test_needs_torch_reads_the_worker_functions(pipe: cp.Pipeline, expected: bool) -> None:
    """Workers need torch when a function comes from torch, seeds a torch
    generator, or comes from a module that imports torch, directly, through
    another module or through the package the module is in."""
    assert needs_torch(_workers(pipe)) is expected
    preload = server_preload(_workers(pipe))
    assert preload == ([WORKER_MODULE, TORCH] if expected else [WORKER_MODULE])


def test_needs_torch_of_parallel_central_stages(tmp_path: Path) -> None:
    """A parallel central stage's function counts like a worker stage's."""
    pipe = cp.Pipeline.from_iterable(range(4)).map(startup_torch_fns.scale, parallel=True)
    with cp.Loader(pipe, cp.LoaderConfig()) as loader:
        assert loader._central._preload() == [WORKER_MODULE, TORCH]


def test_progress_stays_the_function_after_its_module_is_imported() -> None:
    """`cp.progress` is the function even once the submodule of the same name
    is imported (the public names load lazily)."""
    import importlib

    module = importlib.import_module("centralpipe.integrations.progress")
    assert cp.progress is module.progress and callable(cp.progress)
    namespace: dict[str, object] = {}
    exec("from centralpipe import progress", namespace)
    assert namespace["progress"] is module.progress

"""The forkserver starts when a Loader is created, so the first item is fast."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {root!r})
    import centralpipe as cp
    from tests._leaks import child_pids, is_helper

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
    script.write_text(CHILD.format(root=str(Path(__file__).parent.parent), workers=workers))
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

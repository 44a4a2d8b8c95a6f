"""The command line: ``python -m centralpipe`` help, ``bench`` and ``inspect``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import centralpipe as cp
from centralpipe.__main__ import main
from centralpipe.tools.bench import SECTIONS

REPO = Path(__file__).resolve().parents[2]
BENCH_TIMEOUT_S = 120
CLI_TIMEOUT_S = 60


def _cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "centralpipe", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_no_arguments_prints_help() -> None:
    """`python -m centralpipe` alone prints the help naming every command."""
    proc = _cli()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m centralpipe")
    for command in ("bench", "inspect", "soak"):
        assert command in proc.stdout


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown command exits with argparse's usage error (status 2)."""
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 30)
def test_quick_bench_prints_a_table() -> None:
    """`bench --scale 100 --only tiny,state --workers 1` runs and prints markdown tables."""
    proc = _cli(
        "bench", "--scale", "100", "--only", "tiny,state", "--workers", "1", timeout=BENCH_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "| workload | workers |" in out
    assert "| tiny | 1 |" in out
    assert "## state_dict()" in out
    assert "## Targets" in out
    assert "Traceback" not in proc.stderr


def test_bench_help_lists_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench --help` prints every option and exits 0."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    options = ("--quick", "--scale", "--workers", "--only", "--repeat", "--retries")
    for option in (*options, "--start-method"):
        assert option in out


def test_bench_rejects_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    """`--only` names the sections it accepts when given an unknown one."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "--only", "tiny,gpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "gpu" in err
    assert ",".join(SECTIONS) in err  # every section, e.g. tiny,cpu,...,stages


@pytest.mark.parametrize("value", ["0", "-3"])
def test_bench_rejects_a_scale_below_one(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--scale` below 1 is refused with exit status 2 before anything runs."""
    assert main(["bench", "--scale", value, "--only", "tiny"]) == 2
    assert f"--scale must be >= 1, got {value}" in capsys.readouterr().err


def _checkpoint(tmp_path: Path) -> Path:
    pipe = cp.Pipeline.from_iterable(range(100)).shuffle(10).count("seen").dispatch().map(str)
    with cp.Loader[str](pipe) as loader:
        for _ in range(3):
            list(loader)  # three finished epochs
        it = iter(loader)  # epoch 4, in progress
        for _ in range(5):
            next(it)
        sd = loader.state_dict()
    path = tmp_path / "ckpt.pt"
    torch.save(sd, path)
    return path


def test_inspect_prints_the_epoch_and_stages(tmp_path: Path) -> None:
    """`inspect PATH` summarises a saved checkpoint: epoch, stages, in-flight items."""
    proc = _cli("inspect", str(_checkpoint(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "epoch: 4 (in progress)" in out
    assert "format_version: 2" in out
    assert "rank / world size: 0 / 1" in out
    assert "shuffle_1 (shuffle):" in out
    assert "seen (count):" in out
    assert "in-flight items at 'dispatch': " in out


def test_inspect_finds_a_nested_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint saved inside a bigger dict is found under its key."""
    sd = torch.load(_checkpoint(tmp_path), weights_only=False)
    path = tmp_path / "train.pt"
    torch.save({"model": {"w": torch.zeros(3)}, "data": sd}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "under key 'data'" in out
    assert "epoch: 4" in out


def test_inspect_explains_a_file_without_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file holding something else exits 1 with a message saying what it holds."""
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "no centralpipe checkpoint" in err
    assert "'weights'" in err
    assert main(["inspect", str(tmp_path / "missing.pt")]) == 1
    assert "no such file" in capsys.readouterr().err


class Opaque:
    """An item of a user's own class: a checkpoint holding it needs pickle to load."""

    def __init__(self, value: int) -> None:
        self.value = value


class _RunsCode:
    """Unpickling this creates a file: what a crafted checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_inspect_loads_with_weights_only_by_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crafted file runs no code: the default load is `weights_only=True`, and the
    refusal names `--unsafe-load`."""
    marker = tmp_path / "ran"
    sd = torch.load(_checkpoint(tmp_path), weights_only=True)
    sd["in_flight"]["dispatch"]["items"] = [_RunsCode(marker)]
    path = tmp_path / "crafted.pt"
    torch.save(sd, path)
    assert main(["inspect", str(path)]) == 1
    assert not marker.exists()
    assert "--unsafe-load" in capsys.readouterr().err


def test_inspect_unsafe_load_reads_items_of_user_classes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--unsafe-load` reads a trusted checkpoint whose items are objects of user classes."""
    pipe = cp.Pipeline.from_iterable([Opaque(i) for i in range(6)]).dispatch().map(id)
    with cp.Loader[int](pipe, cp.LoaderConfig(workers=cp.WorkerConfig(chunk_size=3))) as loader:
        next(iter(loader))
        sd = loader.state_dict()
    path = tmp_path / "trusted.pt"
    torch.save(sd, path)
    assert main(["inspect", str(path)]) == 1
    capsys.readouterr()
    assert main(["inspect", "--unsafe-load", str(path)]) == 0
    assert "in-flight items at 'dispatch': 2" in capsys.readouterr().out


def test_inspect_reports_a_damaged_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A damaged checkpoint is still summarised, and the damage is reported with exit 1."""
    sd = torch.load(_checkpoint(tmp_path), weights_only=True)
    sd["central"]["seen"]["items"] = -4
    path = tmp_path / "damaged.pt"
    torch.save(sd, path)
    assert main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert "seen (count):" in captured.out
    assert "central['seen'].items must be an int >= 0, got -4" in captured.err


def test_inspect_exits_quietly_on_a_closed_pipe(tmp_path: Path) -> None:
    """`inspect PATH | head` with the reader gone exits 0 without a traceback."""
    path = _checkpoint(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "centralpipe", "inspect", str(path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before anything is written
    try:
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=CLI_TIMEOUT_S)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert code == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err


def test_soak_passes_its_arguments_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """`soak ARGS` calls centralpipe.tools.soak.main with ARGS unchanged, options included."""
    import types

    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(list(argv))
        return 3

    fake = types.ModuleType("centralpipe.tools.soak")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "centralpipe.tools.soak", fake)
    assert main(["soak", "--minutes", "1", "--help"]) == 3
    assert seen == [["--minutes", "1", "--help"]]


def test_soak_without_its_module_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without centralpipe.tools.soak, `soak` says so and exits with status 2."""
    monkeypatch.setitem(sys.modules, "centralpipe.tools.soak", None)
    assert main(["soak"]) == 2
    assert "centralpipe.tools.soak" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 30)
def test_quick_seed_bench_prints_its_table() -> None:
    """`bench --scale 100 --only seed` prints a row per tokenizer and contender, and the targets."""
    from centralpipe.tools import bench_seed

    proc = _cli(
        "bench", "--scale", "100", "--only", "seed", "--workers", "2", timeout=BENCH_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "## seed:" in out and "## Targets" in out
    main_table = out.split("## seed:", 1)[1].split("### seed:", 1)[0].splitlines()
    rows = [line for line in main_table if line.startswith("| pure Python |")]
    rows += [line for line in main_table if line.startswith("| BPE (tokenizers) |")]
    contenders = [name for name, _ in bench_seed.CONTENDERS]
    python_rows = [r for r in rows if r.startswith("| pure Python |")]
    assert [r.split(" | ")[1] for r in python_rows] == contenders
    for row in python_rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # main-process CPU per line is in its own table, by thread (below)
        assert len(cells) == 7 and cells[4].endswith("x") and cells[6].endswith("%"), row
    bpe_rows = [r for r in rows if r.startswith("| BPE (tokenizers) |")]
    assert len(bpe_rows) == len(contenders) or (
        len(bpe_rows) == 1 and "skipped: `tokenizers` is not importable" in bpe_rows[0]
    )
    assert "seed, pure-Python tokenizer: >= 20 µs a line" in out
    for ex in ("process", "thread"):
        assert f"seed, pure Python, parallel {ex}, 2 workers: >= 1.2x DataLoader" in out
        assert f"seed, pure Python, parallel {ex}: start-up < 10 % of the epoch" in out
    assert "### seed: main-process CPU per line, by thread" in out
    assert "| pure Python | int32 arrays |" in out and "reads it" in out


def test_seed_bucketizer_matches_bucket_by_max_tokens() -> None:
    """The peers' bucketizer in the seed bench makes the batches centralpipe makes."""
    from centralpipe.tools import bench_seed

    g = torch.Generator().manual_seed(0)
    seqs = [list(range(int(n))) for n in torch.randint(0, 5000, (3000,), generator=g)]
    pipe = cp.Pipeline.from_iterable(seqs).bucket_by_max_tokens(
        bench_seed.MAX_TOKENS, buffer_size=bench_seed.BUFFER, min_len=1
    )
    with cp.Loader[Any](pipe) as loader:
        expected = list(loader)
    assert list(bench_seed.bucketize(iter(seqs))) == expected


def test_seed_report_shows_a_skipped_tokenizer() -> None:
    """A tokenizer that could not be built is one 'skipped' row with its reason, no target."""
    from centralpipe.tools import bench_seed

    res = bench_seed.TokenizerResult("BPE (tokenizers)", skipped="`tokenizers` is not importable")
    lines = bench_seed.report_lines([res])
    assert "| BPE (tokenizers) | skipped: `tokenizers` is not importable | | | | | |" in lines
    assert bench_seed.targets([res]) == []


@pytest.mark.slow
@pytest.mark.timeout(BENCH_TIMEOUT_S + 30)
def test_quick_modes_bench_prints_its_table() -> None:
    """`bench --scale 100 --only modes` prints a row per contender and run, and the target."""
    from centralpipe.tools import bench_modes

    proc = _cli(
        "bench", "--scale", "100", "--only", "modes", "--workers", "2", timeout=BENCH_TIMEOUT_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    out = proc.stdout
    assert "## modes: a training loop" in out and "10 steps after one warm-up" in out
    rows = [
        line
        for line in out.splitlines()
        if line.startswith(("| precomputed", "| DataLoader", "| centralpipe"))
    ]
    names = [name for name, _ in bench_modes.CONTENDERS]
    assert [r.split(" | ")[0].lstrip("| ") for r in rows] == names  # one run each
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and cells[2].endswith("%") and cells[4].endswith("x"), row
    assert 'modes: central="service" loses within 1 point of the DataLoader' in out

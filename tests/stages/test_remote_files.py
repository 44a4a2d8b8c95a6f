"""fsspec paths for every file reader: memory://, file:// and an S3-compatible
server on loopback (moto's standalone server), resumed exactly mid-file."""

from __future__ import annotations

import copy
import functools
import gzip
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import centralpipe as cp
from centralpipe.testing import assert_resumes_exactly, checkpoint_after, collect
from tests.support.configs import loader_config
from tests.support.torchrun import free_port

fsspec = pytest.importorskip("fsspec")

LOCKSTEP = loader_config(buffer_size=1, chunk_size=1)
LINES = [f"line {i} " + "x" * (i % 7) for i in range(30)]
TEXT = ("\n".join(LINES) + "\n").encode()
#: Where the text is cut into two files: after line 10.
CUT = len(("\n".join(LINES[:10]) + "\n").encode())
RECORDS = [{"id": i} for i in range(30)]
JSONL = b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS)
#: Two gzip members, cut inside a line.
JSONL_GZ = gzip.compress(JSONL[:200]) + gzip.compress(JSONL[200:])
SERVER_START_S = 60.0
SERVER_STOP_S = 10.0


@pytest.fixture
def memory_root(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh directory of fsspec's memory filesystem, as a URL ending in /."""
    fs = fsspec.filesystem("memory")
    root = f"/{request.node.name.replace('[', '_').replace(']', '_')}"
    fs.pipe(f"{root}/a.txt", TEXT[:CUT])
    fs.pipe(f"{root}/sub/b.txt", TEXT[CUT:])
    fs.pipe(f"{root}/c.jsonl.gz", JSONL_GZ)
    yield f"memory://{root}/"
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-workers"])
def test_read_lines_over_memory_urls(memory_root: str, workers: int) -> None:
    """A memory:// glob lists sorted matches, names them relative to its root,
    and read_lines resumes exactly at every k."""
    pipe = cp.Pipeline.from_files(memory_root + "**/*.txt").read_lines().dispatch()
    full = assert_resumes_exactly(pipe, loader_config(num_workers=workers))
    assert full == LINES
    state = checkpoint_after(pipe, 3, LOCKSTEP).state["central"]
    assert state["files"]["listing"] == f"a.txt\t{CUT}\nsub/b.txt\t{len(TEXT) - CUT}\n"
    assert state["read_lines_1"]["path"] == "a.txt"


def test_read_jsonl_over_a_memory_url_list(memory_root: str) -> None:
    """A list of URLs is read in order; a gzip file resumes inside its second member."""
    pipe = cp.Pipeline.from_files([memory_root + "c.jsonl.gz"]).read_jsonl(field="id")
    assert assert_resumes_exactly(pipe, LOCKSTEP) == list(range(30))
    state = checkpoint_after(pipe, 25, LOCKSTEP).state["central"]["read_jsonl_1"]
    assert state["path"] == "c.jsonl.gz"
    assert state["block"] == len(gzip.compress(JSONL[:200]))
    consumed = b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS[:25])
    assert state["offset"] == len(consumed) - 200


def test_file_urls_resume_and_move(tmp_path: Path) -> None:
    """file:// URLs read as local paths do; a checkpoint resumes with the data moved."""
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.txt").write_bytes(TEXT)
    pipe = cp.Pipeline.from_files(f"file://{tmp_path}/one/*.txt").read_lines()
    assert assert_resumes_exactly(pipe, LOCKSTEP) == LINES
    state = checkpoint_after(pipe, 7, LOCKSTEP).state
    moved = cp.Pipeline.from_files(f"file://{tmp_path}/two/*.txt").read_lines()
    with cp.Loader(moved, LOCKSTEP) as loader:
        loader.load_state_dict(state)
        assert collect(loader) == LINES[7:]


def test_a_changed_memory_file_is_refused(memory_root: str) -> None:
    """A remote file whose size changed since the checkpoint is a CheckpointError."""
    pipe = cp.Pipeline.from_files(memory_root + "*.txt").read_lines()
    state = checkpoint_after(pipe, 2, LOCKSTEP).state
    fsspec.filesystem("memory").pipe(memory_root.removeprefix("memory://") + "a.txt", TEXT[:90])
    changed = rf"changed size: a.txt \({CUT} -> 90 bytes\)"
    with cp.Loader(pipe, LOCKSTEP) as loader, pytest.raises(cp.CheckpointError, match=changed):
        loader.load_state_dict(state)


def test_a_remote_offset_past_the_end_is_refused(memory_root: str) -> None:
    """A damaged offset in a remote file is refused at load, as a local one is."""
    pipe = cp.Pipeline.from_files(memory_root + "*.txt").read_lines()
    state = copy.deepcopy(checkpoint_after(pipe, 2, LOCKSTEP).state)
    state["central"]["read_lines_1"]["offset"] = 10**6
    past = "resumes at byte 1000000"
    with cp.Loader(pipe, LOCKSTEP) as loader, pytest.raises(cp.CheckpointError, match=past):
        loader.load_state_dict(state)


def test_a_url_glob_matching_nothing_says_so(memory_root: str) -> None:
    """A remote glob with no match is a PipelineError naming the glob."""
    pipe = cp.Pipeline.from_files(memory_root + "*.parquet").read_lines()
    with pytest.raises(cp.PipelineError, match=r"matches no file"):
        cp.Loader(pipe)


@pytest.mark.parametrize(
    ("missing", "url"),
    [("fsspec.core", "memory://x/*.txt"), ("s3fs", "s3://bucket/*.txt")],
    ids=["no-fsspec", "no-s3fs"],
)
def test_a_missing_package_names_the_remote_extra(
    monkeypatch: pytest.MonkeyPatch, missing: str, url: str
) -> None:
    """Without fsspec (or the protocol's package) a URL is a PipelineError naming the extra."""
    monkeypatch.setitem(sys.modules, missing, None)
    if missing == "s3fs":
        monkeypatch.delitem(sys.modules, "s3fs.core", raising=False)
    pipe = cp.Pipeline.from_files(url).read_lines()
    with pytest.raises(cp.PipelineError, match=r"pip install 'centralpipe\[remote\]'"):
        cp.Loader(pipe)


# -- an S3-compatible server on loopback ---------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on a free loopback port (skipped without moto)."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    port = free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip("moto's S3 server did not start")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=SERVER_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=SERVER_STOP_S)


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Any:
    """An s3fs filesystem on the server, set as fsspec's configuration for s3://,
    with a fresh bucket holding the test files."""
    import s3fs

    options = {
        "endpoint_url": s3_endpoint,
        "key": "test",
        "secret": "test",
        "client_kwargs": {"region_name": "eu-west-1"},
    }
    monkeypatch.setitem(fsspec.config.conf, "s3", options)
    fs = s3fs.S3FileSystem(**options)
    bucket = "b-" + request.node.name.lower().replace("_", "-").replace("[", "-").strip("]-")[-50:]
    fs.mkdir(bucket)
    fs.pipe(f"{bucket}/text/a.txt", TEXT[:CUT])
    fs.pipe(f"{bucket}/text/b.txt", TEXT[CUT:])
    fs.pipe(f"{bucket}/c.jsonl.gz", JSONL_GZ)
    fs.bucket = bucket
    return fs


def test_s3_read_lines_and_jsonl_resume_exactly(s3: Any) -> None:
    """s3:// globs read through the server resume exactly, mid-file and mid-member,
    from 2 workers into an inline loader."""
    config, inline = loader_config(num_workers=2), loader_config()
    lines = cp.Pipeline.from_files(f"s3://{s3.bucket}/text/*.txt").read_lines().dispatch()
    full = assert_resumes_exactly(lines, config, resume_config=inline, ks=range(0, 31, 3))
    assert full == LINES
    records = cp.Pipeline.from_files(f"s3://{s3.bucket}/*.gz").read_jsonl(field="id").dispatch()
    ks = [0, 1, 12, 25, 29, 30]
    assert assert_resumes_exactly(records, config, resume_config=inline, ks=ks) == list(range(30))
    state = checkpoint_after(lines, 3, LOCKSTEP).state["central"]
    assert state["files"]["listing"] == f"a.txt\t{CUT}\nb.txt\t{len(TEXT) - CUT}\n"


def test_s3_a_changed_object_is_refused(s3: Any) -> None:
    """An object rewritten with another size since the checkpoint is a CheckpointError."""
    pipe = cp.Pipeline.from_files(f"s3://{s3.bucket}/text/*.txt").read_lines()
    state = checkpoint_after(pipe, 2, LOCKSTEP).state
    s3.pipe(f"{s3.bucket}/text/a.txt", TEXT[:50])
    changed = rf"changed size: a.txt \({CUT} -> 50 bytes\)"
    with cp.Loader(pipe, LOCKSTEP) as loader, pytest.raises(cp.CheckpointError, match=changed):
        loader.load_state_dict(state)


def test_import_centralpipe_imports_no_optional_package() -> None:
    """`import centralpipe` imports none of the readers' optional packages."""
    optional = ("pyarrow", "datasets", "zstandard", "s3fs", "fsspec")
    code = (
        "import sys, centralpipe, centralpipe.stages; "
        f"print([m for m in {optional!r} if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_fsspec_caching_by_url_chaining(memory_root: str) -> None:
    """fsspec's own caching options pass through as URL chains (simplecache::...)."""
    pipe = cp.Pipeline.from_files("simplecache::" + memory_root + "*.txt").read_lines()
    assert assert_resumes_exactly(pipe, LOCKSTEP) == LINES[:10]
    state = checkpoint_after(pipe, 3, LOCKSTEP).state["central"]
    assert state["files"]["listing"] == f"a.txt\t{CUT}\n"
    offset = len(("\n".join(LINES[:3]) + "\n").encode())
    assert state["read_lines_1"] == {"path": "a.txt", "offset": offset}


# -- an HTTP server on loopback ------------------------------------------------


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A directory served over HTTP with Range requests (RangeHTTPServer's handler,
    what fsspec's HTTP filesystem needs to seek) on a free loopback port, in a
    thread: its URL (ending in /) and the directory."""
    pytest.importorskip("aiohttp")
    handler_module = pytest.importorskip("RangeHTTPServer")

    class Quiet(handler_module.RangeRequestHandler):  # type: ignore[misc, name-defined]
        def log_message(self, *args: Any) -> None:
            pass

    root = tmp_path / "served"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_bytes(TEXT[:CUT])
    (root / "sub" / "b.txt").write_bytes(TEXT[CUT:])
    (root / "c.jsonl.gz").write_bytes(JSONL_GZ)
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist(RECORDS), str(root / "d.parquet"), row_group_size=7)
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, name="http-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", root
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=SERVER_STOP_S)


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "2-workers"])
def test_http_readers_resume_exactly(http_root: tuple[str, Path], workers: int) -> None:
    """http:// globs (from the server's index pages) and lists: read_lines, read_jsonl
    (at every k inline, inside its second gzip member) and read_parquet mid row group
    resume exactly, across worker counts; files are named relative to the root, with
    their sizes."""
    url, _ = http_root
    config, inline = loader_config(num_workers=workers), loader_config()
    # The ends, both files, both gzip members, row groups; read_jsonl inline at every k.
    ks = [0, 1, 9, 10, 11, 17, 25, 29, 30]
    lines = cp.Pipeline.from_files([url + "a.txt", url + "sub/b.txt"]).read_lines().dispatch()
    assert assert_resumes_exactly(lines, config, resume_config=inline, ks=ks) == LINES
    state = checkpoint_after(lines, 3, LOCKSTEP).state["central"]
    assert state["files"]["listing"] == f"a.txt\t{CUT}\nsub/b.txt\t{len(TEXT) - CUT}\n"
    records = cp.Pipeline.from_files(url + "*.jsonl.gz").read_jsonl(field="id").dispatch()
    every = None if workers == 0 else ks
    assert assert_resumes_exactly(records, config, resume_config=inline, ks=every) == list(
        range(30)
    )
    inner = checkpoint_after(records, 25, LOCKSTEP).state["central"]["read_jsonl_1"]
    assert inner["path"] == "c.jsonl.gz" and inner["block"] > 0 and inner["offset"] > 0
    rows = cp.Pipeline.from_files(url + "*.parquet").read_parquet(columns=["id"]).dispatch()
    assert assert_resumes_exactly(rows, config, resume_config=inline, ks=ks) == RECORDS
    assert checkpoint_after(rows, 17, LOCKSTEP).state["central"]["read_parquet_1"] == {
        "path": "d.parquet",
        "row_group": 2,
        "row": 3,
    }
    with cp.Loader(rows) as loader:
        assert len(loader) == 30  # the footer, read over HTTP


@pytest.mark.parametrize(
    ("glob", "stage", "changes", "match"),
    [
        ("*.txt", "read_lines_1", {"offset": 10**6}, "resumes at byte 1000000"),
        ("*.txt", "read_lines_1", {"offset": 5}, "not the start of a line"),
        ("*.gz", "read_jsonl_1", {"block": 10**6}, "resumes at byte 1000000"),
        ("*.gz", "read_jsonl_1", {"offset": 10**6}, "fewer than 1000000"),
        ("*.parquet", "read_parquet_1", {"row_group": 9}, "but the file has 5 row groups"),
        ("*.parquet", "read_parquet_1", {"row": 8}, "which has 7 rows"),
    ],
    ids=[
        "lines-past-end",
        "lines-mid-line",
        "jsonl-block-past-end",
        "jsonl-offset-past-block",
        "parquet-group-out-of-range",
        "parquet-row-past-group",
    ],
)
def test_http_damaged_positions_are_refused_at_load(
    http_root: tuple[str, Path], glob: str, stage: str, changes: dict[str, Any], match: str
) -> None:
    """A position a remote file cannot have is a CheckpointError at load, as locally."""
    url, _ = http_root
    pipe = cp.Pipeline.from_files(url + glob)
    pipe = {"read_lines_1": pipe.read_lines, "read_jsonl_1": pipe.read_jsonl}.get(
        stage, pipe.read_parquet
    )()
    state = copy.deepcopy(checkpoint_after(pipe, 2, LOCKSTEP).state)
    state["central"][stage].update(changes)
    with cp.Loader(pipe, LOCKSTEP) as loader, pytest.raises(cp.CheckpointError, match=match):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    ("glob", "rewrite", "match"),
    [
        ("*.txt", lambda p: p.write_bytes(TEXT[:50]), rf"changed size: a.txt \({CUT} -> 50"),
        ("*.parquet", lambda p: p.write_bytes(b"x" * p.stat().st_size), "cannot resume"),
    ],
    ids=["resized", "same-size-not-parquet"],
)
def test_http_a_changed_file_is_refused(
    http_root: tuple[str, Path], glob: str, rewrite: Any, match: str
) -> None:
    """A file changed on the server since the checkpoint is a CheckpointError at load."""
    url, root = http_root
    pipe = cp.Pipeline.from_files(url + glob)
    pipe = pipe.read_lines() if glob == "*.txt" else pipe.read_parquet()
    state = checkpoint_after(pipe, 2, LOCKSTEP).state
    rewrite(root / ("a.txt" if glob == "*.txt" else "d.parquet"))
    with cp.Loader(pipe, LOCKSTEP) as loader, pytest.raises(cp.CheckpointError, match=match):
        loader.load_state_dict(state)


def test_http_through_fsspec_simplecache(
    http_root: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """simplecache::http:// reads each file once into fsspec's local cache (its
    options from fsspec's configuration) and resumes exactly from it."""
    url, _ = http_root
    cache = tmp_path / "cache"
    monkeypatch.setitem(fsspec.config.conf, "simplecache", {"cache_storage": str(cache)})
    pipe = cp.Pipeline.from_files("simplecache::" + url + "*.jsonl.gz").read_jsonl(field="id")
    assert assert_resumes_exactly(pipe, LOCKSTEP, ks=[0, 1, 12, 25, 30]) == list(range(30))
    assert checkpoint_after(pipe, 25, LOCKSTEP).state["central"]["files"]["listing"] == (
        f"c.jsonl.gz\t{len(JSONL_GZ)}\n"
    )
    assert [p.stat().st_size for p in cache.iterdir() if p.is_file() and p.suffix != ".json"] == [
        len(JSONL_GZ)
    ]

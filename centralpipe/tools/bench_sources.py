"""The ``sources`` section of ``python -m centralpipe bench``: each file reader
against the library it wraps used directly, on generated files.

For each reader, rows per second of draining its central chain (no Loader, no
workers: the feeder's own work in the main process) next to a plain loop over
the same file with the library alone (``json.loads`` over the lines of
``open``/``gzip.open``/a zstd stream, pyarrow's ``iter_batches``, iteration of a
``datasets.Dataset``), best of ``REPEATS`` each, run in turns. Mid-file, the
size of the checkpoint (``torch.save`` bytes) and the time of
``state_dict()``; and for compressed files the time of ``load_state_dict`` near
the end of the file, written as one block and as blocks of ``BLOCK_BYTES``
(what a resume costs). Readers whose optional package is missing are left out.
"""

from __future__ import annotations

import gc
import gzip
import importlib.util
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import centralpipe as cp
from centralpipe.stages import RunContext, build_central

__all__ = ["RATIO_TARGET", "measure", "report_lines", "targets"]

REPEATS = 3
#: Records at scale 1 (about 200 bytes each as JSON: some 200 MB per plain file).
RECORDS = 1_000_000
#: The size of a gzip member / zstd frame in the "blocks" files.
BLOCK_BYTES = 4 << 20
STATE_CALLS = 20
#: A reader's rows/s over the direct loop's.
RATIO_TARGET = 0.85


def _records(n: int) -> Iterator[bytes]:
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
    for i in range(n):
        text = " ".join(words[(i + j) % 8] for j in range(20 + i % 7))
        yield json.dumps({"id": i, "text": text, "score": i / 7}).encode() + b"\n"


def _write_files(root: Path, n: int) -> dict[str, Path]:
    import zstandard

    plain = root / "data.jsonl"
    with open(plain, "wb") as f:
        for line in _records(n):
            f.write(line)
    data = plain.read_bytes()
    out = {"plain": plain}
    one = root / "one.jsonl.gz"
    one.write_bytes(gzip.compress(data, compresslevel=1))
    out["gzip"] = one
    pieces = [data[i : i + BLOCK_BYTES] for i in range(0, len(data), BLOCK_BYTES)]
    blocks = root / "blocks.jsonl.gz"
    blocks.write_bytes(b"".join(gzip.compress(p, compresslevel=1) for p in pieces))
    out["gzip_blocks"] = blocks
    zc = zstandard.ZstdCompressor(level=3)
    z = root / "blocks.jsonl.zst"
    z.write_bytes(b"".join(zc.compress(p) for p in pieces))
    out["zstd_blocks"] = z
    if importlib.util.find_spec("pyarrow") is not None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [json.loads(line) for line in data.splitlines()]
        pq.write_table(pa.Table.from_pylist(rows), root / "data.parquet", row_group_size=65_536)
        out["parquet"] = root / "data.parquet"
    return out


def _best_of_pair(
    reader: Callable[[], int], direct: Callable[[], int]
) -> tuple[tuple[float, int], tuple[float, int]]:
    """Best seconds (and items) of each of two loops, run in turns ``REPEATS``
    times, so a busy spell of a shared machine slows both alike."""
    best = [float("inf"), float("inf")]
    items = [0, 0]
    gc.disable()
    try:
        for _ in range(REPEATS):
            for i, fn in enumerate((reader, direct)):
                start = time.perf_counter()
                items[i] = fn()
                best[i] = min(best[i], time.perf_counter() - start)
    finally:
        gc.enable()
    return (best[0], items[0]), (best[1], items[1])


def _drain(pipe: cp.Pipeline) -> int:
    nodes = build_central(pipe.central_stages, RunContext())
    for node in nodes:
        node.prepare()
    tip = nodes[-1]
    tip.load_flat(None)
    buf: list[Any] = []
    n = 0
    try:
        while True:
            try:
                tip.pull_into(buf, 1024)
            except StopIteration:
                return n + len(buf)
            n += len(buf)
            buf.clear()  # as the direct loops, keep nothing
    finally:
        tip.release()


def _lines_direct(opener: Callable[[], Any]) -> Callable[[], int]:
    def run() -> int:
        n = 0
        with opener() as f:
            for line in f:
                json.loads(line)
                n += 1
        return n

    return run


def _zstd_open(path: Path) -> Any:
    import zstandard

    raw = open(path, "rb")  # noqa: SIM115 - closed with the reader
    reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    return io.BufferedReader(reader)


def _state_figures(pipe: cp.Pipeline, k: int) -> dict[str, float]:
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=0, chunk_size=1))
    loader: cp.Loader[Any]
    with cp.Loader(pipe, config) as loader:
        it: Iterator[Any] = iter(loader)
        for _ in range(k):
            next(it)
        times = []
        for _ in range(STATE_CALLS):
            start = time.perf_counter()
            state = loader.state_dict()
            times.append(time.perf_counter() - start)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return {"state_bytes": buffer.tell(), "state_dict_s": statistics.median(times)}


def _resume_s(pipe: cp.Pipeline, k: int) -> float:
    """Seconds of ``load_state_dict`` at item ``k`` (a fresh Loader each time, best of 3)."""
    config = cp.LoaderConfig(workers=cp.WorkerConfig(num_workers=0, chunk_size=1))
    loader: cp.Loader[Any]
    with cp.Loader(pipe, config) as loader:
        it: Iterator[Any] = iter(loader)
        for _ in range(k):
            next(it)
        state = loader.state_dict()
    best = float("inf")
    for _ in range(REPEATS):
        with cp.Loader(pipe, config) as loader:
            start = time.perf_counter()
            loader.load_state_dict(state)
            best = min(best, time.perf_counter() - start)
    return best


def measure(scale: int = 1, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Rows/s of each reader and of its direct loop, state figures and resume times."""
    if importlib.util.find_spec("zstandard") is None:
        log("sources: zstandard is not installed (centralpipe[zstd]); section skipped")
        return {}
    n = RECORDS // scale
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="centralpipe-bench-sources-") as tmp:
        log(f"sources: writing {n:,} records as JSON lines, gzip, zstd, Parquet")
        files = _write_files(Path(tmp), n)
        plain_mb = files["plain"].stat().st_size / 1e6
        cases: list[tuple[str, str, cp.Pipeline, Callable[[], int], str]] = [
            (
                "jsonl",
                "plain",
                cp.Pipeline.from_files([str(files["plain"])]).read_jsonl(),
                _lines_direct(lambda: open(files["plain"], "rb")),  # noqa: SIM115 - opened in a with
                "json.loads over open(path, 'rb')",
            ),
            (
                "jsonl_gzip",
                "gzip_blocks",
                cp.Pipeline.from_files([str(files["gzip_blocks"])]).read_jsonl(),
                _lines_direct(lambda: gzip.open(files["gzip_blocks"], "rb")),  # noqa: SIM115
                "json.loads over gzip.open(path)",
            ),
            (
                "jsonl_zstd",
                "zstd_blocks",
                cp.Pipeline.from_files([str(files["zstd_blocks"])]).read_jsonl(),
                _lines_direct(lambda: _zstd_open(files["zstd_blocks"])),
                "json.loads over a zstandard stream_reader",
            ),
        ]
        if "parquet" in files:
            import pyarrow.parquet as pq

            path = files["parquet"]

            def rows_direct() -> int:
                f = pq.ParquetFile(path)
                return sum(len(b.to_pylist()) for b in f.iter_batches(batch_size=1024))

            def batches_direct() -> int:
                f = pq.ParquetFile(path)
                return sum(1 for _ in f.iter_batches(batch_size=4096))

            paths = [str(path)]
            cases.append(
                (
                    "parquet_rows",
                    "parquet",
                    cp.Pipeline.from_files(paths).read_parquet(),
                    rows_direct,
                    "ParquetFile.iter_batches(1024) + RecordBatch.to_pylist",
                )
            )
            cases.append(
                (
                    "parquet_batches",
                    "parquet",
                    cp.Pipeline.from_files(paths).read_parquet(batch_rows=4096),
                    batches_direct,
                    "ParquetFile.iter_batches(4096)",
                )
            )
        if "parquet" in files and importlib.util.find_spec("datasets") is not None:
            import datasets
            import pyarrow.parquet as pq

            table = datasets.table.InMemoryTable(pq.read_table(files["parquet"]))
            ds = datasets.Dataset(table)
            ids = ds.to_iterable_dataset(num_shards=4)

            def ds_direct() -> int:
                return sum(1 for _ in ds)

            def ids_direct() -> int:
                return sum(1 for _ in ids)

            cases.append(
                ("hf_dataset", "parquet", cp.Pipeline.from_dataset(ds), ds_direct, "for row in ds")
            )
            cases.append(
                (
                    "hf_iterable",
                    "parquet",
                    cp.Pipeline.from_iterable(ids),
                    ids_direct,
                    "for row in ds.to_iterable_dataset(num_shards=4)",
                )
            )
        for name, file_key, pipe, direct, what in cases:
            log(f"sources: {name}")
            (reader_s, items), (direct_s, direct_items) = _best_of_pair(
                lambda p=pipe: _drain(p),  # type: ignore[misc]
                direct,
            )
            rows = n  # batches too: rows per second
            out[name] = {
                "rows": rows,
                "file_mb": files[file_key].stat().st_size / 1e6,
                "reader_rows_s": rows / reader_s,
                "direct_rows_s": rows / direct_s,
                "direct_items": direct_items,
                "what": what,
                **_state_figures(pipe, items // 2),
            }
        log("sources: resume cost of gzip, one member vs members of 4 MB")
        k = n - n // 20
        for key in ("gzip", "gzip_blocks"):
            pipe = cp.Pipeline.from_files([str(files[key])]).read_jsonl()
            out[f"resume_{key}"] = {"at_row": k, "load_s": _resume_s(pipe, k)}
        out["plain_mb"] = plain_mb
    return out


def report_lines(sources: dict[str, Any]) -> list[str]:
    if not sources:
        return []
    lines = [
        "",
        "## Sources (file readers against the library alone)",
        "",
        f"Rows/s draining each reader's central chain (no workers) vs a plain loop over the "
        f"same file with the library alone, best of {REPEATS}; JSON lines of "
        f"{sources['plain_mb']:.0f} MB uncompressed. State mid-file.",
        "",
        "| reader | direct loop | file MB | reader rows/s | direct rows/s | ratio "
        "| state bytes | state_dict() µs |",
        "|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    for key, r in sources.items():
        if not isinstance(r, dict) or "reader_rows_s" not in r:
            continue
        ratio = r["reader_rows_s"] / r["direct_rows_s"]
        lines.append(
            f"| {key} | {r['what']} | {r['file_mb']:.0f} | {r['reader_rows_s']:,.0f} | "
            f"{r['direct_rows_s']:,.0f} | {ratio:.2f} | {r['state_bytes']:,} | "
            f"{r['state_dict_s'] * 1e6:.0f} |"
        )
    one, blocks = sources["resume_gzip"], sources["resume_gzip_blocks"]
    lines += [
        "",
        f"Resume (load_state_dict) at row {one['at_row']:,} of a gzip file: one member "
        f"{one['load_s'] * 1e3:.1f} ms, members of {BLOCK_BYTES >> 20} MB "
        f"{blocks['load_s'] * 1e3:.1f} ms.",
    ]
    return lines


def targets(sources: dict[str, Any]) -> list[tuple[str, str, bool]]:
    out = []
    for key, r in sources.items():
        if isinstance(r, dict) and "reader_rows_s" in r:
            ratio = r["reader_rows_s"] / r["direct_rows_s"]
            label = f"{key}: within 15 % of the direct loop"
            out.append((label, f"{ratio:.2f}x", ratio >= RATIO_TARGET))
    return out

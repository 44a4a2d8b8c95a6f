"""The ``sources`` section of ``python -m centralpipe bench`` (readers vs the libraries)."""

from __future__ import annotations

import pytest

from centralpipe.tools import bench_sources

pytest.importorskip("zstandard")
pytest.importorskip("pyarrow")
pytest.importorskip("datasets")

READERS = {
    "jsonl",
    "jsonl_gzip",
    "jsonl_zstd",
    "parquet_rows",
    "parquet_batches",
    "hf_dataset",
    "hf_iterable",
}


def test_measure_reports_every_reader_its_state_and_the_resume_cost() -> None:
    """measure() on tiny files gives rows/s of each reader and its direct loop, state
    figures, the gzip resume times, a report table and one target per reader."""
    sources = bench_sources.measure(scale=2000)  # 500 records
    readers = {k for k, r in sources.items() if isinstance(r, dict) and "reader_rows_s" in r}
    assert readers == READERS
    for key in READERS:
        r = sources[key]
        assert r["rows"] == 500 and r["reader_rows_s"] > 0 and r["direct_rows_s"] > 0
        assert r["state_bytes"] > 0 and r["state_dict_s"] > 0
    assert sources["parquet_batches"]["direct_items"] == 1  # one batch of 4096 rows holds all
    assert {sources[k]["at_row"] for k in ("resume_gzip", "resume_gzip_blocks")} == {475}
    lines = bench_sources.report_lines(sources)
    assert lines[1] == "## Sources (file readers against the library alone)"
    assert sum(line.startswith(("| jsonl", "| parquet", "| hf")) for line in lines) == 7
    assert [t[0] for t in bench_sources.targets(sources)] == [
        f"{key}: within 15 % of the direct loop" for key in sources if key in READERS
    ]
    assert bench_sources.report_lines({}) == [] and bench_sources.targets({}) == []

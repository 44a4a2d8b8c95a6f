"""``read_parquet``: paths in, rows (dicts) or column batches out, resuming at
(file, row group, row).

Files are read one row group at a time, and only the chosen ``columns``
(pyarrow's ``ParquetFile.iter_batches`` over that one row group, as a plain
loop over the file would read it): memory holds the batches of one row group
of those columns, never the whole file. With ``batch_rows=None`` each item is
one row, a dict of column name to value (``RecordBatch.to_pylist``, converted
``ROWS_AT_ONCE`` rows at a time); with ``batch_rows=n`` each item is a
``pyarrow.RecordBatch`` of up to ``n`` rows of one row group, cut at multiples
of ``n`` from the row group's start (the last batch of a row group may be
shorter): the reader's own batch when it is that, else sliced from its batches.

The state is the open file (relative to the files stage's root), the row
group and the rows of it already yielded. A resume reads the file's footer and
that one row group, and starts at the row: the rows before it are decoded but
never yielded or converted again. A row group or row out of range of the
file, or a file that is no longer Parquet, is a ``CheckpointError`` at load.

Needs the optional package ``pyarrow`` (``centralpipe[parquet]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.errors import CheckpointError
from centralpipe.plan.options import ReadParquetOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import CentralNode, RunContext
from centralpipe.stages.counts import cached_count
from centralpipe.stages.files import (
    check_current_file,
    resolve_name,
    resumable_size,
    state_name,
)
from centralpipe.stages.fs import is_url, need, open_binary
from centralpipe.validators import FieldError, checked, int_in

__all__ = ["ReadParquet", "ReadParquetState"]

#: Rows converted to dicts at a time (rows mode).
ROWS_AT_ONCE = 1024
_COUNT = checked(FieldError, "an int >= 0", int_in(0, 2**63))


@attrs.frozen(kw_only=True)
class ReadParquetState:
    """The open file (``None`` between files), its row group and the rows of
    that row group already yielded."""

    path: str | None = attrs.field(
        validator=checked(FieldError, "None or a str", v.optional(v.instance_of(str)))
    )
    row_group: int = attrs.field(validator=_COUNT)
    row: int = attrs.field(validator=_COUNT)

    def __attrs_post_init__(self) -> None:
        if self.path is None and (self.row_group or self.row):
            raise FieldError("row", "0 when no file is open (path is None)", self.row)


class ReadParquet(CentralNode[Any]):
    kind = "read_parquet"
    State = ReadParquetState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> ReadParquet:
        o = spec.options_as(ReadParquetOptions)
        return cls(source, columns=o.columns, batch_rows=o.batch_rows, name=spec.name, ctx=ctx)

    def __init__(
        self,
        source: BaseNode[Any],
        *,
        columns: tuple[str, ...] | None,
        batch_rows: int | None,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._columns = None if columns is None else list(columns)
        self._batch_rows = batch_rows
        self._path: str | None = None
        self._file: Any = None  # pyarrow.parquet.ParquetFile
        self._raw: Any = None  # the fsspec file it reads, for URLs
        self._row_group = 0
        self._row = 0
        #: The current row group's reader (``iter_batches`` of it), its rows,
        #: its last batch read, that batch's first row and the next one's.
        self._group: Any = None
        self._group_rows = 0
        self._batch: Any = None
        self._batch_at = 0
        self._next_at = 0
        self._rows: list[dict[str, Any]] = []  # rows mode: converted rows
        self._rows_at = 0  # the row of _rows[0]

    def produce(self) -> Any:
        while True:
            if self._file is None:
                if self._path is None:
                    assert self.source is not None
                    self._path = str(next(self.source))
                    self._row_group = self._row = 0
                try:
                    self._open(self._path)
                except BaseException as exc:
                    if isinstance(exc, Exception):  # not interrupted: this file is skipped
                        self._path, self._row_group, self._row = None, 0, 0
                    raise
            if self._row_group >= self._file.num_row_groups:
                self._close()
                continue
            batch = self._batch_of(self._row)
            if batch is None:  # the row group is done
                self._row_group += 1
                self._row = 0
                self._end_group()
                continue
            row, at = self._row, self._row - self._batch_at
            if self._batch_rows is None:
                i = row - self._rows_at
                if not 0 <= i < len(self._rows):
                    # Converted from the row on: rows before a resume point never are.
                    self._rows = batch.slice(at).to_pylist()
                    self._rows_at, i = row, 0
                self._row = row + 1
                return self._rows[i]
            n = min(self._batch_rows, self._group_rows - row)
            if at == 0 and batch.num_rows == n:
                self._row = row + n
                return batch  # the reader's own batch, as iter_batches gives it
            out = self._cut(row, n)
            self._row = row + n
            return out

    def produce_into(self, out: list[Any], n: int) -> None:
        # Rows mode: after one produce() (which opens files and converts rows),
        # the rest of the converted rows in one slice.
        if self._batch_rows is not None:
            super().produce_into(out, n)
            return
        out.append(self.produce())
        at = self._row - self._rows_at
        take = min(n - 1, len(self._rows) - at)
        if take <= 0:
            return
        before = len(out)
        try:
            out.extend(self._rows[at : at + take])
        finally:
            self._row += len(out) - before  # only the rows handed out count

    def _batch_of(self, row: int) -> Any:
        """The reader's batch holding ``row`` of the current row group (``None``
        past its last row), reading forward from the last one."""
        if self._group is None:
            self._group = self._file.iter_batches(
                batch_size=self._batch_rows or ROWS_AT_ONCE,
                row_groups=[self._row_group],
                columns=self._columns,
            )
            self._group_rows = self._file.metadata.row_group(self._row_group).num_rows
            self._batch, self._batch_at, self._next_at = None, 0, 0
        batch = self._batch
        while batch is None or row >= self._batch_at + batch.num_rows:
            if row >= self._group_rows:
                return None
            batch = next(self._group, None)
            if batch is None:
                return None
            self._batch, self._batch_at = batch, self._next_at
            self._next_at += batch.num_rows
        return batch

    def _cut(self, row: int, n: int) -> Any:
        """Rows ``row .. row + n`` of the row group as one batch, from the
        reader's batches when theirs do not fall at multiples of ``batch_rows``."""
        pa = need("pyarrow", f"stage '{self.name}' (read_parquet)")
        parts = []
        while n:
            batch = self._batch_of(row)
            assert batch is not None  # n never passes the row group's rows
            part = batch.slice(row - self._batch_at, n)
            parts.append(part)
            row += part.num_rows
            n -= part.num_rows
        if len(parts) == 1:
            return parts[0]
        return pa.Table.from_batches(parts).combine_chunks().to_batches()[0]

    #: :meth:`items_in` is exact: the footers say.
    items_exact = True

    def items_in(self, path: str) -> int | None:
        """The items of one file, for known totals: from its footer, the rows,
        or per row group its rows over ``batch_rows`` rounded up (cached by
        size and mtime; for URLs, by size: one footer read per file)."""
        return cached_count(path, ("parquet", self._batch_rows), self._count)

    def _count(self, path: str) -> int:
        f, raw = self._parquet(path)
        try:
            meta = f.metadata
            rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        finally:
            f.close()
            if raw is not None:
                raw.close()
        if self._batch_rows is None:
            return sum(rows)
        return sum(-(-n // self._batch_rows) for n in rows)

    def own_state(self) -> dict[str, Any]:
        return {
            "path": state_name(self.source, self._path),
            "row_group": self._row_group if self._path is not None else 0,
            "row": self._row if self._path is not None else 0,
        }

    def check_state(self, state: ReadParquetState, states: Mapping[str, Any]) -> None:
        check_current_file(self.source, state.path, states)
        if state.path is None:
            return
        path = resolve_name(self.source, state.path)
        resumable_size(self.name, path)
        try:
            f, raw = self._parquet(path)
        except CheckpointError:
            raise
        except Exception as exc:
            msg = f"stage '{self.name}': cannot resume {path!r}: {exc}"
            raise CheckpointError(msg) from None
        try:
            groups = f.num_row_groups
            if state.row_group > groups or (state.row_group == groups and state.row):
                msg = (
                    f"stage '{self.name}': the checkpoint resumes {path!r} at row group "
                    f"{state.row_group}, row {state.row}, but the file has {groups} row "
                    "groups; the file changed since the checkpoint."
                )
                raise CheckpointError(msg)
            if state.row_group < groups:
                rows = f.metadata.row_group(state.row_group).num_rows
                if state.row > rows:
                    msg = (
                        f"stage '{self.name}': the checkpoint resumes {path!r} at row "
                        f"{state.row} of row group {state.row_group}, which has {rows} rows; "
                        "the file changed since the checkpoint."
                    )
                    raise CheckpointError(msg)
        finally:
            if raw is not None:
                raw.close()

    def restore(self, state: dict[str, Any] | None) -> None:
        self._close()
        if state is None or state["path"] is None:
            return
        self._open(resolve_name(self.source, state["path"]))
        self._row_group, self._row = state["row_group"], state["row"]

    def release(self) -> None:
        self._close()
        super().release()

    def _parquet(self, path: str) -> tuple[Any, Any]:
        pq = need("pyarrow.parquet", f"stage '{self.name}' (read_parquet)")
        raw = open_binary(path, f"stage '{self.name}'") if is_url(path) else None
        try:
            f = pq.ParquetFile(raw if raw is not None else path)
        except BaseException:
            if raw is not None:
                raw.close()
            raise
        return f, raw

    def _open(self, path: str) -> None:
        f, raw = self._parquet(path)
        if self._columns is not None:
            names = f.schema_arrow.names
            missing = [c for c in self._columns if c not in names]
            if missing:
                if raw is not None:
                    raw.close()
                msg = (
                    f"stage '{self.name}': {path!r} has no column(s) {missing}; its columns "
                    f"are {names}. Pass columns= from those (or None for all)."
                )
                raise ValueError(msg)
        self._file, self._raw, self._path = f, raw, path
        self._end_group()

    def _end_group(self) -> None:
        self._group = self._batch = None
        self._rows, self._rows_at = [], 0

    def _close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        if self._file is not None:
            self._file.close()
        self._file = self._raw = None
        self._end_group()
        self._path = None
        self._row_group = self._row = 0

"""``read_lines``: paths in, lines out, resuming by (file, byte offset).

Each file's bytes are split on ``\\n``; a trailing ``\\r`` is stripped (so
``\\r\\n`` files work); nothing else changes; a last line without ``\\n`` is
still a line. The state is the open path and the byte offset of the next line,
so resuming seeks there and never re-reads what was delivered.

A parallel stage after it on workers takes its lines as byte ranges
(:meth:`ReadLines.take_range`): the stage only finds where each range ends
and counts its lines, a worker reads and splits them
(:mod:`centralpipe.dispatch.worker.ranges`), and the state moves past them
as if they had been pulled one by one. A checkpoint keeps the in-flight
lines of a range as the range; :meth:`ReadLines.check_range` and
:meth:`ReadLines.resumed_range` check and restore it.

A path taken from the source is the state (``path``, offset 0) before the
file is opened: an interrupt (Ctrl-C) during the open leaves it for the next
``next()``, and a checkpoint taken then opens it on resume. A file that
cannot be opened (``OSError``) is a failure: the pass goes on after it.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Mapping, Sequence
from time import perf_counter_ns
from typing import IO, Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.dispatch.worker.ranges import LineRange
from centralpipe.errors import CheckpointError
from centralpipe.plan.options import ReadLinesOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import CentralNode, RunContext, pull_one
from centralpipe.stages.fs import file_size, is_url, open_binary
from centralpipe.stages.line_ranges import check_whole_lines, cut
from centralpipe.stages.sources import FilesSource
from centralpipe.validators import FieldError, checked, int_in

__all__ = [
    "ReadLines",
    "ReadLinesState",
    "check_current_file",
    "count_lines",
    "resolve_name",
    "resumable_size",
    "state_name",
]

PATH_KEY = "path"
OFFSET_KEY = "offset"
COUNT_CHUNK_BYTES = 1 << 20
#: Most bytes in one range a worker reads (``take_range``): a range holds at
#: most a chunk of lines (the adaptive chunk size, bounded by the buffer), and
#: at most this many bytes, so a file of long lines is not read as one
#: message's worth of work; a single longer line is one range.
RANGE_BYTES = 1 << 20
#: The least read for a range: one read, not several, for short chunks.
MIN_RANGE_READ = 1 << 12

# realpath -> (size, mtime_ns, lines): counts stay valid while both are unchanged.
_line_counts: dict[str, tuple[int, int, int]] = {}
_line_counts_lock = threading.Lock()


def count_lines(path: str | os.PathLike[str]) -> int:
    """The number of lines ``read_lines`` yields for ``path``: its ``\\n`` bytes,
    plus one for a last line without ``\\n``. Counted over the raw bytes in C
    (``bytes.count``), nothing decoded; cached per file by size and mtime."""
    key = os.path.realpath(path)
    before = os.stat(key)
    stamp = (before.st_size, before.st_mtime_ns)
    with _line_counts_lock:
        cached = _line_counts.get(key)
    if cached is not None and cached[:2] == stamp:
        return cached[2]
    lines, last = 0, b""
    with open(key, "rb") as f:
        while chunk := f.read(COUNT_CHUNK_BYTES):
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    if last and last != b"\n":
        lines += 1
    after = os.stat(key)
    if (after.st_size, after.st_mtime_ns) == stamp:  # not written to while counting
        with _line_counts_lock:
            _line_counts[key] = (*stamp, lines)
    return lines


def state_name(source: Any, path: str | None) -> str | None:
    """How a reader's checkpoint names the open file: relative to the files
    stage's root when it reads from one (the dataset may move), else as is."""
    if path is not None and isinstance(source, FilesSource):
        return source.name_of(path)
    return path


def resolve_name(source: Any, name: str) -> str:
    """The file a checkpoint's ``name`` is here (see :func:`state_name`)."""
    if isinstance(source, FilesSource):
        found = source.path_of(name)
        if found is not None:
            return found
    return name


def check_current_file(source: Any, name: str | None, states: Mapping[str, Any]) -> None:
    """``FieldError`` unless the reader's open file ``name`` is the one its
    files stage yielded last (when it reads from one)."""
    if not isinstance(source, FilesSource):
        return
    index = states[source.name].index
    paths = source.paths
    current = paths[index - 1] if 0 < index <= len(paths) else None
    if name is not None and resolve_name(source, name) != current:
        expected = (
            f"{current!r}, the file at index {index - 1} of stage '{source.name}'"
            if current is not None
            else f"None (stage '{source.name}' has yielded no file yet)"
        )
        raise FieldError("path", expected, name)


def resumable_size(stage: str, path: str) -> int:
    """The size of the regular file ``path`` a checkpoint resumes in;
    ``CheckpointError`` if it cannot be read."""
    try:
        if is_url(path):
            return file_size(path, f"stage '{stage}'")
        info = os.stat(path)
    except OSError as exc:
        msg = f"stage '{stage}': cannot reopen {path!r} to resume: {exc}."
        raise CheckpointError(msg) from None
    if not stat.S_ISREG(info.st_mode):
        raise FieldError("path", "a regular file", path)
    return info.st_size


@attrs.frozen(kw_only=True)
class ReadLinesState:
    """The open file (``None`` between files) and the byte offset of its next line."""

    path: str | None = attrs.field(
        validator=checked(FieldError, "None or a str", v.optional(v.instance_of(str)))
    )
    offset: int = attrs.field(validator=checked(FieldError, "an int >= 0", int_in(0, 2**63)))

    def __attrs_post_init__(self) -> None:
        if self.path is None and self.offset:
            raise FieldError("offset", "0 when no file is open (path is None)", self.offset)


class ReadLines(CentralNode[str]):
    kind = "read_lines"
    State = ReadLinesState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> ReadLines:
        o = spec.options_as(ReadLinesOptions)
        return cls(
            source,
            encoding=o.encoding,
            errors=o.errors,
            name=spec.name,
            ctx=ctx,
        )

    def __init__(
        self,
        source: BaseNode[Any],
        *,
        encoding: str,
        errors: str = "strict",
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._encoding = encoding
        self._errors = errors
        self._path: str | None = None
        self._offset = 0
        self._file: IO[bytes] | None = None
        #: A read of ``_file`` began and its line was not counted yet (see produce).
        self._ahead = False
        #: The next path, pulled from the source and not taken yet (after an interrupt).
        self._pulled: list[Any] = []
        #: Bytes per line of the last range: how much to read for the next.
        self._line_bytes = 64.0

    def _open_current(self) -> None:
        """Open the file being read at its offset (the next path first, at 0).
        A file that fails to open is skipped; after an interrupt the next
        call opens it again."""
        if self._path is None:
            assert self.source is not None
            pulled = self._pulled
            if not pulled:
                pull_one(self.source, pulled)  # once handed out, the path is in ``pulled``
            path = os.fspath(pulled[0])
            self._path, self._offset = path, 0  # no call between these and the clear
            pulled.clear()
        try:
            self._open(self._path, self._offset)
        except BaseException as exc:
            if isinstance(exc, Exception):  # not interrupted: this file is skipped
                self._path, self._offset = None, 0
            raise

    def produce(self) -> str:
        # The position is the truth, the file may be ahead of it: a read is
        # marked (``_ahead``) before it starts, and the line's bytes count
        # only once it is decoded, with no call between that move and the
        # return. An interrupt (Ctrl-C) as readline(), len() or decode()
        # returns leaves the file ahead; the next call seeks back first.
        while True:
            f = self._file
            if f is None:
                self._open_current()
                continue
            offset = self._offset
            if self._ahead:
                f.seek(offset)  # (cut short: still ahead, seeks again)
            else:
                self._ahead = True
            raw = f.readline()
            if not raw:
                self._close()
                continue
            n = len(raw)
            if raw[-1:] == b"\n":
                raw = raw[:-1]
            if raw[-1:] == b"\r":
                raw = raw[:-1]
            try:
                line = raw.decode(self._encoding, self._errors)
            except UnicodeDecodeError as exc:
                self._offset, self._ahead = offset + n, False  # the pass goes on after it
                exc.add_note(f"(in file {self._path!r} at byte offset {offset})")
                raise
            self._offset, self._ahead = offset + n, False
            return line

    def take_range(self, out: list[Any], max_lines: int) -> None:
        """Append the next at most ``max_lines`` lines to ``out`` as one
        sequence: a :class:`~centralpipe.dispatch.worker.ranges.LineRange` (a
        local file's byte range aligned to line starts, which a worker reads
        and splits as :meth:`produce` would), or a list of the lines of a
        file read through fsspec (those are read here). ``StopIteration`` at
        the end of the epoch. The stage's position moves past the lines as if
        they had been pulled one by one: the state is the same, so a
        checkpoint resumes with or without ranges.

        The bytes of the range are read here only to find its end (the
        first line start after ``max_lines`` lines or ``RANGE_BYTES``) and to
        count its lines, in C; no line is split or decoded here."""
        start_ns = perf_counter_ns()
        try:
            while True:
                if self._file is None:
                    self._open_current()
                assert self._file is not None and self._path is not None
                if is_url(self._path):
                    lines: list[str] = []
                    out.append(lines)  # first: lines pulled stay pulled whatever is raised
                    try:
                        self.produce_into(lines, max_lines)
                    finally:
                        self.items_out += len(lines)
                    return
                if self._append_range(out, max_lines):
                    return
                self._close()
        finally:
            self.busy_ns += perf_counter_ns() - start_ns

    def _append_range(self, out: list[Any], max_lines: int) -> bool:
        """The next range of the open local file onto ``out``; ``False`` at its end."""
        f, path, start = self._file, self._path, self._offset
        assert f is not None and path is not None
        size = min(RANGE_BYTES, max(MIN_RANGE_READ, int(max_lines * self._line_bytes)))
        # From the position, not from where the file is: a read cut short by
        # an interrupt (Ctrl-C) has moved the file but not the position.
        f.seek(start)
        data = f.read(size)
        at_eof = len(data) < size
        while not at_eof and b"\n" not in data:  # one line longer than what was read
            more = f.read(size)
            at_eof = len(more) < size
            data += more
        if not data:
            return False
        end, count = cut(data, max_lines, at_eof)
        f.seek(start + end)
        self._line_bytes = end / count
        lines = LineRange(
            os.path.abspath(path),
            start,
            start + end,
            count,
            encoding=self._encoding,
            errors=self._errors,
            stage=self.name,
            name=self._name_of(path),
        )
        # No call between the move and the append (which moves the range
        # inside C): the lines are either still to read or in ``out``.
        self._offset = start + end
        out.append(lines)
        self.items_out += count
        return True

    def _name_of(self, path: str) -> str:
        name = state_name(self.source, path)
        assert name is not None
        return name

    def resumed_range(self, record: Sequence[Any]) -> tuple[int, LineRange]:
        """A checkpoint's range entry ``[at, name, start, end, count, skip]``
        (checked by :meth:`check_range`) as ``(at, the range of its in-flight
        lines)``; ``CheckpointError`` if the file cannot be read."""
        at, name, start, end, count, skip = record
        path = self._resolve(name)
        lines = LineRange(
            os.path.abspath(path),
            start,
            end,
            count,
            encoding=self._encoding,
            errors=self._errors,
            stage=self.name,
            name=name,
        )
        try:
            return at, lines.after(skip)
        except (OSError, ValueError) as exc:
            msg = f"stage '{self.name}': cannot read the in-flight lines of {path!r}: {exc}."
            raise CheckpointError(msg) from None

    def check_range(self, record: Sequence[Any]) -> None:
        """``FieldError``/``CheckpointError`` unless the checkpoint's range entry
        ``[at, name, start, end, count, skip]`` is whole lines of a local file
        this stage reads: it starts at a line start, ends after a ``\\n`` (or
        at the end of the file) and holds ``count`` lines."""
        _, name, start, end, count, _ = record
        path = self._resolve(name)
        if is_url(path):
            raise FieldError("ranges", "ranges of local files only", name)
        size = resumable_size(self.name, path)
        check_whole_lines(self.name, path, size, start, end, count)

    def own_state(self) -> dict[str, Any]:
        # A path pulled and not taken yet (an interrupt between) is the next
        # file, at its start.
        path = self._path
        if path is None and self._pulled:
            path = os.fspath(self._pulled[0])
        return {PATH_KEY: state_name(self.source, path), OFFSET_KEY: self._offset}

    def _resolve(self, path: str) -> str:
        return resolve_name(self.source, path)

    def check_state(self, state: ReadLinesState, states: Mapping[str, Any]) -> None:
        path, offset = state.path, state.offset
        check_current_file(self.source, path, states)
        if path is None:
            return
        self._check_line_start(self._resolve(path), offset)

    def _check_line_start(self, path: str, offset: int) -> None:
        size = resumable_size(self.name, path)
        if size < offset:
            msg = (
                f"stage '{self.name}': {path!r} is {size} bytes but the checkpoint resumes at "
                f"byte {offset}; the file changed since the checkpoint."
            )
            raise CheckpointError(msg)
        if offset and offset != size:
            # A line ends at a "\n", or at the end of a file without a final "\n".
            try:
                f = self._raw(path)
                try:
                    f.seek(offset - 1)
                    before = f.read(1)
                finally:
                    f.close()
            except OSError as exc:
                msg = f"stage '{self.name}': cannot reopen {path!r} to resume: {exc}."
                raise CheckpointError(msg) from None
            if before != b"\n":
                msg = (
                    f"stage '{self.name}': the checkpoint resumes {path!r} at byte {offset}, "
                    "which is not the start of a line; the file changed since the checkpoint."
                )
                raise CheckpointError(msg)

    def restore(self, state: dict[str, Any] | None) -> None:
        self._close()
        self._pulled = []
        if state is None or state[PATH_KEY] is None:
            return
        # check_state() found the offset at a line start of this file.
        self._open(self._resolve(state[PATH_KEY]), state[OFFSET_KEY])

    def release(self) -> None:
        self._close()
        super().release()

    def _raw(self, path: str) -> IO[bytes]:
        if is_url(path):
            return open_binary(path, f"stage '{self.name}'")
        return open(path, "rb")

    def _open(self, path: str, offset: int) -> None:
        f = self._raw(path)  # held across next() calls
        try:
            if offset:
                f.seek(offset)
        except BaseException:
            f.close()
            raise
        self._file, self._path, self._offset, self._ahead = f, path, offset, False

    def _close(self) -> None:
        # Forgotten before it is closed: an interrupt as close() returns
        # leaves no closed file to read from (or to close again).
        f = self._file
        self._file, self._path, self._offset, self._ahead = None, None, 0, False
        if f is not None:
            f.close()

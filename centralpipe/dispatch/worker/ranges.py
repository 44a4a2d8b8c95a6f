"""Line ranges: ``read_lines`` done by the worker that runs the parallel stage after it.

When a parallel central stage reads straight from ``read_lines`` and runs on
workers, the main process does not send lines: it sends a :class:`LineRange`
(a local file, a byte range aligned to line starts, how many lines it holds,
and how to decode them). The worker reads the range and splits it into lines
exactly as ``read_lines`` does (:func:`split_lines`: split on ``\\n``, one
trailing ``\\r`` stripped, each line decoded with ``encoding``/``errors``, a
last line without ``\\n`` still a line), then runs the stage over those lines
(:func:`run_range`). The range's lines have the seqs the lines would have had,
so seeds, poison items, hangs and checkpoints are per line, as without ranges.

A range stands for its lines everywhere in the main process: it is a
``Sequence[str]`` of ``line_count`` lines, read from the file only when a line
itself is needed (a checkpoint of in-flight lines, a chunk re-sent item by
item, a decode error to raise).

A line that cannot be decoded (``errors="strict"``) or a file that no longer
has the range's lines is a failure of the reader (``stage`` is its name) at
that line: the lines before it are delivered, then the main process raises
the error :meth:`LineRange.error_at` gives, as ``read_lines`` raises it.

Worker side: no torch, nothing of the builder or the central stages.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any, overload

from centralpipe.dispatch.wire.protocol import ChunkResult, StageFailure

__all__ = ["LineRange", "run_range", "split_lines"]


def split_lines(data: bytes, encoding: str, errors: str) -> tuple[list[str], BaseException | None]:
    """The lines of ``data`` as ``read_lines`` yields them, and the error of
    the first line that cannot be decoded (the lines before it are returned)."""
    parts = data.split(b"\n")
    if parts[-1] == b"":  # data ended with "\n" (or is empty): no line after it
        parts.pop()
    lines: list[str] = []
    append = lines.append
    try:
        for raw in parts:
            if raw[-1:] == b"\r":
                raw = raw[:-1]
            append(raw.decode(encoding, errors))
    except UnicodeDecodeError as exc:
        return lines, exc
    return lines, None


class LineRange(Sequence[str]):
    """``line_count`` lines of the local file ``path``: its bytes ``[start, end)``,
    which begin at a line start and end after a ``\\n`` (or at the end of the
    file). Read by :meth:`read`; pickled as its fields only."""

    __slots__ = ("encoding", "end", "errors", "line_count", "name", "path", "stage", "start")

    def __init__(
        self,
        path: str,
        start: int,
        end: int,
        count: int,
        *,
        encoding: str,
        errors: str,
        stage: str,
        name: str = "",
    ) -> None:
        self.path = path
        self.start = start
        self.end = end
        self.line_count = count
        self.encoding = encoding
        self.errors = errors
        #: The reader stage (``read_lines``) whose lines these are.
        self.stage = stage
        #: The file as the reader's checkpoint names it (main process only).
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.path, self.start, self.end, self.line_count, self.encoding,
                           self.errors, self.stage))  # fmt: skip

    def record(self, at: int, skip: int) -> list[Any]:
        """The checkpoint's entry of this range (``in_flight[...]["ranges"]``):
        its lines after the first ``skip`` go before plain item ``at``."""
        return [at, self.name, self.start, self.end, self.line_count, skip]

    def after(self, skip: int) -> LineRange:
        """The range of the lines after the first ``skip`` (read to find where
        they start; ``OSError`` if the file cannot be read)."""
        if not skip:
            return self
        data = self.read_bytes()
        at = -1
        for _ in range(skip):
            at = data.index(b"\n", at + 1)
        return LineRange(
            self.path,
            self.start + at + 1,
            self.end,
            self.line_count - skip,
            encoding=self.encoding,
            errors=self.errors,
            stage=self.stage,
            name=self.name,
        )

    def __repr__(self) -> str:
        return (
            f"LineRange({self.path!r}, bytes {self.start}..{self.end}, {self.line_count} lines, "
            f"stage {self.stage!r})"
        )

    def __len__(self) -> int:
        return self.line_count

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        return self.lines()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self.lines())

    def read_bytes(self) -> bytes:
        """The range's bytes (``OSError`` if the file cannot be read)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, self.end - self.start, self.start)
        finally:
            os.close(fd)

    def read(self) -> tuple[list[str], str | None]:
        """The lines, up to the first one that cannot be had, and then why
        (``None`` when all ``line_count`` lines were read)."""
        try:
            data = self.read_bytes()
        except OSError as exc:
            return [], f"cannot read {self.path!r}: {exc}"
        lines, error = split_lines(data, self.encoding, self.errors)
        if error is not None:
            return lines, f"{type(error).__name__}: {error}"
        if len(data) != self.end - self.start or len(lines) != self.line_count:
            return [], self._changed(len(lines))
        return lines, None

    def lines(self) -> list[str]:
        """All ``line_count`` lines, or the error of the first that cannot be had."""
        lines, why = self.read()
        if why is not None:
            raise self.error_at(len(lines), why)
        return lines

    def error_at(self, at: int, why: str) -> BaseException:
        """The error ``read_lines`` raises for line ``at`` of the range: its
        ``UnicodeDecodeError`` (noted with the file and the line's byte
        offset), ``OSError``, or ``RuntimeError`` for a changed file."""
        try:
            data = self.read_bytes()
        except OSError as exc:
            exc.add_note(f"(reading lines of {self.path!r} at byte offset {self.start})")
            return exc
        offset = self.start
        for i, raw in enumerate(data.split(b"\n")):
            if i == at:
                if raw[-1:] == b"\r":
                    raw = raw[:-1]
                try:
                    raw.decode(self.encoding, self.errors)
                except UnicodeDecodeError as exc:
                    exc.add_note(f"(in file {self.path!r} at byte offset {offset})")
                    return exc
                break
            offset += len(raw) + 1
        return RuntimeError(f"stage '{self.stage}': {why}")

    def _changed(self, got: int) -> str:
        return (
            f"{self.path!r} changed while it was read: bytes {self.start}..{self.end} held "
            f"{self.line_count} lines when the range was cut, and now {got}."
        )


def _rebuild(
    path: str, start: int, end: int, count: int, encoding: str, errors: str, stage: str
) -> LineRange:
    return LineRange(path, start, end, count, encoding=encoding, errors=errors, stage=stage)


def run_range(
    chain: Any,
    lines_of: LineRange,
    epoch: int,
    first_seq: int,
    skip: frozenset[int],
    status: Any,
    stream: int,
    rng_key: tuple[int, int],
) -> ChunkResult:
    """Read ``lines_of`` and run ``chain`` (a ``WorkerChain``) over its lines,
    as over a chunk of those lines. A line that cannot be read is a failure
    of the reader stage at its index; the lines after it are not run."""
    lines, why = lines_of.read()
    result: ChunkResult = chain.run_chunk(epoch, first_seq, lines, skip, status, stream, rng_key)
    if why is None:
        return result
    at = len(lines)
    failure = StageFailure(at, lines_of.stage, "ReadError", why, "")
    counts = [*(result.counts or [1] * at), *([0] * (lines_of.line_count - at))]
    failures = [*(result.failures or ()), failure]
    return result._replace(counts=counts, failures=failures)

"""``read_lines``: paths in, lines out, resuming by (file, byte offset).

Each file's bytes are split on ``\\n``; a trailing ``\\r`` is stripped (so
``\\r\\n`` files work); nothing else changes; a last line without ``\\n`` is
still a line. The state is the open path and the byte offset of the next line,
so resuming seeks there and never re-reads what was delivered.
"""

from __future__ import annotations

import os
from typing import IO, Any

from torchdata.nodes import BaseNode

from centralpipe.errors import CheckpointError
from centralpipe.stages.base import CentralNode, RunContext

__all__ = ["ReadLines"]

PATH_KEY = "path"
OFFSET_KEY = "offset"


class ReadLines(CentralNode[str]):
    kind = "read_lines"

    def __init__(self, source: BaseNode[Any], *, encoding: str, name: str, ctx: RunContext) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._encoding = encoding
        self._path: str | None = None
        self._offset = 0
        self._file: IO[bytes] | None = None

    def produce(self) -> str:
        while True:
            if self._file is None:
                assert self.source is not None
                self._open(os.fspath(next(self.source)), 0)
            assert self._file is not None
            raw = self._file.readline()
            if not raw:
                self._close()
                continue
            offset = self._offset
            self._offset += len(raw)
            if raw[-1:] == b"\n":
                raw = raw[:-1]
            if raw[-1:] == b"\r":
                raw = raw[:-1]
            try:
                return raw.decode(self._encoding)
            except UnicodeDecodeError as exc:
                exc.add_note(f"(in file {self._path!r} at byte offset {offset})")
                raise

    def own_state(self) -> dict[str, Any]:
        return {PATH_KEY: self._path, OFFSET_KEY: self._offset}

    def restore(self, state: dict[str, Any] | None) -> None:
        self._close()
        if state is None or state[PATH_KEY] is None:
            return
        path, offset = str(state[PATH_KEY]), int(state[OFFSET_KEY])
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            msg = f"stage '{self.name}': cannot reopen {path!r} to resume: {exc}."
            raise CheckpointError(msg) from None
        if size < offset:
            msg = (
                f"stage '{self.name}': {path!r} is {size} bytes but the checkpoint resumes at "
                f"byte {offset}; the file changed since the checkpoint."
            )
            raise CheckpointError(msg)
        self._open(path, offset)
        if offset:
            assert self._file is not None
            self._file.seek(offset - 1)
            # A line ends at a "\n", or at the end of a file without a final "\n".
            if self._file.read(1) != b"\n" and offset != size:
                self._close()
                msg = (
                    f"stage '{self.name}': the checkpoint resumes {path!r} at byte {offset}, "
                    "which is not the start of a line; the file changed since the checkpoint."
                )
                raise CheckpointError(msg)

    def release(self) -> None:
        self._close()
        super().release()

    def _open(self, path: str, offset: int) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 - held across next() calls
        if offset:
            self._file.seek(offset)
        self._path = path
        self._offset = offset

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = None
        self._path = None
        self._offset = 0

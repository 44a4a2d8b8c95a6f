"""``read_jsonl``: paths in, one item per JSON line out, resuming by position.

Each line of a file is one JSON value (``json.loads`` of its bytes: UTF-8,
or UTF-16/32 with a BOM); lines holding only whitespace are passed over. The
item is the record, ``record[field]`` when ``field`` is a str, or
``field(record)`` when it is callable. ``.gz`` files are read as gzip,
``.zst``/``.zstd`` as zstd (``centralpipe[zstd]``), others as they are.

The state is the open file, the position of its next line (``block``,
``offset``: see :mod:`centralpipe.stages.blocks`; a plain file's byte offset,
a compressed file's gzip member or zstd frame and the decompressed bytes into
it), the number of that line (for messages) and the lines skipped this epoch.
Resuming a compressed file decompresses the current block up to the position,
once: ``check_state`` does it and ``restore`` carries on from there.

Lines are handed out in bulk when the chain pulls many at once (the Loader
does): the lines already buffered are decoded as one UTF-8 segment, split in
C and parsed from ``str`` (what ``json.loads`` of their bytes would do), and
any line that is not simply an item (blank lines aside) is left to the
one-at-a-time path, so items, errors, skips and positions are the same either
way. A Ctrl-C inside a ``field`` function leaves its line unread.

A malformed line (not JSON, or without ``field``) raises ``ValueError``
naming the file and line; with ``errors="skip"`` it is skipped and counted
(``skipped`` in the state, and in ``Loader.query(name)``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from itertools import repeat
from typing import Any

import attrs
from attrs import validators as v
from torchdata.nodes import BaseNode

from centralpipe.errors import CheckpointError
from centralpipe.plan.options import ReadJsonlOptions
from centralpipe.plan.specs import StageSpec
from centralpipe.stages.base import CentralNode, RunContext
from centralpipe.stages.blocks import CODEC_MAGIC, BlockLines, PlainLines, codec_of
from centralpipe.stages.counts import cached_count
from centralpipe.stages.files import (
    check_current_file,
    resolve_name,
    resumable_size,
    state_name,
)
from centralpipe.stages.fs import is_url, open_binary
from centralpipe.validators import FieldError, checked, int_in

__all__ = ["JSONL_ERRORS", "ReadJsonl", "ReadJsonlState", "count_records"]

#: What ``read_jsonl`` does with a malformed line.
JSONL_ERRORS = ("strict", "skip")
_COUNT = checked(FieldError, "an int >= 0", int_in(0, 2**63))
_NOT_FOUND = object()
#: What ``bytes.isspace`` calls space, less ``\n``: a line of these is blank.
_BLANK = " \t\r\x0b\x0c"
_BLANK_BYTES = _BLANK.encode()
#: Bytes read at a time when counting records.
COUNT_CHUNK_BYTES = 1 << 20


def count_records(path: str) -> int:
    """The lines of an uncompressed local file that are not blank: the items
    ``read_jsonl`` yields for it when no line is malformed. Split and stripped
    in C, a chunk at a time; nothing is parsed."""
    records, carry = 0, b""
    with open(path, "rb") as f:
        while chunk := f.read(COUNT_CHUNK_BYTES):
            lines = (carry + chunk).split(b"\n")
            carry = lines.pop()  # the part after the last "\n": maybe half a line
            records += len(lines) - list(map(bytes.strip, lines, repeat(_BLANK_BYTES))).count(b"")
    if carry.strip(_BLANK_BYTES):
        records += 1
    return records


@attrs.frozen(kw_only=True)
class ReadJsonlState:
    """The open file (``None`` between files), the position of its next line,
    that line's number (1-based) and the lines skipped this epoch."""

    path: str | None = attrs.field(
        validator=checked(FieldError, "None or a str", v.optional(v.instance_of(str)))
    )
    block: int = attrs.field(validator=_COUNT)
    offset: int = attrs.field(validator=_COUNT)
    line: int = attrs.field(validator=checked(FieldError, "an int >= 1", int_in(1, 2**63)))
    skipped: int = attrs.field(validator=_COUNT)

    def __attrs_post_init__(self) -> None:
        if self.path is None and (self.block or self.offset or self.line != 1):
            raise FieldError("offset", "0 when no file is open (path is None)", self.offset)


class ReadJsonl(CentralNode[Any]):
    kind = "read_jsonl"
    State = ReadJsonlState

    @classmethod
    def from_spec(cls, spec: StageSpec, source: Any, ctx: RunContext) -> ReadJsonl:
        o = spec.options_as(ReadJsonlOptions)
        return cls(source, field=o.field, errors=o.errors, name=spec.name, ctx=ctx)

    def __init__(
        self,
        source: BaseNode[Any],
        *,
        field: str | Callable[[Any], Any] | None,
        errors: str,
        name: str,
        ctx: RunContext,
    ) -> None:
        super().__init__(source, name=name, ctx=ctx)
        self._field = field
        self._skip = errors == "skip"
        self._path: str | None = None
        self._lines: PlainLines | BlockLines | None = None
        self._line = 1
        self._skipped = 0
        #: The reader check_state() opened at a checkpoint's position: (state, reader).
        self._prepared: tuple[tuple[str, int, int], PlainLines | BlockLines] | None = None

    def produce(self) -> Any:
        while True:
            if self._lines is None:
                if self._path is None:
                    assert self.source is not None
                    self._path = str(next(self.source))
                    self._line = 1
                try:
                    self._lines = self._open(self._path, 0, 0)
                except BaseException as exc:
                    if isinstance(exc, Exception):  # not interrupted: this file is skipped
                        self._path, self._line = None, 1
                    raise
            raw = self._lines.readline()
            if not raw:
                self._close()
                continue
            line = self._line
            self._line += 1
            if raw.isspace():
                continue
            try:
                item = self._item(raw, line)
            except BaseException as exc:
                if not isinstance(exc, Exception):  # interrupted: the line stays unread
                    self._lines.advance(-len(raw))
                    self._line = line
                raise
            if item is not _NOT_FOUND:
                return item

    def produce_into(self, out: list[Any], n: int) -> None:
        # The lines already buffered, in bulk: decoded once per segment and
        # split in C. The bulk path stops, leaving the line to produce(), at the
        # first line it would not simply turn into an item (malformed, not
        # UTF-8, a missing field), so both give the same items, errors, skips
        # and positions; produce() also opens and ends files.
        before = len(out)
        while len(out) - before < n:
            lines, left = self._lines, n - (len(out) - before)
            seg = lines.peek(left) if lines is not None else b""
            if seg and self._take(seg, left, out):
                continue  # the whole segment taken: more may be buffered
            if len(out) > before:
                return
            out.append(self.produce())

    def _take(self, seg: bytes, n: int, out: list[Any]) -> bool:
        """Items of up to ``n`` lines of ``seg`` (complete lines at the reader's
        position) appended to ``out``, and the position moved past them;
        ``False`` if it stopped at a line for :meth:`produce`."""
        try:
            text: str | bytes = seg.decode("utf-8", "surrogatepass")  # as json.loads
        except UnicodeDecodeError:
            text = seg
        parts: list[Any] = text.split("\n" if isinstance(text, str) else b"\n", n)  # type: ignore[arg-type]
        rest = parts.pop()  # what follows the n-th line (b"" / "" after the last)
        field, append, loads = self._field, out.append, json.loads
        blank = _BLANK if isinstance(text, str) else _BLANK_BYTES
        before = len(out)
        passed = 0  # lines taken without an item: blank, or a field function that raised
        whole = False
        try:
            for raw in parts:
                if not raw or raw.isspace():
                    if raw.strip(blank):  # str.isspace's other spaces: produce() says
                        break
                    passed += 1
                    continue
                try:
                    record = loads(raw)
                except ValueError:
                    break
                if field is None:
                    append(record)
                elif callable(field):
                    try:
                        item = field(record)
                    except Exception as exc:
                        at = self._line + len(out) - before + passed
                        passed += 1
                        exc.add_note(f"(in file {self._path!r} at line {at})")
                        raise
                    append(item)
                else:
                    try:
                        item = record[field]
                    except (KeyError, TypeError, IndexError):
                        break
                    append(item)
            else:
                whole = not rest
        finally:
            # Only the lines taken count: those of the items appended (whatever
            # interrupted the loop after an append) and the blank ones passed.
            taken = len(out) - before + passed
            if taken:
                if taken == len(parts) and not rest:
                    nbytes = len(seg)
                else:
                    nbytes = len(seg) - len(seg.split(b"\n", taken)[-1])
                assert self._lines is not None
                self._lines.advance(nbytes)
                self._line += taken
        return whole

    def _item(self, raw: bytes, line: int) -> Any:
        try:
            record = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            return self._malformed(f"not JSON ({exc})", line)
        field = self._field
        if field is None:
            return record
        if callable(field):
            try:
                return field(record)
            except Exception as exc:
                exc.add_note(f"(in file {self._path!r} at line {line})")
                raise
        try:
            return record[field]
        except (KeyError, TypeError, IndexError):
            got = sorted(record)[:10] if isinstance(record, dict) else type(record).__name__
            return self._malformed(f"no field {field!r} (got {got})", line)

    def _malformed(self, what: str, line: int) -> Any:
        if self._skip:
            self._skipped += 1
            return _NOT_FOUND
        msg = (
            f"stage '{self.name}': {self._path!r} line {line}: {what}. Fix the file, or pass "
            "read_jsonl(errors='skip') to skip malformed lines and count them."
        )
        raise ValueError(msg)

    @property
    def items_exact(self) -> bool:
        """Whether :meth:`items_in` is exact (``errors="skip"`` may skip some)."""
        return not self._skip

    def items_in(self, path: str) -> int | None:
        """The items of one file, for known totals: its non-blank lines when it
        is an uncompressed local file (counted once, cached by size and mtime);
        ``None`` for compressed files and URLs, which would have to be read whole."""
        if is_url(path) or codec_of(path) != "plain":
            return None
        return cached_count(path, "jsonl-records", count_records)

    def own_state(self) -> dict[str, Any]:
        block, offset = self._lines.position() if self._lines is not None else (0, 0)
        return {
            "path": state_name(self.source, self._path),
            "block": block,
            "offset": offset,
            "line": self._line if self._path is not None else 1,
            "skipped": self._skipped,
        }

    def check_state(self, state: ReadJsonlState, states: Mapping[str, Any]) -> None:
        check_current_file(self.source, state.path, states)
        if self._prepared is not None:
            self._prepared[1].close()
            self._prepared = None
        if state.path is None:
            return
        path = resolve_name(self.source, state.path)
        size = resumable_size(self.name, path)
        codec = codec_of(path)
        if state.block + (state.offset if codec == "plain" else 0) > size:
            where = state.block if codec != "plain" else state.offset
            msg = (
                f"stage '{self.name}': {path!r} is {size} bytes but the checkpoint resumes at "
                f"byte {where}; the file changed since the checkpoint."
            )
            raise CheckpointError(msg)
        if codec == "plain" and state.block:
            raise FieldError("block", "0 (an uncompressed file)", state.block)
        try:
            lines = self._open(path, state.block, state.offset, check=True)
        except (OSError, EOFError, ValueError) as exc:
            msg = (
                f"stage '{self.name}': cannot resume {path!r} at block {state.block}, "
                f"offset {state.offset}: {exc}; the file changed since the checkpoint."
            )
            raise CheckpointError(msg) from None
        self._prepared = ((path, state.block, state.offset), lines)

    def restore(self, state: dict[str, Any] | None) -> None:
        self._close()
        self._skipped = 0 if state is None else state["skipped"]
        prepared, self._prepared = self._prepared, None
        if state is None or state["path"] is None:
            if prepared is not None:
                prepared[1].close()
            return
        path = resolve_name(self.source, state["path"])
        key = (path, state["block"], state["offset"])
        if prepared is not None and prepared[0] == key:
            self._lines = prepared[1]
        else:
            if prepared is not None:
                prepared[1].close()
            self._lines = self._open(path, state["block"], state["offset"])
        self._path = path
        self._line = state["line"]

    def release(self) -> None:
        self._close()
        if self._prepared is not None:
            self._prepared[1].close()
            self._prepared = None
        super().release()

    def _open(
        self, path: str, block: int, offset: int, *, check: bool = False
    ) -> PlainLines | BlockLines:
        raw = open_binary(path, f"stage '{self.name}'")
        try:
            codec = codec_of(path)
            if codec == "plain":
                if check and offset and offset != resumable_size(self.name, path):
                    raw.seek(offset - 1)
                    if raw.read(1) != b"\n":
                        raise ValueError(f"byte {offset} is not the start of a line")
                return PlainLines(raw, offset)
            if check:
                raw.seek(block)
                magic = CODEC_MAGIC[codec]
                if raw.read(len(magic)) != magic:
                    raise ValueError(f"byte {block} does not start a {codec} block")
            lines = BlockLines(raw, codec, block, offset)
            if check and offset and lines.skipped_last != b"\n" and not lines.at_end():
                raise ValueError(f"offset {offset} is not the start of a line")
            return lines
        except BaseException:
            raw.close()
            raise

    def _close(self) -> None:
        if self._lines is not None:
            self._lines.close()
        self._lines = None
        self._path = None
        self._line = 1

"""Lines of a plain, gzip or zstd file, with a position to resume at.

A position is ``(block, offset)``: for a compressed file, ``block`` is the
byte offset in the file of the gzip member or zstd frame the next line starts
in, and ``offset`` counts decompressed bytes from that block's start; for a
plain file ``block`` is 0 and ``offset`` is the byte offset. Resuming seeks to
``block`` and decompresses ``offset`` bytes of that one block (discarding
them), so **a resume costs decompressing at most one block**: a file written
as one gzip member (``gzip`` on the command line) or one zstd frame costs up
to the whole file; one written in pieces (``cat part*.gz > all.gz``,
``pigz``/``bgzip`` style members, zstd frames of a few MB) costs at most a
piece. Nothing before the block is read again.

zstd needs the optional package ``zstandard`` (``centralpipe[zstd]``).
"""

from __future__ import annotations

import zlib
from typing import IO, Any, Literal

from centralpipe.stages.fs import need

__all__ = ["CODEC_MAGIC", "BlockLines", "Codec", "PlainLines", "codec_of"]

Codec = Literal["plain", "gzip", "zstd"]
#: Raw bytes read at a time.
CHUNK_BYTES = 1 << 16
#: Decompressed bytes produced at a time from one chunk (gzip; zstd decides).
OUT_BYTES = 1 << 18
#: The first bytes of a gzip member and of a zstd frame.
CODEC_MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}


def codec_of(path: str) -> Codec:
    """The codec a file's name says: ``.gz`` gzip, ``.zst``/``.zstd`` zstd, else plain."""
    name = path.rsplit("?", 1)[0].lower()
    if name.endswith(".gz"):
        return "gzip"
    if name.endswith((".zst", ".zstd")):
        return "zstd"
    return "plain"


class _Lines:
    """Lines from a buffer that a subclass fills (:meth:`_more`): ``_buf`` holds
    the bytes read and not yet dropped, ``_pos`` the position in it."""

    _buf: bytes
    _pos: int
    #: About how many bytes a line has, for :meth:`peek`'s window.
    _line_bytes = 128

    def _more(self) -> bool:
        """Append more bytes to ``_buf`` (possibly dropping those before
        ``_pos`` first); ``False`` at the end of the file."""
        raise NotImplementedError

    def readline(self) -> bytes:
        """The next line with its ``\n`` (a last line without one as it is);
        ``b""`` at the end of the file."""
        buf, pos = self._buf, self._pos
        scan = pos
        while True:
            i = buf.find(b"\n", scan)
            if i >= 0:
                end = i + 1
                break
            scanned = len(buf) - pos
            if not self._more():
                end = len(buf)
                break
            buf, pos = self._buf, self._pos
            scan = pos + scanned
        self._pos = end
        return buf[pos:end]

    def peek(self, n: int) -> bytes:
        """About ``n`` (at least one) complete lines from the position, as one
        ``bytes`` ending in ``\n``, without moving the position (see
        :meth:`advance`); ``b""`` when no ``\n`` follows it (the end of the
        file, or a last line without one). Reads more only when the buffer
        holds no complete line, so it costs about the bytes it returns."""
        while True:
            buf, pos = self._buf, self._pos
            end = buf.rfind(b"\n", pos, pos + n * self._line_bytes) + 1
            if end <= pos:
                end = buf.find(b"\n", pos) + 1  # a line longer than the window
            if end > pos:
                seg = buf[pos:end]
                self._line_bytes = len(seg) // seg.count(b"\n") + 1
                return seg
            if not self._more():
                return b""

    def advance(self, nbytes: int) -> None:
        """Move the position past ``nbytes`` bytes that :meth:`peek` returned."""
        self._pos += nbytes


class PlainLines(_Lines):
    """Lines of an uncompressed file: the position is ``(0, byte offset)``."""

    def __init__(self, raw: IO[bytes], offset: int) -> None:
        self._raw = raw
        if offset:
            raw.seek(offset)
        self._base = offset  # the byte offset of _buf[0]
        self._buf = b""
        self._pos = 0

    def _more(self) -> bool:
        data = self._raw.read(OUT_BYTES)
        if not data:
            return False
        self._base += self._pos
        self._buf = self._buf[self._pos :] + data
        self._pos = 0
        return True

    def position(self) -> tuple[int, int]:
        return 0, self._base + self._pos

    def close(self) -> None:
        self._raw.close()


class BlockLines(_Lines):
    """Lines of a gzip or zstd file from position ``(block, offset)``.

    ``skipped_last`` is the last decompressed byte before the position
    (``b""`` at a block start): a line start follows ``b"\\n"``. Raises
    ``EOFError`` when the block ends before ``offset`` bytes."""

    def __init__(self, raw: IO[bytes], codec: Codec, block: int, offset: int) -> None:
        self._raw = raw
        self._codec = codec
        self._zstd: Any = need("zstandard", "reading .zst files") if codec == "zstd" else None
        raw.seek(block)
        self._read_end = block  # raw offset after the last byte read
        self._pending = b""  # raw bytes read, not yet decompressed
        self._d: Any = None  # the current block's decompressor
        self._block = block
        self._out = 0  # decompressed bytes of the current block so far
        self._buf = b""
        self._pos = 0
        #: (index in _buf, block, offset in that block at that index), ascending.
        self._bounds: list[tuple[int, int, int]] = [(0, block, offset)]
        self.skipped_last = self._skip(block, offset) if offset else b""

    def _new(self) -> Any:
        if self._codec == "gzip":
            return zlib.decompressobj(wbits=31)
        return self._zstd.ZstdDecompressor().decompressobj()

    def _next_chunk(self) -> tuple[int, int, bytes] | None:
        """The next decompressed bytes as ``(block, offset in block, data)``;
        ``None`` at the end of the file."""
        while True:
            if not self._pending:
                self._pending = self._raw.read(CHUNK_BYTES)
                self._read_end += len(self._pending)
                if not self._pending:
                    if self._d is not None:
                        msg = (
                            f"the {self._codec} data ends inside the block at byte {self._block} "
                            "(a truncated file)"
                        )
                        raise EOFError(msg)
                    return None
            if self._d is None:
                if self._codec == "gzip" and not self._pending.strip(b"\0"):
                    self._pending = b""  # zero padding after the last member, as gzip allows
                    continue
                self._block = self._read_end - len(self._pending)
                self._out = 0
                self._d = self._new()
            d = self._d
            if self._codec == "gzip":
                data = d.decompress(self._pending, OUT_BYTES)
                rest = d.unconsumed_tail
            else:
                data = d.decompress(self._pending)
                rest = b""
            if d.eof:
                rest = d.unused_data
                self._d = None
            self._pending = rest
            start = self._out
            self._out += len(data)
            if data:
                return self._block, start, data

    def _skip(self, block: int, offset: int) -> bytes:
        left, last = offset, b""
        while left:
            chunk = self._next_chunk()
            if chunk is None or chunk[0] != block:
                msg = f"the block at byte {block} holds {offset - left} bytes, fewer than {offset}"
                raise EOFError(msg)
            data = chunk[2]
            if len(data) > left:
                self._buf = data[left:]
                last, left = data[left - 1 : left], 0
            else:
                left -= len(data)
                last = data[-1:]
        self._bounds = [(0, block, offset)]
        return last

    def _more(self) -> bool:
        chunk = self._next_chunk()
        if chunk is None:
            return False
        self._compact()
        self._append(chunk)
        return True

    def _append(self, chunk: tuple[int, int, bytes]) -> None:
        block, start, data = chunk
        at = len(self._buf)
        last = self._bounds[-1]
        if last[1] != block or last[2] + at - last[0] != start:
            self._bounds.append((at, block, start))
        self._buf += data

    def at_end(self) -> bool:
        """Whether no line follows the position."""
        if self._pos < len(self._buf):
            return False
        chunk = self._next_chunk()
        if chunk is None:
            return True
        self._compact()
        self._append(chunk)
        return False

    def _compact(self) -> None:
        """Drop the consumed bytes of the buffer (the bounds follow)."""
        pos = self._pos
        if not pos:
            return
        keep = [b for b in self._bounds if b[0] > pos]
        base = max((b for b in self._bounds if b[0] <= pos), key=lambda b: b[0])
        self._bounds = [(0, base[1], base[2] + pos - base[0])] + [
            (i - pos, blk, off) for i, blk, off in keep
        ]
        self._buf = self._buf[pos:]
        self._pos = 0

    def position(self) -> tuple[int, int]:
        """``(block, offset)`` of the next line (the later block at a boundary)."""
        pos = self._pos
        for i, block, offset in reversed(self._bounds):
            if i <= pos:
                return block, offset + pos - i
        raise AssertionError("the first bound is at index 0")  # pragma: no cover

    def close(self) -> None:
        self._raw.close()

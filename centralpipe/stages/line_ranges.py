"""Byte ranges of ``read_lines``' files, on the main side: where a range ends
(:func:`cut`), and whether a checkpoint's range is still whole lines of its
file (:func:`check_whole_lines`). The ranges themselves, and their reading
by a worker, are :mod:`centralpipe.dispatch.worker.ranges`."""

from __future__ import annotations

from centralpipe.errors import CheckpointError

__all__ = ["check_whole_lines", "cut"]


def cut(data: bytes, max_lines: int, at_eof: bool) -> tuple[int, int]:
    """``(bytes, lines)`` of the longest start of ``data`` (a file's bytes from
    a line start; ``at_eof``: up to its end) that is whole lines, at most
    ``max_lines`` of them. ``data`` holds a ``\\n`` unless ``at_eof``. In C but
    for one step per line beyond ``max_lines`` (the reads aim at about that)."""
    newlines = data.count(b"\n")
    if at_eof and data[-1:] != b"\n" and newlines < max_lines:
        return len(data), newlines + 1  # to the end: the last line has no "\n"
    if newlines <= max_lines:
        return data.rindex(b"\n") + 1, newlines
    end = len(data)
    for _ in range(newlines - max_lines + 1):  # back to the max_lines-th "\n"
        end = data.rindex(b"\n", 0, end)
    return end + 1, max_lines


def check_whole_lines(stage: str, path: str, size: int, start: int, end: int, count: int) -> None:
    """``CheckpointError`` unless bytes ``[start, end)`` of the local file
    ``path`` (of ``size`` bytes) are ``count`` whole lines: from a line start
    to just after a ``\\n`` (or to the end of the file). ``stage`` names the
    reader in the message."""
    if end > size:
        msg = (
            f"stage '{stage}': {path!r} is {size} bytes but an in-flight range of the "
            f"checkpoint ends at byte {end}; the file changed since the checkpoint."
        )
        raise CheckpointError(msg)
    try:
        with open(path, "rb") as f:
            f.seek(max(0, start - 1))
            data = f.read(end - max(0, start - 1))
    except OSError as exc:
        msg = f"stage '{stage}': cannot reopen {path!r} to resume: {exc}."
        raise CheckpointError(msg) from None
    body = data[1:] if start else data
    whole = (start == 0 or data[:1] == b"\n") and (end == size or body[-1:] == b"\n")
    lines = body.count(b"\n") + (1 if body[-1:] not in (b"\n", b"") else 0)
    if not whole or lines != count:
        msg = (
            f"stage '{stage}': the checkpoint's in-flight range of {path!r}, bytes "
            f"{start}..{end}, is not {count} whole lines (it holds {lines}, "
            f"{'from' if whole else 'not from'} a line start to a line end); the file "
            "changed since the checkpoint, or the checkpoint is damaged."
        )
        raise CheckpointError(msg)

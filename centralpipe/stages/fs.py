"""Where file readers open files: local paths, or fsspec URLs.

A path with a protocol (``s3://bucket/x``, ``memory://x``, ``file:///x``,
``hf://datasets/...``, ``https://...``, or a chain such as
``simplecache::s3://bucket/x``, fsspec's own caching) is opened through
fsspec; any other path through ``open()``. fsspec and the filesystem's package
(``s3fs``, ``gcsfs``, ...) are optional: a missing one is a ``PipelineError``
naming the extra to install. Options of a filesystem (an endpoint,
credentials) come from fsspec's own configuration (``fsspec.config.conf``,
or ``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables).

Optional packages are imported here, when a reader first needs one, never
when ``centralpipe`` is imported.
"""

from __future__ import annotations

import importlib
import os
from typing import IO, Any

from centralpipe.errors import PipelineError

__all__ = ["file_size", "glob_url", "is_url", "need", "open_binary", "url_head"]

#: The extra that installs each optional package.
EXTRAS = {
    "fsspec": "remote",
    "pyarrow": "parquet",
    "zstandard": "zstd",
    "datasets": "hf",
}


def need(module: str, what: str) -> Any:
    """Import ``module`` (an optional package) or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module.partition(".")[0], "remote")
        msg = (
            f"{what} needs the optional package {module.partition('.')[0]!r}, which is not "
            f"installed ({exc}); install it with: pip install 'centralpipe[{extra}]'."
        )
        raise PipelineError(msg) from None


def is_url(path: str) -> bool:
    """Whether ``path`` names a file through fsspec (has a ``protocol://``)."""
    return "://" in path or "::" in path


def url_head(url: str) -> str:
    """The part of ``url`` up to and including its last ``://`` (``"memory://"``,
    ``"simplecache::s3://"``): joined to a filesystem's path, the file's URL."""
    head, sep, _ = url.rpartition("://")
    return head + sep


def _fs(url: str, what: str) -> tuple[Any, str]:
    core = need("fsspec.core", what)
    try:
        return core.url_to_fs(url)
    except ImportError as exc:  # the protocol's own package (s3fs, gcsfs, ...)
        msg = (
            f"{what}: cannot open {url!r}: {exc}. Install it, or all the usual ones with: "
            "pip install 'centralpipe[remote]'."
        )
        raise PipelineError(msg) from None
    except ValueError as exc:  # an unknown protocol
        raise PipelineError(f"{what}: cannot open {url!r}: {exc}.") from None


def _join(head: str, path: str) -> str:
    """The URL of a filesystem's ``path``: ``head`` (see :func:`url_head`) joined
    to it, or, for filesystems whose paths are URLs already (``http(s)``),
    the path after the chain part of ``head`` (``"simplecache::"``)."""
    if "://" not in path:
        return head + path
    chain, sep, _ = head.rpartition("::")
    return chain + sep + path


def glob_url(url: str, what: str) -> tuple[str, list[tuple[str, int]]]:
    """The root of a glob URL (its directories before any wildcard, as a URL
    ending in ``/``) and the files it matches, sorted, as ``(url, size)``."""
    fs, path = _fs(url, what)
    head = url_head(url)
    fixed = []
    for part in path.split("/")[:-1]:
        if _GLOB_MAGIC & set(part):
            break
        fixed.append(part)
    root = _join(head, "/".join(fixed) + "/")
    fs.invalidate_cache()  # listed afresh each time a Loader starts
    if fs.exists(path) and not fs.isdir(path) and not _GLOB_MAGIC & set(path):
        found = {path: fs.info(path)}  # one file, named without wildcards
    else:
        found = fs.glob(path, detail=True)
    out = []
    for name, info in found.items():
        if info.get("type", "file") == "directory":
            continue
        size = info.get("size")
        if size is None:  # a listing without sizes (an HTTP index page)
            size = fs.size(name)
        out.append((_join(head, name), int(size or 0)))
    return root, sorted(out)


_GLOB_MAGIC = frozenset("*?[")


def open_binary(path: str, what: str) -> IO[bytes]:
    """``path`` opened for reading bytes, seekable (local or through fsspec)."""
    if not is_url(path):
        return open(path, "rb")
    fs, inner = _fs(path, what)
    f: IO[bytes] = fs.open(inner, "rb")
    return f


def file_size(path: str, what: str) -> int:
    """The size of ``path`` in bytes (``OSError`` if it cannot be read)."""
    if not is_url(path):
        return os.path.getsize(path)
    fs, inner = _fs(path, what)
    try:
        fs.invalidate_cache(inner)  # the size now, not when last listed
        return int(fs.size(inner))
    except OSError:
        raise
    except Exception as exc:  # a filesystem's own errors, e.g. botocore's
        raise OSError(f"cannot stat {path!r}: {exc}") from exc

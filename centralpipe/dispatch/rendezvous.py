"""Finding and trusting a central service: a private socket, peer credentials, a token.

A service listens on a Unix socket in a private directory keyed by the job
(``TORCHELASTIC_RUN_ID`` under torchrun, else the training process's pid):
``$XDG_RUNTIME_DIR`` (or the system's temporary directory) /
``centralpipe-<uid>-<job>``, created with mode ``0700`` and refused if it
exists with any other owner or mode, or as a link. A connection is trusted
only once both of these hold, and nothing is unpickled from it before:

1. the peer's credentials (``SO_PEERCRED``, from the kernel) name this user
   (and, where the caller knows it, the expected process);
2. each side proves it holds the per-job token without sending it: each
   sends a fresh nonce, answers the other's with ``HMAC-SHA256(token, role +
   nonce)``, and compares in constant time. Every read of the exchange is a
   raw, length-bounded ``recv_bytes`` with a timeout (``HANDSHAKE_TIMEOUT_S``),
   so a peer that sends nothing or too much is dropped, never waited on.

Only the standard library: ``socket``, ``hmac``, ``secrets`` and
``multiprocessing.connection.Connection``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import socket
import stat
import struct
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

from centralpipe.dispatch import timeouts
from centralpipe.errors import ServiceError

__all__ = [
    "TOKEN_BYTES",
    "accept",
    "connect",
    "job_key",
    "listen",
    "new_token",
    "peer_credentials",
    "private_dir",
    "remove_socket",
]

TOKEN_BYTES = 32
_NONCE_BYTES = 32
_HELLO = b"centralpipe-hello-1:"
_MAX_HELLO = len(_HELLO) + _NONCE_BYTES
_MAX_ANSWER = hashlib.sha256().digest_size
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_BIND_ATTEMPTS = 20


def job_key() -> str:
    """The job this process belongs to: torchrun's run id, else its own pid."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    key = f"job-{run_id}" if run_id else f"pid-{os.getpid()}"
    return _SAFE.sub("_", key)[:64]


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def private_dir(key: str) -> Path:
    """This user's ``0700`` directory for job ``key``, created if missing.

    Raises ``ServiceError`` if the path exists and is not a directory of this
    user that only this user can enter (another user could watch or replace
    the socket in it)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return _ensure_private(Path(base) / f"centralpipe-{os.getuid()}-{key}")


def _ensure_private(path: Path) -> Path:
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        msg = (
            f"the central service's directory {str(path)!r} must be a directory of user "
            f"{os.getuid()} with mode 0700, got mode {stat.filemode(info.st_mode)} owned by "
            f"{info.st_uid}: remove it, or set XDG_RUNTIME_DIR to a private directory."
        )
        raise ServiceError(msg)
    return path


def listen(path: str, backlog: int = 8) -> socket.socket:
    """A Unix socket listening at ``path``, in its private directory. The
    directory is made again if another service of the job removed it (each
    removes it, when empty, once its client is in) between its creation and
    the bind; once the socket is in it, it is not empty and stays."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for _ in range(_BIND_ATTEMPTS):
            _ensure_private(Path(path).parent)
            try:
                sock.bind(path)
                break
            except FileNotFoundError:
                continue
        else:
            raise ServiceError(f"could not bind the central service's socket at {path!r}.")
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def remove_socket(path: str) -> None:
    """Remove the socket at ``path`` and its directory, if that is empty now."""
    with contextlib.suppress(OSError):
        os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(path))  # only when empty: other Loaders' sockets stay


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end, from the kernel."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


def _check_peer(sock: socket.socket, expect_pid: int | None) -> None:
    pid, uid, _ = peer_credentials(sock)
    if uid != os.getuid():
        raise ServiceError(f"refused a connection from user {uid} (expected {os.getuid()}).")
    if expect_pid is not None and pid != expect_pid:
        raise ServiceError(f"refused a connection from pid {pid} (expected {expect_pid}).")


def _read(conn: Connection, maxlength: int) -> bytes:
    if not conn.poll(timeouts.HANDSHAKE_TIMEOUT_S):
        raise ServiceError(
            f"the peer sent nothing within {timeouts.HANDSHAKE_TIMEOUT_S} s of the authentication."
        )
    try:
        return conn.recv_bytes(maxlength)
    except (OSError, EOFError) as exc:
        raise ServiceError(f"the peer broke off the authentication ({exc}).") from None


def _answer(token: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def _handshake(conn: Connection, token: bytes, role: bytes, peer_role: bytes) -> None:
    """Mutual proof of the token (see the module docstring); raw bytes only."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    conn.send_bytes(_HELLO + nonce)
    hello = _read(conn, _MAX_HELLO)
    if len(hello) != _MAX_HELLO or not hello.startswith(_HELLO):
        raise ServiceError("the peer is not a centralpipe service or client (bad greeting).")
    conn.send_bytes(_answer(token, role, hello[len(_HELLO) :]))
    answer = _read(conn, _MAX_ANSWER)
    if not hmac.compare_digest(answer, _answer(token, peer_role, nonce)):
        raise ServiceError(
            "the peer does not hold this job's token: refused (a process of another job, "
            "or a stale service)."
        )


def _authenticated(
    sock: socket.socket, token: bytes, role: bytes, peer_role: bytes, expect_pid: int | None
) -> Connection:
    """``sock`` as a ``Connection`` once its peer passed both checks; closed
    (and the error raised) otherwise."""
    try:
        _check_peer(sock, expect_pid)
        sock.setblocking(True)
        conn = Connection(sock.detach())
    except BaseException:
        sock.close()
        raise
    try:
        _handshake(conn, token, role, peer_role)
    except BaseException:
        conn.close()
        raise
    return conn


def accept(listener: socket.socket, token: bytes, expect_pid: int | None = None) -> Connection:
    """The next connection on ``listener`` that authenticates (see the module
    docstring); peers that do not are closed and reported as ``ServiceError``.
    ``listener``'s own timeout bounds the wait for a connection."""
    sock, _ = listener.accept()
    return _authenticated(sock, token, b"service", b"client", expect_pid)


def connect(path: str, token: bytes, expect_pid: int | None = None) -> Connection:
    """An authenticated connection to the service listening at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeouts.HANDSHAKE_TIMEOUT_S)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return _authenticated(sock, token, b"client", b"service", expect_pid)

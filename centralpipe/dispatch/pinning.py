"""``pin_memory=True``: page-locked tensors for the current accelerator.

Pinning a tensor allocates page-locked memory and copies into it, which is
too slow for the consumer's critical path. As soon as a chunk's result is in
(``Stream.accept``), a :class:`Pinner` thread pins its outputs while the
consumer still delivers earlier chunks; the consumer takes the pinned
outputs when it reaches the chunk. Delivery order, counts and checkpoints do
not change: a chunk's outputs are replaced, not re-queued. The work ahead is
bounded by the buffer (only chunks already received are pinned).

The pin thread works for the accelerator device that was current in the
thread that created the Loader (``torch.accelerator.current_device_index``),
as torch's DataLoader's pin thread does: a new thread starts on device 0,
and pinning there would set up device 0 in every process of a multi-device
job.

Without an accelerator (``torch.accelerator``) pinning is meaningless, and
on MPS torch cannot pin (torch's DataLoader turns it off there too):
:func:`make_pinner` warns once per Loader and the outputs are left as they are.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from types import FrameType
from typing import Any

import torch

from centralpipe.dispatch import timeouts
from centralpipe.dispatch.chainlock import join_started

__all__ = ["Pinner", "accelerator", "make_pinner", "pin"]


def accelerator() -> torch.device | None:
    """The current accelerator, or ``None`` (CPU only)."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    device: torch.device | None = acc.current_accelerator()
    return device


#: Accelerators on which torch cannot pin memory (it raises).
_CANNOT_PIN = ("mps",)


def pin(obj: Any) -> Any:
    """``obj`` with every CPU tensor in it pinned (containers rebuilt alike;
    objects with their own ``pin_memory()`` method use it, as torch's
    DataLoader does)."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if obj.device.type == "cpu" and not obj.is_pinned() else obj
    if isinstance(obj, (str, bytes, bytearray, int, float, type(None))):
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(pin(x) for x in obj))
    if isinstance(obj, tuple):
        return tuple(pin(x) for x in obj)
    if isinstance(obj, list):
        return [pin(x) for x in obj]
    if isinstance(obj, Mapping):
        try:
            return type(obj)({k: pin(v) for k, v in obj.items()})  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from a dict
            return {k: pin(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: pin(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    method = getattr(obj, "pin_memory", None)
    if callable(method):
        return method()
    return obj


class Pinner:
    """One thread that pins the outputs of received chunks, in order.

    Each thread has its own job queue, so a thread whose start was
    interrupted (Ctrl-C) and is given up can never take a later thread's
    jobs, and ``close()`` ends whichever of them runs. The thread pins for
    accelerator device ``device_index`` (``None``: the thread's default)."""

    def __init__(self, device_index: int | None = None) -> None:
        self.device_index = device_index
        self._jobs: queue.SimpleQueue[tuple[list[Any], Future[list[Any]]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, outputs: list[Any]) -> Future[list[Any]]:
        """Pin ``outputs`` in the background; the future gives the pinned list."""
        future: Future[list[Any]] = Future()
        with self._lock:
            if self._closed:
                future.set_result(outputs)
                return future
            if self._thread is None:
                jobs: queue.SimpleQueue[tuple[list[Any], Future[list[Any]]] | None]
                jobs = queue.SimpleQueue()
                thread = threading.Thread(
                    target=self._run,
                    args=(jobs, self.device_index),
                    name="centralpipe-pin",
                    daemon=True,
                )
                self._thread, self._jobs = thread, jobs
                try:
                    thread.start()
                except BaseException:
                    # Interrupted before or after the thread began: if it runs,
                    # this ends it; the next submit starts a fresh one.
                    self._thread = None
                    jobs.put(None)
                    raise
            self._jobs.put((outputs, future))
        return future

    @staticmethod
    def _run(
        jobs: queue.SimpleQueue[tuple[list[Any], Future[list[Any]]] | None],
        device_index: int | None,
    ) -> None:
        if device_index is not None:
            torch.accelerator.set_device_index(device_index)
        while True:
            job = jobs.get()
            if job is None:
                return
            outputs, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result([pin(x) for x in outputs])
            except BaseException as exc:  # reported to the consumer by the future
                future.set_exception(exc)

    def close(self) -> None:
        """Stop the thread (after its current chunk); idempotent."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            join_started(thread, timeouts.PIN_CLOSE_TIMEOUT_S)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by this module's caller that
    names the user's line: the first frame outside the package, however
    deep the Loader's construction calls (in process or a service's client)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def make_pinner(enabled: bool) -> Pinner | None:
    """A :class:`Pinner` when ``enabled`` and an accelerator exists; else
    ``None`` (with a warning when it was asked for)."""
    if not enabled:
        return None
    device = accelerator()
    if device is None:
        warnings.warn(
            "LoaderConfig(pin_memory=True) but no accelerator is available "
            "(torch.accelerator.is_available() is False): tensors are not pinned.",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )
        return None
    if device.type in _CANNOT_PIN:
        warnings.warn(
            f"LoaderConfig(pin_memory=True) but torch cannot pin memory for the "
            f"'{device.type}' accelerator: tensors are not pinned.",
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )
        return None
    return Pinner(torch.accelerator.current_device_index())

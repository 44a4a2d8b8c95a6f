"""The exceptions centralpipe raises.

::

    CentralpipeError (Exception)
     ├── PipelineError          the pipeline was built wrongly (raised at build time
     │                          or, at the latest, when the Loader starts)
     ├── ConfigError (ValueError)  a configuration value is out of range
     ├── CheckpointError        a checkpoint is damaged, newer, or of another pipeline
     ├── WorkerError            a worker stage raised, a worker died or hung
     └── ServiceError (RuntimeError)  the helper process of ``central="service"``
                                died, or refused or lost its client

Exceptions raised by *central* stages (sources, ``map`` before ``dispatch()`` …)
are not wrapped: they reach the consumer with their own type and a note naming
the stage.
"""

from __future__ import annotations

__all__ = [
    "CentralpipeError",
    "CheckpointError",
    "ConfigError",
    "PipelineError",
    "ServiceError",
    "WorkerError",
]


class CentralpipeError(Exception):
    """Base class of every error centralpipe raises on its own account."""


class PipelineError(CentralpipeError):
    """The pipeline is built wrongly: the message names the stage and the fix."""


class ConfigError(CentralpipeError, ValueError):
    """A configuration value is invalid: the message names the field."""


class CheckpointError(CentralpipeError):
    """A checkpoint cannot be resumed: damaged, newer, or of another pipeline."""


class ServiceError(CentralpipeError, RuntimeError):
    """The central service of ``LoaderConfig(central="service")`` is gone (it
    died, or was killed), or a connection to it failed to authenticate: the
    message names the process and what to do."""


class WorkerError(CentralpipeError):
    """A worker stage failed.

    Attributes:
        stage: name of the worker stage that failed (``None`` when the worker
            died or hung without naming one).
        seq: the dispatch index of the item (``None`` when unknown).
        exc_type: name of the original exception type, when there was one.
        remote_traceback: the traceback text from the worker, when there was one.
        exitcode: the worker's exit code (negative: killed by that signal), when
            the worker died.
    """

    def __init__(
        self,
        message: str,
        *,
        stage: str | None = None,
        seq: int | None = None,
        exc_type: str | None = None,
        remote_traceback: str | None = None,
        exitcode: int | None = None,
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.seq = seq
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_worker_error,
            (
                self.args[0] if self.args else "",
                self.stage,
                self.seq,
                self.exc_type,
                self.remote_traceback,
                self.exitcode,
            ),
        )

    def __str__(self) -> str:
        text = super().__str__()
        if self.remote_traceback:
            return f"{text}\n\nWorker traceback:\n{self.remote_traceback.rstrip()}"
        return text


def _rebuild_worker_error(
    message: str,
    stage: str | None,
    seq: int | None,
    exc_type: str | None,
    remote_traceback: str | None,
    exitcode: int | None,
) -> WorkerError:
    return WorkerError(
        message,
        stage=stage,
        seq=seq,
        exc_type=exc_type,
        remote_traceback=remote_traceback,
        exitcode=exitcode,
    )

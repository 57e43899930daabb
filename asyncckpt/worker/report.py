"""What a worker tells its trainer: a failure's info, over the events pipe (``ToTrainer``)."""

from __future__ import annotations

import threading
import traceback
from typing import Any


def root_cause(exc: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` wrapper (it hides an OSError's errno)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            return wrapped[0]
    return exc


def error_info(exc: BaseException) -> dict[str, Any]:
    exc = root_cause(exc)
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "errno": getattr(exc, "errno", None),
        "traceback": "".join(traceback.format_exception(exc)),
    }


def collect_thread_errors() -> list[BaseException]:
    """The exceptions of this process's threads from now on, in a list the caller clears (each
    also goes to the hook before: logged as ever)."""
    errors: list[BaseException] = []
    previous_hook = threading.excepthook

    def hook(args: Any) -> None:
        if args.exc_value is not None:
            errors.append(args.exc_value)
        previous_hook(args)

    threading.excepthook = hook
    return errors


class ToTrainer:
    """The worker's side of the events pipe. Once the trainer is gone nobody listens: what
    would have been reported is dropped and the staged saves are finished all the same."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.gone = False
        # The main loop and the memory tier's Holder thread both report: whole messages only.
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        if self.gone:
            return
        try:
            with self.lock:
                self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.gone = True

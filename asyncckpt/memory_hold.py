"""The worker's side of the memory tier (memory_tier.py is the trainer's): ``Holder``, a
thread that keeps the newest complete memory checkpoint for the worker to write when it must."""

from __future__ import annotations

import logging
import threading
from typing import Any

from . import layout as _layout

log = logging.getLogger("asyncckpt")

#: Why a memory checkpoint was written (the manifest's ``persisted_because``).
TRAINER_DIED = "trainer died"
PREEMPTION = "preemption"
CLOSE = "close"


class Holder:
    """The worker's side: a thread that reads ``Hold`` messages from their own pipe and keeps
    the newest complete memory checkpoint, releasing the slot of the one it replaces.

    The main loop asks for it (``take``) when it must be written: at the trainer's death once
    this pipe is at its end too (``wait_closed``), or when the trainer asks (``forget`` the
    one it persists itself, since the trainer reuses that slot once that write released it).
    """

    def __init__(self, conn: Any, events: Any) -> None:
        self.conn = conn
        self.events = events
        self.lock = threading.Lock()
        self.held: Any = None  # a SaveJob
        self.last_paths: Any = None
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._run, name="asyncckpt-holder", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from . import messages as M

        try:
            while True:
                msg = self.conn.recv()
                if not isinstance(msg, M.Hold):
                    raise TypeError(f"unknown message on the memory tier's pipe: {msg!r}")
                job = msg.job
                # Paths travel only when they changed (a replayed plan's are the same object).
                if job.paths is None:
                    job.paths = self.last_paths
                self.last_paths = job.paths
                with self.lock:
                    old, self.held = self.held, job
                if old is not None:
                    self.events.send(M.Released(old.job_id))
        except (EOFError, OSError):
            pass  # the trainer is gone (or closed the engine)
        finally:
            self.closed.set()

    def wait_closed(self, timeout: float) -> bool:
        return self.closed.wait(timeout)

    def forget(self, job_id: int) -> None:
        """The trainer persists memory job ``job_id`` itself: never write it a second time."""
        with self.lock:
            if self.held is not None and self.held.job_id == job_id:
                self.held = None

    def take(self) -> Any:
        with self.lock:
            job, self.held = self.held, None
            return job


def persist_held(worker: Any) -> None:
    """Write the memory checkpoint the trainer left (its death): committed like any save,
    and only if newer than the newest committed step (steps go forward)."""
    if worker.holder is None:
        return
    # Its pipe ends with the trainer too; a Hold sent before the death is read first. (If
    # a forked child keeps the pipe open, the slot held is still never being written to:
    # the trainer stages only into slots this worker released.)
    worker.holder.wait_closed(10.0)
    job = worker.holder.take()
    if job is None:
        return
    newest = _layout.read_tracker(worker.root)
    final = worker.root / _layout.dir_name(worker.config.layout, job.step)
    if (newest is not None and job.step <= newest) or final.exists():
        log.warning(
            "the trainer is gone; its memory checkpoint of step %d is not newer than "
            "step %s on disk: not written",
            job.step,
            newest,
        )
        return
    log.warning("the trainer is gone: writing its memory checkpoint of step %d", job.step)
    job.tier, job.persisted_because = "memory", TRAINER_DIED
    worker._save(job)

"""The messages between the trainer's engine and its worker process, one class each.

Two one-way pipes: jobs (trainer -> worker) and events (worker -> trainer). Every message is a
small frozen dataclass, matched by type on the other side, never a tuple read by position.
``encode`` pickles a message before anything is written to a pipe, so a message that cannot be
pickled (a user's retention policy holding a lambda, say) fails as an error of that save while
the pipe stays whole, instead of leaving half a message the worker can never read past.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

# ------------------------------------------------------------------ trainer -> worker


@dataclass(frozen=True)
class Arena:
    """A staging arena (shared memory), sent once; later jobs name it by id."""

    arena_id: int
    tensor: Any


@dataclass(frozen=True)
class Specs:
    """The tensor layout of a set of arenas, sent once per layout (jobs then carry none)."""

    arena_ids: tuple[int, ...]
    specs: list


@dataclass(frozen=True)
class Paths:
    """Where each key of the state sits (``engine.prepare`` sends them ahead of the first
    save: 100,000 paths pickled into that save's job cost it ~0.5 s); jobs then carry none."""

    paths: dict


@dataclass(frozen=True)
class Drop:
    """An arena the trainer freed (a slot re-laid out): forget it and its layouts."""

    arena_id: int


@dataclass(frozen=True)
class Protect:
    """``engine.protect(step)``: no prune of this worker deletes ``step`` (pins.py);
    ``while_read``: until ``Unprotect`` (the trainer loads it)."""

    step: int
    while_read: bool = False


@dataclass(frozen=True)
class Unprotect:
    """The load that sent ``Protect(step, while_read=True)`` is over."""

    step: int


@dataclass(frozen=True)
class Save:
    job: Any  # worker.SaveJob


@dataclass(frozen=True)
class Hold:
    """A memory-tier save, completely staged: the newest memory checkpoint the worker keeps
    (and writes if the trainer dies). Sent on the memory tier's own pipe (memory/tier.py).
    ``keep``: the id of the one held job not to release (several ranks: their common step).
    ``writing``: a disk save is written from this job's slot too (``SaveJob.held_as``): its
    ``Released`` waits for that write, even once a newer ``Hold`` replaced it."""

    job: Any  # worker.SaveJob
    keep: int | None = None
    writing: bool = False


@dataclass(frozen=True)
class LetGo:
    """Release memory job ``job_id``'s slot (answered by ``Released``): the trainer needs it
    for a newer memory save. On the memory tier's pipe, as ``Hold``."""

    job_id: int


@dataclass(frozen=True)
class Stop:
    pass


# ------------------------------------------------------------------ worker -> trainer


@dataclass(frozen=True)
class Ready:
    pid: int
    throttle_report: Any


@dataclass(frozen=True)
class FaultFired:
    """A fault point fired in the worker: the trainer disarms it (faults.consume)."""

    fault_id: str


@dataclass(frozen=True)
class Dropped:
    """An arena the trainer freed (``Drop``) is no longer mapped by the worker: its shared
    memory is given back (engine: ``WorkerLink.undropped``)."""

    arena_id: int


@dataclass(frozen=True)
class Protected:
    """The worker keeps ``step`` from every prune from now on (``Protect``; engine:
    ``WorkerLink.unprotected``)."""

    step: int


@dataclass(frozen=True)
class Mapped:
    """An arena was received (mapped): from now on the worker needs its trainer no more to
    write a save staged in it (engine: ``WorkerLink.unmapped``)."""

    arena_id: int


@dataclass(frozen=True)
class Begun:
    job_id: int


@dataclass(frozen=True)
class Released:
    """The job's staging arena may be reused (its bytes are in the files, or it failed)."""

    job_id: int


@dataclass(frozen=True)
class Replicated:
    """Memory job ``job_id`` is held whole by the peer worker (``error`` None), or will not be
    (why): ``MemoryTier(replicas=1)``, replication.py."""

    job_id: int
    error: str | None = None


@dataclass(frozen=True)
class Committed:
    job_id: int
    stats: dict


@dataclass(frozen=True)
class Failed:
    """``info``: worker.error_info of the cause; ``upload`` / ``export`` mark a failure after
    the step committed locally (engine: UploadFailed / ExportFailed)."""

    job_id: int
    info: dict


@dataclass(frozen=True)
class Pruned:
    job_id: int | None
    report: Any
    error: dict | None


def encode(msg: Any) -> bytes:
    """``msg`` pickled the way ``Connection.send`` does (shared-memory tensors by handle)."""
    return bytes(ForkingPickler.dumps(msg))


def send(conn: Any, payload: bytes) -> None:
    """Write an ``encode``d message: the only part that can be cut short part-way."""
    conn.send_bytes(payload)


class WordWait:
    """Waits for the worker's answer to a message sent on its link: on the job table's
    condition (the reader thread notifies it as answers come), ended early by a worker
    replaced (``current()`` is another link) or an engine stopped (``started()`` False)."""

    def __init__(
        self,
        cond: threading.Condition,
        current: Callable[[], object],
        started: Callable[[], bool],
    ) -> None:
        self.cond = cond
        self.current = current
        self.started = started

    def wait_for_word(self, link: object, waiting: Callable[[], bool], limit: float) -> bool:
        """Wait while ``waiting()`` (the worker's answer to a message sent on ``link`` has not
        come), at most ``limit`` s; True if it gave up then (the caller says so). A worker
        replaced or an engine stopped meanwhile ends the wait: that worker answers nothing."""
        deadline = time.monotonic() + limit
        with self.cond:
            while waiting():
                if link is not self.current() or not self.started():
                    return False
                if time.monotonic() > deadline:
                    return True
                self.cond.wait(0.5)
        return False

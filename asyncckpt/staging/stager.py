"""How a save is staged and handed to the worker: the ``Stager`` protocol, and what it works on.

After torch DCP's ``AsyncStager``: each kind of save is staged by one implementation, chosen in
order by ``claims`` -- the memory tier (memory/tier.py: ``MemoryStager``), the chunked budget
(chunked.py: ``ChunkedStager``) and the disk slots (trainer/stagers.py: ``DiskSlots``) -- and the
trainer's ``Saver`` calls them only through this protocol. Here too, below every implementation:
the ``PendingSave`` they stage, the ``SaveHandle`` that says how it ended, and the small protocols
of what they need of the saver (``Handover``), its job table (``SlotJobs``) and SIGTERM's handler
(``Deferral``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio

from asyncckpt.core.savejob import SaveJob
from asyncckpt.errors import NotReplicated, SaveFailed
from asyncckpt.staging.arenas import Marks, StagingSlot
from asyncckpt.stats import SaveStats


class SaveHandle:
    """What ``save`` returns: completes when the checkpoint has committed (or failed).

    ``staged()`` / ``staged_sync()`` wait until the state has been copied (at once for a
    blocking save; an overlapped one, ``save(..., overlap=True)``, copies in the background):
    from then on the state may be mutated.

    ``skipped``: a memory save (``tier="memory"``) that found both of the memory tier's slots
    in use, one held and one being written to disk, and was not taken rather than stall
    training for the write; complete at once, not failed: nothing of this step is held (the
    worker keeps the previous memory save).
    """

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self._done = threading.Event()
        self._staged = threading.Event()
        self._error: BaseException | None = None
        self._observed = False
        # MemoryTier(replicas=1): set once the peer node's worker holds this memory save's
        # replica, or it will not (``_replica_error``); None: not a replicated save.
        self._replica: threading.Event | None = None
        self._replica_error: str | None = None
        self.skipped = False

    def done(self) -> bool:
        return self._done.is_set()

    def is_staged(self) -> bool:
        """True once the state is copied (or the save failed): mutating it is safe."""
        return self._staged.is_set()

    def staged_sync(self, timeout: float | None = None) -> None:
        """Block until the state is copied; the training loop may mutate it afterwards.

        Does not raise when the save failed (``committed`` does): either way the copy is over.
        """
        if self._staged.is_set():
            return
        t0 = time.perf_counter()
        if not self._staged.wait(timeout):
            raise TimeoutError(f"step {self.step} was not staged within {timeout} s")
        self.stats.staged_wait_seconds += time.perf_counter() - t0

    async def staged(self) -> None:
        """Wait (without blocking the event loop) until the state is copied."""
        if not self._staged.is_set():
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(self._staged.wait, abandon_on_cancel=True)
            self.stats.staged_wait_seconds += time.perf_counter() - t0

    def exception(self) -> BaseException | None:
        return self._error

    def committed_sync(self, timeout: float | None = None) -> SaveStats:
        """Block until committed; raise ``SaveFailed`` with the cause if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"step {self.step} did not commit within {timeout} s")
        return self._result()

    async def committed(self) -> SaveStats:
        """Wait (without blocking the event loop) until committed; raise if it failed."""
        if not self._done.is_set():
            await anyio.to_thread.run_sync(self._done.wait, abandon_on_cancel=True)
        return self._result()

    def _result(self) -> SaveStats:
        if self._error is not None:
            self._observed = True
            raise self._error
        return self.stats

    def replicated_sync(self, timeout: float | None = None) -> None:
        """Block until this memory save's replica is held whole by the worker of the peer
        node (``memory=MemoryTier(replicas=1)``); from then on it survives the loss of this
        rank's node. Raises ``NotReplicated`` if it will not be (the save stands: its own
        worker holds it), ``TimeoutError`` after ``timeout`` seconds."""
        event = self._replica_event()
        if not event.wait(timeout):
            raise TimeoutError(f"step {self.step} was not replicated within {timeout} s")
        self._replica_result()

    async def replicated(self) -> None:
        """``replicated_sync`` without blocking the event loop."""
        event = self._replica_event()
        if not event.is_set():
            await anyio.to_thread.run_sync(event.wait, abandon_on_cancel=True)
        self._replica_result()

    def is_replicated(self) -> bool:
        """True once the replica is held (False while it is not, or if it will not be)."""
        return self._replica is not None and self._replica.is_set() and not self._replica_error

    def _replica_event(self) -> threading.Event:
        if self._replica is None:
            raise NotReplicated(
                f"step {self.step} is not a replicated save: only memory saves "
                '(tier="memory") with memory=MemoryTier(replicas=1) are replicated'
            )
        return self._replica

    def _replica_result(self) -> None:
        if self._replica_error is not None:
            raise NotReplicated(
                f"memory save of step {self.step} is not replicated: {self._replica_error} "
                "(its own worker holds it)"
            )

    def _replica_done(self, error: str | None) -> None:
        if self._replica is not None and not self._replica.is_set():
            self._replica_error = error
            self._replica.set()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._staged.set()  # (a save that failed while staging touches the state no more)
        self._done.set()

    def _skip(self) -> None:
        """Not taken (``skipped``): complete, nothing staged or held."""
        self.skipped = True
        self._finish()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        state = "skipped" if self.skipped else state
        return f"<SaveHandle step={self.step} {state}>"


@dataclass
class PendingSave:
    """A save between validation and hand-off."""

    step: int
    flat: Any
    key: tuple  # staging.layout_key of the tensors: which slot layout fits
    metrics: dict[str, float]
    stats: SaveStats
    started: float
    handle: SaveHandle
    marks: Marks  # the tensors' version counters and data pointers when save was called (torn)
    slot: int | None = None
    guard: bool = False  # other code ran since save was called: check pointers before the copy
    abandoned: bool = False  # cancelled before it staged: a slot it takes goes back at once
    ready: dict[int, Any] | None = None  # overlapped: CUDA events of the save() call's streams
    metadata: dict[str, Any] = field(default_factory=dict)  # save(metadata=...), checked
    tier: str = "disk"  # save(tier=): "memory" is staged by the memory tier only


class Stager(Protocol):
    """One way a save is staged and handed over. The ``Saver`` asks its stagers in order
    whether they ``claims`` a save and has the first that does ``stage`` it."""

    @property
    def uses_disk_slot(self) -> bool:
        """The save's ``slot`` must be reserved among the disk slots before ``stage`` (the
        saver waits for one: back-pressure)."""
        ...

    def claims(self, pending: PendingSave, overlap: bool) -> bool:
        """Whether this stager stages ``pending``; raises where it must but cannot (a refusal,
        before anything is staged)."""
        ...

    def stage(self, pending: PendingSave, overlap: bool) -> SaveHandle:
        """Copy ``pending``'s state and hand its job to the worker; returns its handle (which
        fails, rather than this raising, when the state changed while it was copied)."""
        ...


class Link(Protocol):
    """One worker's pipes and what was sent down them (``supervisor.WorkerLink``)."""

    conn: Any  # the jobs pipe
    memory: Any  # the memory tier's pipe (Hold, LetGo)
    memory_paths: Any  # the paths the last Hold carried
    paths: Any  # the paths the worker has (a job whose paths are those carries none)
    arenas: set[int]  # the arenas it maps
    unmapped: set[int]  # sent, and no Mapped back yet
    undropped: set[int]  # Drop sent, and no Dropped back yet
    unprotected: set[int]  # Protect sent, and no Protected back yet
    specs: set[tuple[int, ...]]  # the arena sets whose tensor specs it has


class Handover(Protocol):
    """What a stager needs of the saver's hand-over to the worker (``saving.Saver``)."""

    def job_for(
        self,
        pending: PendingSave,
        slot: StagingSlot,
        job_id: int,
        attempt: int,
        tier: str = "disk",
        digests: dict[str, bytes] | None = None,
    ) -> SaveJob:
        """The worker's job for ``pending`` staged in ``slot``."""
        ...

    def send_job(
        self, pending: PendingSave, slot: StagingSlot, job_id: int, job: SaveJob
    ) -> Link | None:
        """Hand ``job`` to the worker; the link it went down, or None if the job ended."""
        ...


class Deferral(Protocol):
    """SIGTERM's handler as a hand-off sees it (``preemption.SigtermHandler``)."""

    def handing_off(self) -> contextlib.AbstractContextManager[None]:
        """A SIGTERM meanwhile waits (its drain would wait for this job)."""
        ...

    def run_deferred(self) -> None:
        """Run the SIGTERM that arrived meanwhile, if one did."""
        ...


class SlotJobs(Protocol):
    """What a stager needs of the job table (``jobs.JobTable``)."""

    @property
    def cond(self) -> threading.Condition: ...

    def add(
        self, step: int, handle: SaveHandle, slot: int, owns_slot: bool = True
    ) -> tuple[int, int]:
        """Enter a save about to be handed over; its (job id, attempt)."""
        ...

    def in_flight(self, job_id: int) -> bool: ...

    def unreserve(self, slot: int) -> None: ...

    def explain(self, job_id: int, err: SaveFailed) -> None: ...

    def fail(self, job_id: int, err: SaveFailed) -> None: ...

    def fail_unsent(self, handle: SaveHandle, err: SaveFailed) -> None: ...

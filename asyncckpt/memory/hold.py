"""The worker's side of the memory tier (memory/tier.py is the trainer's): ``Holder``, a
thread that keeps the newest complete memory checkpoint for the worker to write when it must.

Several ranks: a memory checkpoint is worth writing only if every rank's worker holds its part
of the same step, so a worker holds up to two: the newest step every rank handed off (the
"common" one, kept until a newer one is common) and a newer one. The trainers agree over the
side store which of the two goes when a third arrives (memory_tier.Agreement); when the
trainers are gone the workers exchange what they hold and write the newest common step
(``newest_common``), or nothing: never a mix of steps.

A disk save made with the memory tier on is staged into a memory slot as well (memory/tier.py):
its ``Hold`` says ``writing`` and the main loop writes the same slot (``SaveJob.held_as``).
The slot is the hold's; the write only pins it: a job the Holder lets go of (a newer ``Hold``,
a ``LetGo``) while its slot is being written is released (``Released``, the trainer's cue to
stage into it again) once the main loop says the write is done (``written``), never before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster.dist import DistConfig
from asyncckpt.core import layout as _layout
from asyncckpt.core import messages as M
from asyncckpt.core.savejob import SaveJob
from asyncckpt.memory.replication import Replication, claim, standing_in, which_step_to_persist
from asyncckpt.memory.service import WorkerService, WorkerView
from asyncckpt.storage.local import LocalStore

log = logging.getLogger("asyncckpt")

#: Why a memory checkpoint was written (the manifest's ``persisted_because``).
TRAINER_DIED = "trainer died"
PREEMPTION = "preemption"
CLOSE = "close"

#: The fate of a rank's newest held memory step when a newer one needs its slot (agreed once
#: per step over the side store, so that no two ranks decide it differently).
COMMON = "common"  # every rank handed it off: it is kept, the older one goes
DROPPED = "dropped"  # not (yet) on every rank: it goes, the older common one is kept


def fate(handed_off: int, world_size: int) -> str:
    """What a rank proposes for a step ``handed_off`` ranks handed off (the first proposal
    recorded for the step wins, on every rank)."""
    return COMMON if handed_off >= world_size else DROPPED


def let_go(kept: int, newest: int, agreed: str) -> int:
    """Of the two steps a worker holds, the one to release for a newer save: the older only
    once the newer is common (a common step is never evicted before a newer one is)."""
    return kept if agreed == COMMON else newest


def newest_common(held: Sequence[Iterable[int]]) -> int | None:
    """The newest step every rank holds (``held``: each rank's held steps), or None."""
    if not held:
        return None
    common = set(held[0]).intersection(*held[1:])
    return max(common) if common else None


class Holder:
    """The worker's side: a thread that reads ``Hold`` messages from their own pipe and keeps
    the newest complete memory checkpoint, releasing the slot of the one it replaces (but the
    one the ``Hold`` says to keep: several ranks' common step; a ``LetGo`` releases that).

    The main loop asks for it (``take``) when it must be written: at the trainer's death once
    this pipe is at its end too (``wait_closed``), or when the trainer asks (``forget`` the
    one it persists itself, since the trainer reuses that slot once that write released it).
    """

    def __init__(self, conn: Any, events: Any, sender: Any = None) -> None:
        self.conn = conn
        self.events = events
        self.sender = sender  # replication.ReplicaSender (replicas=1), or None
        self.lock = threading.Lock()
        self.held: dict[int, Any] = {}  # job id -> SaveJob: the newest, and one kept (ranks)
        self.ever = False  # a Hold came: this rank takes part in the ranks' exchange
        self.last_paths: Any = None
        self.closed = threading.Event()
        # Slots a disk save is being written from (memory/tier.py): held job ids pinned by
        # their Hold, those let go of meanwhile (released once written), and the writes that
        # ended before their Hold was read (ids above ``last_hold``: Holds come in id order).
        self.writing: set[int] = set()
        self.deferred: dict[int, Any] = {}
        self.early: set[int] = set()
        self.last_hold = 0
        # The worker's mapped arenas, and whether its reader thread ended (watch_arenas).
        self.arenas: dict[int, Any] | None = None
        self.received_all: threading.Event | None = None
        self.thread = threading.Thread(target=self._run, name="asyncckpt-holder", daemon=True)
        self.thread.start()

    def watch_arenas(self, arenas: dict[int, Any], received_all: threading.Event) -> None:
        """Count a ``Hold`` only once the memory of its slot is mapped in this worker
        (``arenas``, filled by its reader thread until ``received_all``): a slot's first use
        sends its memory on the jobs pipe and the ``Hold`` on this one; the trainer killed
        between the two left a ``Hold`` of memory this worker never had, which replaced
        (and released) the one held before. That save's ``save()`` had not returned (it
        waits for the mapping), the one before's had."""
        self.arenas, self.received_all = arenas, received_all

    def _mapped(self, job: Any) -> bool:
        """Wait until ``job``'s arenas are mapped (True), or the reader thread ended first
        without mapping them (False: the trainer is gone)."""
        arenas, ended = self.arenas, self.received_all
        if arenas is None or ended is None:
            return True
        while not all(a in arenas for a in job.arena_ids):
            if ended.is_set():
                return all(a in arenas for a in job.arena_ids)
            time.sleep(0.002)
        return True

    def _run(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                if isinstance(msg, M.LetGo):
                    with self.lock:
                        gone = self.held.pop(msg.job_id, None)
                    if gone is not None:
                        self._release(gone)
                    continue
                if not isinstance(msg, M.Hold):
                    raise TypeError(f"unknown message on the memory tier's pipe: {msg!r}")
                job = msg.job
                # Paths travel only when they changed (a replayed plan's are the same object).
                if job.paths is None:
                    job.paths = self.last_paths
                self.last_paths = job.paths
                if not self._mapped(job):  # its save() never returned: the one held stays
                    log.warning(
                        "the memory checkpoint of step %d never reached this worker (the "
                        "trainer died handing it over): step(s) %s stay held",
                        job.step,
                        sorted(j.step for j in self.held.values()),
                    )
                    continue
                with self.lock:
                    self.last_hold = max(self.last_hold, job.job_id)
                    if msg.writing and job.job_id not in self.early:
                        self.writing.add(job.job_id)
                    self.early.discard(job.job_id)
                    old, self.held = self.held, {job.job_id: job}
                    if msg.keep in old:
                        self.held[msg.keep] = old.pop(msg.keep)
                    self.ever = True
                    others = [j.step for j in self.held.values() if j is not job]
                for gone in old.values():
                    self._release(gone)
                if self.sender is not None:  # in the background: nobody waits for it
                    self.sender.offer(job, others)
        except (EOFError, OSError):
            pass  # the trainer is gone (or closed the engine)
        finally:
            self.closed.set()

    def written(self, job_id: int) -> None:
        """The main loop wrote the disk save staged in held job ``job_id``'s slot (or gave up
        on it): the slot is released if it was let go of meanwhile. Idempotent."""
        with self.lock:
            if job_id > self.last_hold:
                self.early.add(job_id)  # its Hold is still on the pipe: it pins nothing
                return
            self.writing.discard(job_id)
            job = self.deferred.pop(job_id, None)
        if job is not None:
            self._release(job)

    def _release(self, job: Any) -> None:
        """Let the trainer reuse ``job``'s slot, once nothing reads it (a replica being sent
        from it is cut off: its receiver keeps what it held); a slot a disk save is still
        being written from waits for ``written``."""
        with self.lock:
            if job.job_id in self.writing:
                self.deferred[job.job_id] = job
                return
        if self.sender is not None:
            self.sender.release(job.job_id)
        self.events.send(M.Released(job.job_id))

    def wait_closed(self, timeout: float) -> bool:
        return self.closed.wait(timeout)

    def forget(self, job_id: int) -> None:
        """The trainer persists memory job ``job_id`` itself: never write it a second time."""
        with self.lock:
            self.held.pop(job_id, None)

    def take(self) -> list[Any]:
        """The jobs held (newest first), forgotten here."""
        with self.lock:
            jobs, self.held = self.held, {}
        return sorted(jobs.values(), key=lambda j: j.step, reverse=True)


class FixedHolder:
    """A stand-in's holder (replication.py): the replicas of a gone rank, as that rank's
    worker would have held them."""

    ever = True

    def __init__(self, jobs: list[Any]) -> None:
        self.jobs = jobs

    def wait_closed(self, timeout: float) -> bool:
        return True

    def watch_arenas(self, arenas: dict[int, Any], received_all: threading.Event) -> None:
        pass  # (its jobs' memory is its own)

    def take(self) -> list[Any]:
        jobs, self.jobs = self.jobs, []
        return sorted(jobs, key=lambda j: j.step, reverse=True)


class MemoryHold(WorkerService):
    """The memory hold as a worker's service: the Holder told which saves the trainer persists
    itself (``on_job``) and which slots were written (``released``); at the trainer's death
    the memory checkpoint it left written, with stand-ins for gone peers whose replicas this
    worker holds (``trainer_gone``). A stand-in runs ``persist`` alone (``stand_in``: it
    writes a gone rank's replica)."""

    def __init__(
        self,
        worker: WorkerView,
        holder: Holder | FixedHolder | None,
        replication: Replication | None = None,
        *,
        stand_in: bool = False,
    ) -> None:
        self.worker = worker
        self.holder = holder  # the newest memory checkpoint, or None (no memory tier)
        self.replication = replication
        self.stand_in = stand_in
        self.agreed = False  # took its rank's part in the exchange at the trainers' death

    def on_job(self, job: SaveJob) -> None:
        if job.memory_job_id is not None and isinstance(self.holder, Holder):
            self.holder.forget(job.memory_job_id)  # the trainer persists it now

    def released(self, job: SaveJob) -> None:
        """A disk save written from a memory slot (``held_as``): its holder may release that
        slot now (``Holder.written``, idempotent)."""
        if job.held_as is not None and isinstance(self.holder, Holder):
            self.holder.written(job.held_as)

    def trainer_gone(self) -> None:
        """The trainer died: write the memory checkpoint it left, beside the stand-ins for
        gone peers whose replicas this worker holds (replication.py). (The worker's config is
        already the recovery's: ``replication.recovering``.)"""
        with standing_in(self.replication, self.worker.config):
            self.persist()
        self.recovery_over()

    def persist(self) -> None:
        """Write the memory checkpoint the trainer left (its death): committed like any save,
        and only if newer than the newest committed step (steps go forward)."""
        holder, worker = self.holder, self.worker
        if holder is None:
            return
        # Its pipe ends with the trainer too; a Hold sent before the death is read first. (If
        # a forked child keeps the pipe open, the slot held is still never being written to:
        # the trainer stages only into slots this worker released.)
        holder.wait_closed(10.0)
        jobs = holder.take()
        newest = _layout.read_tracker(worker.root)
        cfg = worker.config.dist
        if cfg is None:
            job = jobs[0] if jobs else None
        elif not holder.ever:
            return  # no memory save reached this rank: nothing for the others to wait for
        else:
            if self.replication is not None and not self._speaks_for_itself(cfg):
                return
            job, newest = self._agree(cfg, jobs, newest)
            self.agreed = True
        if job is None:
            return
        final = worker.root / _layout.dir_name(worker.config.layout, job.step)
        if (newest is not None and job.step <= newest) or final.exists():
            log.warning(
                "the trainer is gone; its memory checkpoint of step %d is not newer than "
                "step %s on disk: not written",
                job.step,
                newest,
            )
            return
        log.warning(
            "the trainer is gone: writing %s memory checkpoint of step %d",
            f"rank {worker.config.rank}'s replicated" if self.stand_in else "its",
            job.step,
        )
        job.tier, job.persisted_because = "memory", TRAINER_DIED
        worker.save(job)

    def _speaks_for_itself(self, cfg: DistConfig) -> bool:
        """Replicas: this worker takes its rank's part in the exchange unless the holder of
        its replica already does (it found this worker gone or hung): one voice per rank."""
        try:
            who = claim(cfg, cfg.rank, "self")
        except Exception as e:  # noqa: BLE001 - the store is gone: nobody can agree anyway
            log.warning("rank %d: the side store is unreachable: %s", cfg.rank, e)
            return False
        if who != "self":
            log.warning(
                "rank %d: its peer (%s) already speaks for it with its replica; not written here",
                cfg.rank,
                who,
            )
            return False
        return True

    def _agree(
        self, cfg: DistConfig, jobs: list[SaveJob], newest: int | None
    ) -> tuple[SaveJob | None, int | None]:
        """Several ranks: every worker (or the stand-in holding a gone rank's replica) says
        what it holds; the newest step all ranks hold is written (its attempt the highest any
        rank had, so that every rank joins the same group), or nothing. Also returns the
        newest step on disk as any rank read it."""
        mine = [(j.step, j.attempt) for j in jobs]
        try:
            with _dist.job_group(cfg, "memory-held") as pg:
                results = _dist.all_gather(pg, (mine, newest, self.stand_in), cfg.world_size)
        except Exception as e:  # noqa: BLE001 - a peer that never came: write nothing
            log.warning(
                "the ranks could not agree on a memory checkpoint to write (a rank whose node "
                "is gone with no replica of it elsewhere never comes): %s",
                e,
            )
            return None, newest
        own = {r: [s for s, _ in h] for r, (h, _, rep) in enumerate(results) if not rep}
        replicas = {r: [s for s, _ in h] for r, (h, _, rep) in enumerate(results) if rep}
        step = which_step_to_persist(own, replicas, cfg.world_size)
        newest = max((n for _, n, _ in results if n is not None), default=None)
        if step is None:
            log.warning(
                "the trainer is gone; no memory step is held by every rank (%s): none written",
                "; ".join(
                    f"rank {r}{' (replica)' if rep else ''}: {[s for s, _ in h]}"
                    for r, (h, _, rep) in enumerate(results)
                ),
            )
            return None, newest
        job = next(j for j in jobs if j.step == step)
        job.attempt = max(a for held, _, _ in results for s, a in held if s == step)
        return job, newest

    def recovery_over(self) -> None:
        """Whoever spoke for rank 0 at the recovery removes the shared root's FileStore once
        its own part is done: every other rank took its part in the same exchange (and
        commit) by then, and nobody reads the store after it."""
        cfg = self.worker.config.dist
        if cfg is None or cfg.recovery_store is None or cfg.rank != 0 or not self.agreed:
            return
        with contextlib.suppress(OSError):  # else a leftover the next start removes
            LocalStore(self.worker.root).discard(Path(cfg.recovery_store))

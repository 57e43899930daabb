"""The saves in flight: their handles, the staging slots they hold, and how each one ends.

``JobTable`` is the one place a save handed to the worker is completed: committed (the
worker's ``Committed``), failed (``Failed``, a dead or hung worker), or committed all the same
when its worker died after the rename (the trainer writes the tracker: ``_finish_commit``). It
holds the condition variable that ``drain`` and back-pressure wait on. The supervisor reaches
it only through ``supervisor.JobEvents``; the saver through its public methods. Who holds each
staging slot, job ids and attempts are its ``SlotLedger`` part: the memory tier asks it to change
them (memory/tier.py: ``TierJobs``), never writes them. ``SaveHandle`` lives below the stagers
(staging/stager.py) and is the same class here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncckpt.core import layout as _layout
from asyncckpt.core import messages as M
from asyncckpt.core import progress as _progress
from asyncckpt.errors import CheckpointError, ExportFailed, SaveFailed, WorkerDied
from asyncckpt.staging.stager import SaveHandle
from asyncckpt.stats import SaveStats
from asyncckpt.storage import UploadFailed
from asyncckpt.storage.commit import finish_commit
from asyncckpt.storage.manifest import read_manifest
from asyncckpt.storage.prune import report_warnings
from asyncckpt.worker.export import export_dir

log = logging.getLogger("asyncckpt")

#: Not a job: a slot reserved by a save that is staging into it.
RESERVED = -1


@dataclass
class _InFlight:
    handle: SaveHandle
    slot: int
    sent_at: float
    begun_at: float | None = None
    released: bool = False
    attempt: int = 0  # SaveJob.attempt: with the run's token, names a multi-rank commit
    why: SaveFailed | None = None  # the trainer's reason the worker will fail it (explain)


def _log_failure(err: SaveFailed) -> None:
    """A failed save, as it happens, at INFO: the user receives it as an exception (its
    handle, the next save, ``wait()``, leaving the engine), so by default it is not printed
    twice; a failure that can no longer be raised is logged as an error (``log_unraised``)."""
    log.info("%s", " ".join(str(err).split()))  # one line per failure


def log_unraised(err: SaveFailed, why: str) -> None:
    """A failed save nobody saw, when raising it is not possible (``why``)."""
    log.error("%s (%s)", " ".join(str(err).split()), why)
    for note in getattr(err, "__notes__", ()):
        log.error("%s", note)


def _rebuild_error(info: dict[str, Any]) -> BaseException:
    if info.get("errno") is not None:
        # str() of the worker's OSError already starts with "[Errno N] ": said once.
        message = str(info["message"]).removeprefix(f"[Errno {info['errno']}] ")
        err: BaseException = OSError(info["errno"], message)
    else:
        err = RuntimeError(f"{info['type']}: {info['message']}")
    # Kept, not printed: as a note it filled the user's stderr with the worker's frames
    # (s3fs, DCP) whenever the error went uncaught. _fail logs it at debug level.
    err.worker_traceback = info.get("traceback", "")  # type: ignore[attr-defined]
    err.__notes__ = [
        "the worker's traceback: this exception's .worker_traceback, and the 'asyncckpt' "
        "logger at DEBUG"
    ]
    return err


@dataclass(frozen=True)
class CommitContext:
    """What finishing or judging a commit needs to know of the engine (fixed at start)."""

    root: Path
    layout: str
    rank: int
    run_id: str
    export: Any  # export.HFExport | None
    remote: Any  # storage.RemoteTier | None
    on_commit: Callable[[SaveStats], None] | None
    keep_resumed: str  # options.Retention.keep_resumed


#: What the worker reports of a committed save beside bytes/committed_at/path, copied into its
#: SaveStats, with the value when a worker did not report it (another format, no remote).
_WORKER_FIGURES: dict[str, Any] = {
    "write_seconds": 0.0,
    "commit_seconds": 0.0,
    "paused_seconds": 0.0,
    "upload_seconds": 0.0,
    "uploaded_bytes": 0,
    "remote_path": None,
    "export_seconds": 0.0,
    "export_path": None,
    "records_fallbacks": 0,
    "bytes_skipped": 0,
    "bytes_written": 0,
    "files_linked": 0,
    "fingerprint_seconds": 0.0,
    "link_fallbacks": 0,
    "fingerprint_reused_bytes": 0,
    "throttled_seconds": 0.0,
    "io_threads": 0,
    "escalated_after_seconds": None,
    "escalations": (),
}


class SlotLedger:
    """Who holds each staging slot, and the job ids and attempts handed out: the job table's
    own part that the memory tier (memory/tier.py) and the disk slots ask it to change (they
    never write it themselves). Every method takes ``cond`` itself (a re-entrant lock)."""

    def __init__(self, n_slots: int) -> None:
        self.cond = threading.Condition()
        self.slot_owner: dict[int, int | None] = {i: None for i in range(n_slots)}
        self.memory_slots: set[int] = set()  # the memory tier's (memory/tier.py hands them out)
        self.next_job = 0
        self.attempts: dict[int, int] = {}  # step -> SaveJob.attempt of its next save

    def unreserve(self, slot: int) -> None:
        with self.cond:
            if self.slot_owner[slot] == RESERVED:
                self.slot_owner[slot] = None
                self.cond.notify_all()

    def free_slots(self) -> list[int]:
        """The free slots of disk saves."""
        with self.cond:
            return self._free_disk_slots_locked()

    # ------------------------------------------------------------------ the memory tier's
    def add_memory_slot(self, slot: int) -> None:
        """Slot ``slot`` is the memory tier's from now on, free."""
        with self.cond:
            self.slot_owner[slot] = None
            self.memory_slots.add(slot)

    def owner(self, slot: int) -> int | None:
        """The job that holds ``slot`` (``RESERVED``: a save staging into it), or None: free."""
        with self.cond:
            return self.slot_owner[slot]

    def reserve(self, slot: int) -> None:
        """``slot`` is a save's to stage into (``unreserve`` gives it back)."""
        with self.cond:
            self.slot_owner[slot] = RESERVED

    def own(self, slot: int, job_id: int) -> None:
        """``slot`` is held by job ``job_id`` until its ``Released`` (or ``disown``)."""
        with self.cond:
            self.slot_owner[slot] = job_id

    def disown(self, slot: int, job_id: int | None = None) -> None:
        """``slot`` is free again, if job ``job_id`` holds it (None: whoever does)."""
        with self.cond:
            if job_id is None or self.slot_owner[slot] == job_id:
                self.slot_owner[slot] = None

    def new_job_id(self) -> int:
        """A job id never used by this engine (a memory job: no entry in flight)."""
        with self.cond:
            self.next_job += 1
            return self.next_job

    def next_attempt(self, step: int) -> int:
        """The ``SaveJob.attempt`` of a new job of ``step`` (counted: the next is one more)."""
        with self.cond:
            attempt = self.attempts.get(step, 0)
            self.attempts[step] = attempt + 1
            return attempt

    def _free_disk_slots_locked(self) -> list[int]:
        return [i for i, o in self.slot_owner.items() if o is None and i not in self.memory_slots]


class JobTable(SlotLedger):
    """Saves handed to the worker (job id -> ``_InFlight``) and the slots they hold.

    Every method takes ``cond`` itself; those named ``_..._locked`` expect it held.
    ``dist_token``: the run's shared token once a multi-rank engine started (a commit by rank 0's
    worker names it), else None. ``resumed_from``: the step a load restored, protected from
    pruning until a newer one commits (``keep_resumed="until_newer"``).
    """

    def __init__(self, n_slots: int, ctx: CommitContext) -> None:
        super().__init__(n_slots)
        self.ctx = ctx
        # Memory jobs whose replica the worker is sending (replication.py): job id -> handle.
        self.replicating: dict[int, SaveHandle] = {}
        self.inflight: dict[int, _InFlight] = {}
        # Failures in the order they happened; a caller sees one on its handle, or it is
        # raised by the next save, wait() or leaving the engine (take_pending_error).
        self.failures: list[tuple[SaveFailed, SaveHandle]] = []
        self.resumed_from: int | None = None
        self.dist_token: str | None = None
        self.last_prune: Any = None  # prune.PruneResult of the worker's last prune
        self._prune_warned: set[str] = set()  # keys of the prune warnings already shown

    # ------------------------------------------------------------------ slots
    def acquire_slot(self, prefer: Callable[[int], bool], block: bool = True) -> int | None:
        """A free staging slot, preferring one for which ``prefer(slot)`` (laid out already)."""
        with self.cond:
            while True:
                free = self._free_disk_slots_locked()
                if free:
                    same = [i for i in free if prefer(i)]
                    slot = (same or free)[0]
                    self.slot_owner[slot] = RESERVED
                    return slot
                if not block or self.failures:
                    return None
                self.cond.wait(0.5)

    def track(self, job: Any, slot: int) -> SaveHandle:
        """A job sent outside ``save`` (the memory tier writing the checkpoint it holds): in
        flight like any save, its slot the write's until released. Called with cond held."""
        handle = SaveHandle(job.step, SaveStats(job.step, saved_at=job.saved_at))
        handle._staged.set()
        self.slot_owner[slot] = job.job_id
        self.inflight[job.job_id] = _InFlight(handle, slot, time.monotonic(), attempt=job.attempt)
        return handle

    # ------------------------------------------------------------------ the table
    def add(
        self, step: int, handle: SaveHandle, slot: int, owns_slot: bool = True
    ) -> tuple[int, int]:
        """Enter a save about to be handed over; returns (job id, attempt of this step).
        ``owns_slot=False``: a disk save written from a memory slot, which the memory job
        holding it owns (memory/tier.py): its end leaves the slot alone."""
        with self.cond:
            job_id = self.new_job_id()
            attempt = self.next_attempt(step)
            if owns_slot:
                self.slot_owner[slot] = job_id
            self.inflight[job_id] = _InFlight(
                handle, slot, time.monotonic(), released=not owns_slot, attempt=attempt
            )
            return job_id, attempt

    def in_flight(self, job_id: int) -> bool:
        with self.cond:
            return job_id in self.inflight

    def __len__(self) -> int:
        return len(self.inflight)

    def steps(self) -> list[int]:
        with self.cond:
            return [j.handle.step for j in self.inflight.values()]

    @property
    def pending_error(self) -> SaveFailed | None:
        """The first failure no caller has seen yet (None: none), without taking it."""
        with self.cond:
            unseen = [err for err, handle in self.failures if not handle._observed]
        return unseen[0] if unseen else None

    def take_pending_error(self) -> SaveFailed | None:
        """The first failure no caller saw on its handle, once (every failure recorded so
        far is taken). Later unseen ones are named in a note on it: none is dropped silently."""
        with self.cond:
            failures, self.failures = self.failures, []
        unseen = [(err, handle) for err, handle in failures if not handle._observed]
        if not unseen:
            return None
        first = unseen[0][0]
        for err, handle in unseen[1:]:
            first.add_note(f"a later save failed too: step {handle.step}: {err}")
            handle._observed = True
        unseen[0][1]._observed = True
        return first

    def step_committed(self, step: int) -> None:
        """A newer checkpoint ends the protection of the resumed-from one (``until_newer``)."""
        if (
            self.resumed_from is not None
            and step > self.resumed_from
            and self.ctx.keep_resumed == "until_newer"
        ):
            self.resumed_from = None

    # ------------------------------------------------------------------ waiting
    def drain(
        self, watching: Callable[[], bool], timeout: float | None = None, progress: bool = False
    ) -> None:
        """Block until nothing is in flight. ``watching()``: someone still reads the worker's
        events; if not, what is in flight can never complete and is failed instead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        began, bar = time.monotonic(), None
        with self.cond, contextlib.ExitStack() as bars:
            while self.inflight:
                if progress and bar is None:
                    if time.monotonic() - began >= _progress.DRAIN_BAR_AFTER_S:
                        jobs = {
                            i: (j.handle.step, j.handle.stats.staged_bytes)
                            for i, j in self.inflight.items()
                        }
                        bar = _progress.DrainProgress(self.ctx.root, jobs)
                        bars.callback(bar.close)
                if bar is not None:
                    bar.in_flight(set(self.inflight))
                if not watching():
                    for job_id in list(self.inflight):
                        self._fail_locked(
                            job_id,
                            WorkerDied("the engine stopped watching its worker; not committed"),
                        )
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("saves still in flight")
                wait = 0.5 if left is None else min(0.5, left)
                if progress and bar is None:
                    wait = min(wait, max(0.01, _progress.DRAIN_BAR_AFTER_S))
                self.cond.wait(wait)

    # ------------------------------------------------------------------ supervisor.JobEvents
    def on_event(self, msg: Any) -> None:
        """A job's event from the worker (on the supervisor's reader thread)."""
        committed = False
        with self.cond:
            job_id = getattr(msg, "job_id", None)
            job = self.inflight.get(job_id) if job_id is not None else None
            if isinstance(msg, M.Begun) and job:
                job.begun_at = time.monotonic()
            elif isinstance(msg, M.Released) and job:
                self._release_locked(job)
            elif isinstance(msg, M.Released) and job_id is not None:
                # A memory save's slot the worker let go of (memory/tier.py).
                for i in self.memory_slots:
                    if self.slot_owner[i] == job_id:
                        self.slot_owner[i] = None
                        self.cond.notify_all()
            elif isinstance(msg, (M.Mapped, M.Dropped, M.Protected)):
                self.cond.notify_all()  # the supervisor updated its link (Saver.wait_mapped)
            elif isinstance(msg, M.Replicated):
                waiting = self.replicating.pop(msg.job_id, None)
                if waiting is not None:
                    waiting._replica_done(msg.error)
            elif isinstance(msg, M.Committed) and job:
                self._committed_locked(msg.job_id, job, msg.stats)
                committed = True
            elif isinstance(msg, M.Failed) and job:
                err = self._failure_locked(msg.job_id, job, msg.info)
                if err is not None:
                    self._fail_locked(msg.job_id, job.why or err)
                else:
                    committed = True
            elif isinstance(msg, M.Pruned):
                self.last_prune = msg.report
                # The worker's warnings (a policy's metric missing, ...): once each, here.
                report_warnings(msg.report, self._prune_warned, stacklevel=1)
                if msg.error is not None:
                    log.warning(
                        "pruning failed (nothing committed was lost): %s", msg.error["message"]
                    )
                    log.debug("the worker's traceback:\n%s", msg.error.get("traceback", ""))
        if committed and job:
            self._report(job.handle.stats)
            job.handle._finish()

    def settle_dead_worker(self, pid: int | None, how: str, reason: SaveFailed | None) -> None:
        """End every job the dead worker held: committed if it renamed it into place (the
        tracker is written here), else failed with ``reason`` or a ``WorkerDied``."""
        finished = []
        with self.cond:
            for handle in self.replicating.values():
                handle._replica_done(f"the worker sending it died with {how}")
            self.replicating.clear()
            for job_id, job in list(self.inflight.items()):
                # Died after the rename (before the tracker): committed; the handle says so.
                manifest = self._committed_on_disk(job_id, job)
                if manifest is not None:
                    cause = reason or WorkerDied(f"worker (pid {pid}) died with {how}")
                    err = self._finish_commit_locked(job_id, job, manifest, cause)
                    if err is None:
                        finished.append(job)
                        continue
                else:
                    err = reason or WorkerDied(
                        f"the checkpoint worker (pid {pid}) died with {how} while writing "
                        f"step {job.handle.step}; nothing was committed for it"
                    )
                self.fail(job_id, err)
        for job in finished:
            self._report(job.handle.stats)
            job.handle._finish()

    def fail_all(self, err: SaveFailed) -> None:
        with self.cond:
            for job_id in list(self.inflight):
                self.fail(job_id, err)

    def overdue(self, limit: float, last_event_at: float, ready: bool) -> str | None:
        """Why the worker counts as hung after ``limit`` s (``write_timeout``), or None."""
        now = time.monotonic()
        with self.cond:
            late = [j for j in self.inflight.values() if j.begun_at and now - j.begun_at > limit]
            if late:
                return f"writing step {late[0].handle.step} took longer than"
            queued = [j for j in self.inflight.values() if j.begun_at is None]
            if queued and len(queued) == len(self.inflight) and ready:
                # Nothing is being written, yet a save waits: the worker is stuck elsewhere
                # (e.g. pruning after the last commit) if it has been silent for the limit.
                # (Not while a new worker starts: its "ready" is the first sign of life.)
                oldest = min(queued, key=lambda j: j.sent_at)
                if now - max(oldest.sent_at, last_event_at) > limit:
                    return (
                        f"step {oldest.handle.step} waited for a worker that made no progress "
                        "(hung outside a write, e.g. pruning) for longer than"
                    )
        return None

    # ------------------------------------------------------------------ failing
    def explain(self, job_id: int, err: SaveFailed) -> None:
        """The trainer knows better why the worker is about to fail job ``job_id`` (a save
        staged in chunks found torn: the keys): its handle raises ``err`` then."""
        with self.cond:
            if job_id in self.inflight:
                self.inflight[job_id].why = err

    def fail(self, job_id: int, err: SaveFailed) -> None:
        """Fail job ``job_id`` (if still in flight): its handle raises ``err``."""
        with self.cond:
            if job_id in self.inflight:
                self._fail_locked(job_id, err)

    def fail_unsent(self, handle: SaveHandle, err: SaveFailed) -> None:
        """Fail a save that was never handed to the worker (nothing was written)."""
        with self.cond:
            self.failures.append((err, handle))
            self.cond.notify_all()
        _log_failure(err)
        handle._finish(err)

    def _fail_locked(self, job_id: int, err: SaveFailed) -> None:
        job = self.inflight.pop(job_id)
        self._release_locked(job)
        self.failures.append((err, job.handle))
        self.cond.notify_all()
        _log_failure(err)
        worker_tb = getattr(err.__cause__, "worker_traceback", None)
        if worker_tb:
            log.debug("step %d: the worker's traceback:\n%s", job.handle.step, worker_tb)
        job.handle._finish(err)

    def _release_locked(self, job: _InFlight) -> None:
        if not job.released:
            job.released = True
            self.slot_owner[job.slot] = None
            self.cond.notify_all()

    def _failure_locked(
        self, job_id: int, job: _InFlight, info: dict[str, Any]
    ) -> SaveFailed | None:
        """The error a worker's ``Failed`` fails the handle with; None if the step committed
        all the same (completed here as committed)."""
        step, ctx = job.handle.step, self.ctx
        if info.get("export"):
            err: SaveFailed = ExportFailed(
                f"step {step} IS committed in {ctx.root} (it loads), but its Hugging Face "
                f"export to {ctx.export.path} failed: {info['type']}: {info['message']} "
                "(asyncckpt.worker.export.export_step writes it again from the checkpoint)"
            )
        elif info.get("upload"):
            # Committed on disk, not in the store: the save failed as the user asked for it.
            err = UploadFailed(
                f"step {step} is committed locally in {ctx.root} but was not published to "
                f"{ctx.remote.url}: {info['message']}"
                # The store's errors pass; the tier's own refusals say what to do themselves.
                + ("" if info["type"] == "UploadFailed" else " (the next save uploads it again)")
            )
        else:
            err = SaveFailed(f"save of step {step} failed: {info['type']}: {info['message']}")
        err.__cause__ = _rebuild_error(info)
        if isinstance(err, (ExportFailed, UploadFailed)):
            return err
        # Failed after its rename, and the worker could not take it out again: it is
        # committed all the same (the handle must say so; a retry would be refused).
        manifest = self._committed_on_disk(job_id, job)
        if manifest is not None:
            return self._finish_commit_locked(job_id, job, manifest, err)
        return err

    # ------------------------------------------------------------------ committing
    def _committed_locked(self, job_id: int, job: _InFlight, st: Mapping[str, Any]) -> None:
        s = job.handle.stats
        s.bytes, s.committed_at, s.path = st["bytes"], st["committed_at"], st["path"]
        for name, default in _WORKER_FIGURES.items():
            value = st.get(name, default)
            setattr(s, name, list(value) if isinstance(default, tuple) else value)
        if s.committed_at is not None and s.saved_at is not None:
            s.durable_seconds = max(0.0, s.committed_at - s.saved_at)
        self._release_locked(job)
        del self.inflight[job_id]
        self.step_committed(job.handle.step)
        self.cond.notify_all()

    def _committed_on_disk(self, job_id: int, job: _InFlight) -> dict[str, Any] | None:
        """The manifest of ``job``'s step if this very job renamed it into place, else None.

        The worker writes the manifest (with this engine's run id and the job's id) before the
        rename, so a final directory carrying both is this job's commit, complete and durable.
        Several ranks: rank 0's worker wrote it, naming the run's shared token and the attempt
        (every rank counts attempts of a step alike).
        """
        final = self.ctx.root / _layout.dir_name(self.ctx.layout, job.handle.step)
        if not final.is_dir():
            return None
        try:
            manifest = read_manifest(final)
        except (CheckpointError, OSError):
            return None
        if self.dist_token is not None:
            mine: tuple[Any, Any] = (self.dist_token, job.attempt)
            theirs = (manifest.get("dist_token"), manifest.get("attempt"))
        else:
            mine = (self.ctx.run_id, job_id)
            theirs = (manifest.get("run_id"), manifest.get("job_id"))
        return manifest if theirs == mine else None

    def _finish_commit_locked(
        self, job_id: int, job: _InFlight, manifest: dict[str, Any], cause: BaseException | None
    ) -> SaveFailed | None:
        """Finish a commit the worker renamed into place but left (died, or failed after it).

        Only the tracker is missing: write it from here, forward only. Returns None once the
        handle is completed as committed, or the error to fail it with, which says that the
        step IS committed (it loads, and a second save of it is refused).
        """
        ctx, step = self.ctx, job.handle.step
        final = ctx.root / _layout.dir_name(ctx.layout, step)
        try:
            if ctx.rank == 0:  # (the tracker is rank 0's to write, as in the worker)
                finish_commit(ctx.root, ctx.layout, step)  # root fsynced, then the tracker
        except OSError as e:
            err = SaveFailed(
                f"step {step} IS committed at {final} (it loads), but its worker stopped before "
                f"the tracker, and the tracker could not be updated: {e}"
            )
            err.__cause__ = cause or e
            return err
        log.warning(
            "the checkpoint worker stopped after committing step %d (%s); %s",
            step,
            cause,
            "the trainer wrote the tracker" if ctx.rank == 0 else "rank 0 writes the tracker",
        )
        export = ctx.export
        if export is not None and export.due(step) and ctx.rank == 0:
            out = export_dir(export, step)
            if not (out / _layout.MANIFEST).is_file():
                # Killed mid-export: the export did not happen, and the handle must say so.
                err = ExportFailed(
                    f"step {step} IS committed at {final} (it loads), but its worker stopped "
                    f"before its Hugging Face export to {out} was complete; the next worker "
                    "start writes it again (asyncckpt.worker.export.export_step also does)"
                )
                err.__cause__ = cause
                return err
        if ctx.remote is not None:
            err = UploadFailed(
                f"step {step} IS committed locally at {final} (it loads), but its worker stopped "
                f"before it was published to {ctx.remote.url}; the next save uploads it"
            )
            err.__cause__ = cause
            return err
        self._committed_locked(
            job_id,
            job,
            {
                "bytes": manifest.get("bytes", 0),
                "committed_at": manifest.get("committed_at"),
                "path": str(final),
            },
        )
        return None

    def _report(self, stats: SaveStats) -> None:
        # On the reader thread (see CheckpointEngine's docstring on on_commit).
        log.info(
            "step %d committed: blocked %.3fs (stage %.3fs, wait %.3fs), write %.2fs, %.1f MB/s",
            stats.step,
            stats.blocked_seconds,
            stats.stage_seconds,
            stats.wait_seconds,
            stats.write_seconds,
            stats.throughput_bytes_per_s / 1e6,
        )
        if self.ctx.on_commit is not None:
            try:
                self.ctx.on_commit(stats)
            except Exception:  # a dashboard bug must not break checkpointing
                log.exception("on_commit callback raised")

"""The front door: ``save`` / ``wait`` / ``load``, the worker's lifecycle, back-pressure.

``_Core`` is the engine proper: synchronous and thread-safe, so that the async
``CheckpointEngine`` (anyio: asyncio and trio) and the blocking ``SyncCheckpointEngine`` are thin
facades over one implementation. Here: saving (validation, staging slots and back-pressure,
the hand-off to the worker, the table of saves in flight and their handles). Beside it:
``supervisor.py`` (the worker's lifecycle: a reader thread owns its event pipe, notices a dead
or hung worker, settles what it held and starts a new one), ``restore.py`` (loading) and
``preemption.py`` (SIGTERM).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import torch.multiprocessing as tmp

from . import faults, memory_tier
from . import layout as _layout
from . import messages as M
from .errors import (
    CheckpointError,
    ExportFailed,
    SaveFailed,
    StateModifiedWhileStaging,
    WorkerDied,
)
from .flatplan import FlattenCache
from .formats import check_format, default_format
from .formats.components import COMPONENTS, Component, check_spec
from .loadcheck import LoadReport
from .manifest import fsync_dir, read_manifest
from .preemption import Preemption
from .restore import Restorer
from .restore import check_step as _check_step
from .retention import CheckpointInfo, RetentionPolicy, SaveSchedule
from .staging import StagingSlot, layout_key, modified_since, ready_events, versions
from .stats import SaveStats
from .storage import RemoteTier, UploadFailed
from .supervisor import WorkerLink, WorkerSupervision
from .throttle import ThrottleConfig, WritePause, check_durable_within, resolve
from .worker import PruneRequest, SaveJob

if TYPE_CHECKING:
    from .export import HFExport

log = logging.getLogger("asyncckpt")


class SaveHandle:
    """What ``save`` returns: completes when the checkpoint has committed (or failed).

    ``staged()`` / ``staged_sync()`` wait until the state has been copied (at once for a
    blocking save; an overlapped one, ``save(..., overlap=True)``, copies in the background):
    from then on the state may be mutated.
    """

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self._done = threading.Event()
        self._staged = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

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

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._staged.set()  # (a save that failed while staging touches the state no more)
        self._done.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "committed")
        return f"<SaveHandle step={self.step} {state}>"


@dataclass
class _InFlight:
    handle: SaveHandle
    slot: int
    sent_at: float
    begun_at: float | None = None
    released: bool = False
    attempt: int = 0  # SaveJob.attempt: with the run's token, names a multi-rank commit


def _rebuild_error(info: dict[str, Any]) -> BaseException:
    if info.get("errno") is not None:
        err: BaseException = OSError(info["errno"], info["message"])
    else:
        err = RuntimeError(f"{info['type']}: {info['message']}")
    # Kept, not printed: as a note it filled the user's stderr with the worker's frames
    # (s3fs, DCP) whenever the error went uncaught. _fail logs it at debug level.
    err.worker_traceback = info.get("traceback", "")  # type: ignore[attr-defined]
    err.__notes__ = [  # type: ignore[attr-defined]
        "the worker's traceback: this exception's .worker_traceback, and the 'asyncckpt' "
        "logger at DEBUG"
    ]
    return err


#: How long the checkpoint a run resumed from is protected from pruning (``keep_resumed=``).
KEEP_RESUMED = ("until_newer", "run")


@dataclass
class EngineOptions:
    layout: str = "global_step"
    format: str | None = None
    keep: RetentionPolicy | None = None
    max_in_flight: int = 1
    optimizer_offload: bool = False
    throttle: ThrottleConfig | None = None
    write_timeout: float | None = None
    on_commit: Callable[[SaveStats], None] | None = None
    verify_on_load: bool = True
    prune_scope: str = "all"
    handle_sigterm: bool = True
    preemption_save: bool = False
    save_every_steps: int | None = None
    save_every_seconds: float | None = None
    rank: int | None = None  # None: torch.distributed's rank if initialised, else 0
    world_size: int | None = None  # None: torch.distributed's world size, else 1
    local_rank: int | None = None  # None: $LOCAL_RANK, else rank
    store: tuple[str, int] | None = None  # where rank 0 hosts the side store (see dist.py)
    dist_timeout: float = 600.0  # how long workers wait for each other per save
    storage: str = "shared"  # "shared" or "local" (node-local disks): which rank(s) prune
    legacy_ranks: Any = None  # megatron_legacy: staged.LegacyRanks or a dict of its fields
    components: Mapping[str, Any] | None = None  # name -> Component or format (components.py)
    allow_older_steps: bool = False  # save a step below the newest (the tracker stays put)
    keep_resumed: str = "until_newer"  # or "run": protect the resumed-from step all run long
    remote: RemoteTier | None = None  # publish each commit to an object store (storage/)
    storage_options: Mapping[str, Any] | None = None  # fsspec options of a URL root
    spool: str | os.PathLike | None = None  # a URL root's local directory (default: temp dir)
    export: Any = None  # export.HFExport: safetensors of a component every N steps
    durable_within: float | None = None  # seconds from save() to durable (throttle.py)
    memory_every_steps: int | None = None  # due(step) says "memory" (memory_tier.py)
    persist_memory_on_close: bool = False  # close() writes the held memory checkpoint


class _Core(WorkerSupervision):
    def __init__(self, root: str | os.PathLike, opts: EngineOptions) -> None:
        self.opts = opts
        self.root, self.remote, self.local_keep = _resolve_root(root, opts)
        # A URL root: self.root is its spool, a local copy of what the store holds.
        self.spooled = isinstance(root, str) and self.remote is not None and opts.remote is None
        if opts.export is not None:
            from .export import HFExport

            if not isinstance(opts.export, HFExport):
                raise TypeError(f"export must be an HFExport, not {opts.export!r}")
            from .export import _require_safetensors

            # Here, not in the worker after the first due step has committed.
            _require_safetensors()
        self.layout = _layout.check_layout(opts.layout)
        self.components: dict[str, Component] | None = None
        if opts.components is not None:
            if opts.format is not None:
                raise ValueError(
                    "pass format= or components= (each component has its own format), not both"
                )
            self.components = check_spec(opts.components)
            self.fmt = COMPONENTS
        else:
            # Built-in or registered (formats.register_format); aliases resolved.
            self.fmt = check_format(opts.format or default_format(self.layout))
        if not isinstance(opts.max_in_flight, int) or opts.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be an int >= 1, got {opts.max_in_flight!r}")
        if opts.keep is not None and not isinstance(opts.keep, RetentionPolicy):
            raise TypeError(
                f"keep must be a retention policy (e.g. KeepLast(3)), not {opts.keep!r}"
            )
        if opts.write_timeout is not None and opts.write_timeout <= 0:
            raise ValueError("write_timeout must be > 0 seconds")
        if opts.keep_resumed not in KEEP_RESUMED:
            raise ValueError(
                f"keep_resumed must be one of {KEEP_RESUMED}, got {opts.keep_resumed!r}"
            )
        _check_picklable(keep=self.local_keep, remote=self.remote, export=opts.export)
        self.throttle = resolve(opts.optimizer_offload, opts.throttle)
        if opts.durable_within is not None:
            check_durable_within(opts.durable_within)
            self.throttle = dataclasses.replace(self.throttle, durable_within=opts.durable_within)
        # The trainer's "hold the writes" hint; outlives worker restarts (handed to each one).
        self.write_pause = WritePause(tmp.get_context("spawn"))
        from . import dist as _dist
        from .formats import staged
        from .retention import should_prune

        self.rank, self.world_size, self.local_rank = _dist.detect(
            opts.rank, opts.world_size, opts.local_rank
        )
        opts.rank = self.rank
        self.prunes_here = should_prune(self.rank, self.local_rank, opts.storage)
        self.legacy = staged.legacy_ranks(self.rank, self.world_size, opts.legacy_ranks)
        self.restorer = Restorer(
            self.root,
            self.layout,
            self.fmt,
            self.components,
            verify_on_load=opts.verify_on_load,
            legacy=self.legacy,
            rank=self.rank,
            world_size=self.world_size,
            remote=self.remote,
            on_loaded=self._on_loaded,
            quarantine=self.prunes_here,  # one rank moves a corrupt checkpoint aside
        )
        self.rendezvous = _dist.Rendezvous()
        self.dist_cfg: Any = None  # dist.DistConfig once started, when world_size > 1
        self.attempts: dict[int, int] = {}
        self.run_id = uuid.uuid4().hex[:16]
        self.schedule = SaveSchedule(opts.save_every_steps, opts.save_every_seconds)
        self.slots = [StagingSlot(i) for i in range(opts.max_in_flight)]
        # The last state's flattening, replayed while its structure holds (flatplan.py).
        self.flatten_cache = FlattenCache()
        self.slot_owner: dict[int, int | None] = {i: None for i in range(opts.max_in_flight)}
        # The memory tier's bookkeeping; its two slots join self.slots at its first save.
        self.memory = memory_tier.MemoryTier(
            memory_tier.check_every(opts.memory_every_steps), opts.persist_memory_on_close
        )
        self.cond = threading.Condition()
        self.inflight: dict[int, _InFlight] = {}
        self.next_job = 0
        self.staging: SaveHandle | None = None  # the last overlapped save (staged or not)
        self.pending_error: SaveFailed | None = None
        self.pending_handle: SaveHandle | None = None
        self.pinned: set[int] = set()
        self.resumed_from: int | None = None
        self.last_prune: Any = None
        self.prune_warned: set[str] = set()  # keys of the prune warnings already shown
        self.started = False
        self.stopping = False
        self.proc: Any = None
        self.worker_last_pid: int | None = None  # once stop() closed the process object
        self.events_conn: Any = None
        self.worker_ready = threading.Event()
        self.worker_report: Any = None
        self.worker_start_error: str | None = None
        self.start_kills = 0  # workers killed while starting since the last one became ready
        # What the current worker holds (arenas, specs, paths); a new worker, a new link.
        self.link = WorkerLink()
        self.reader: threading.Thread | None = None
        self.lock_fd: int | None = None
        self.restarts = 0
        self.last_event_at = time.monotonic()  # the worker's last sign of life (write_timeout)
        # SIGTERM: drain, then one last save (preemption.py).
        self.preemption = Preemption(
            self.schedule,
            enabled=opts.handle_sigterm,
            final_save=opts.preemption_save,
            drain=lambda timeout: self.drain(timeout=timeout),
            stop=lambda: self.stop(drain=False),
            in_flight=lambda: len(self.inflight),
            before_drain=lambda: memory_tier.persist(self, memory_tier.PREEMPTION),
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.started:
            raise CheckpointError("engine already started")
        from .prune import clean_leftovers

        def open_and_clean() -> None:
            if self.remote is not None and self.opts.rank == 0:
                # A missing or read-only bucket: refused now, as a local root is, not at the
                # first upload after steps have committed locally.
                self.remote.open().probe()
            self._open_root()
            if self.opts.rank == 0:
                removed = clean_leftovers(self.root)
                if removed:
                    log.warning(
                        "removed leftovers of an interrupted run in %s: %s", self.root, removed
                    )
                if self.remote is not None:  # uploads cut by a crash: prefixes with no marker
                    store = self.remote.open()
                    removed = store.clean_leftovers(self.layout)
                    if removed:
                        log.warning(
                            "removed uncommitted uploads in %s: %s", self.remote.url, removed
                        )
                    if self.spooled:  # the store says what exists (remote.reconcile_spool)
                        from .storage.remote import reconcile_spool

                        reconcile_spool(self.root, self.remote, store, self.layout)

        if self.world_size > 1:
            # Rank 0 cleans, then publishes the side store's address (dist.py): the other
            # ranks touch the root only after that, so the cleanup never races them.
            self.dist_cfg = self.rendezvous.setup(
                self.rank,
                self.world_size,
                self.local_rank,
                store=self.opts.store,
                timeout=self.opts.dist_timeout,
                before_publish=open_and_clean if self.rank == 0 else None,
            )
            if self.rank != 0:
                open_and_clean()
        else:
            open_and_clean()
        self.stopping = False
        self._spawn_worker()
        self.reader = threading.Thread(
            target=self._read_events, name="asyncckpt-reader", daemon=True
        )
        self.reader.start()
        # Not waiting for the worker's Ready here: its start (a spawned interpreter importing
        # torch, seconds) overlaps the trainer's own; a save stages, then waits for it only
        # if it is not ready yet (_stage_and_send), and a failed start fails that save.
        self.started = True
        # Ours runs before multiprocessing's own exit hook, which would join the worker (it
        # ignores SIGTERM and waits on its pipe) forever if the engine was never closed.
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        if self.started:
            try:
                self.stop()  # staged saves commit first (bounded by the worker's liveness)
            except BaseException:  # noqa: BLE001 - exiting anyway
                log.exception("stopping the checkpoint engine at exit failed")

    def stop(self, *, drain: bool = True) -> None:
        """Wait for staged saves to commit (``drain``), then stop the worker."""
        if not self.started:
            return
        try:
            if drain and self.memory.persist_on_close:
                memory_tier.persist(self, memory_tier.CLOSE)
            if drain:
                self.drain(progress=True)
        finally:
            self.stopping = True
            try:
                M.send(self.link.conn, M.encode(M.Stop()))
            except OSError:
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)
            if self.proc.exitcode is not None:
                # Its sentinel pipes, else freed only when the garbage collector finds the
                # engine (a trainer opening and closing engines ran out of fds).
                self.worker_last_pid = self.proc.pid
                self.proc.close()
            if self.reader is not None:
                self.reader.join(5)
            for slot in self.slots:
                slot.release()
            self.link.conn.close()
            self.link.memory.close()
            self.events_conn.close()
            if self.lock_fd is not None:
                os.close(self.lock_fd)
                self.lock_fd = None
            self.rendezvous.close()
            self.started = False
            atexit.unregister(self._at_exit)

    def drain(self, timeout: float | None = None, *, progress: bool = False) -> None:
        """Block until nothing is in flight (committed or failed); ``progress``: a bar on a
        terminal once the wait passes ``progress.DRAIN_BAR_AFTER_S`` (``stop``: a person waits)."""
        from . import progress as _progress

        deadline = None if timeout is None else time.monotonic() + timeout
        # An overlapped save still copying is not in flight yet: it will be.
        staging = self.staging
        if staging is not None and not staging._staged.wait(timeout):
            raise TimeoutError("an overlapped save is still staging")
        began, bar = time.monotonic(), None
        with self.cond, contextlib.ExitStack() as bars:
            while self.inflight:
                if progress and bar is None:
                    if time.monotonic() - began >= _progress.DRAIN_BAR_AFTER_S:
                        jobs = {
                            i: (j.handle.step, j.handle.stats.staged_bytes)
                            for i, j in self.inflight.items()
                        }
                        bar = _progress.DrainProgress(self.root, jobs)
                        bars.callback(bar.close)
                if bar is not None:
                    bar.in_flight(set(self.inflight))
                reader = self.reader
                if reader is None or not reader.is_alive():
                    # Nobody is left to complete them (the reader thread owns the worker's
                    # events): fail them rather than wait forever.
                    for job_id in list(self.inflight):
                        self._fail(
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

    # ------------------------------------------------------------------ reader thread
    def _on_event(self, msg: Any) -> None:
        self.last_event_at = time.monotonic()
        if isinstance(msg, M.Ready):
            self.worker_report = msg.throttle_report
            self.start_kills = 0
            self.worker_ready.set()
            return
        if isinstance(msg, M.FaultFired):  # a fault point fired in the worker: disarm it here
            faults.consume(msg.fault_id)
            return
        if isinstance(msg, M.Mapped):
            with self.cond:
                self.link.unmapped.discard(msg.arena_id)
                self.cond.notify_all()
            return
        committed = False
        with self.cond:
            job_id = getattr(msg, "job_id", None)
            job = self.inflight.get(job_id) if job_id is not None else None
            if isinstance(msg, M.Begun) and job:
                job.begun_at = time.monotonic()
            elif isinstance(msg, M.Released) and job:
                self._release(job)
            elif isinstance(msg, M.Released) and job_id is not None:
                if self.memory.released(self.slot_owner, job_id):  # a memory slot let go
                    self.cond.notify_all()
            elif isinstance(msg, M.Committed) and job:
                self._committed(msg.job_id, job, msg.stats)
                committed = True
            elif isinstance(msg, M.Failed) and job:
                err = self._failure(msg.job_id, job, msg.info)
                if err is not None:
                    self._fail(msg.job_id, err)
                else:
                    committed = True
            elif isinstance(msg, M.Pruned):
                self.last_prune = msg.report
                # The worker's warnings (a policy's metric missing, ...): once each, here.
                from .prune import report_warnings

                report_warnings(msg.report, self.prune_warned, stacklevel=1)
                if msg.error is not None:
                    log.warning(
                        "pruning failed (nothing committed was lost): %s", msg.error["message"]
                    )
                    log.debug("the worker's traceback:\n%s", msg.error.get("traceback", ""))
        if committed and job:
            self._report(job.handle.stats)
            job.handle._finish()

    def _failure(self, job_id: int, job: _InFlight, info: dict[str, Any]) -> SaveFailed | None:
        """The error a worker's ``Failed`` fails the handle with; None if the step committed
        all the same (completed here as committed). Called with cond held."""
        step = job.handle.step
        if info.get("export"):
            err: SaveFailed = ExportFailed(
                f"step {step} IS committed in {self.root} (it loads), but its Hugging Face "
                f"export to {self.opts.export.path} failed: {info['type']}: {info['message']} "
                "(asyncckpt.export.export_step writes it again from the checkpoint)"
            )
        elif info.get("upload"):
            # Committed on disk, not in the store: the save failed as the user asked for it.
            err = UploadFailed(
                f"step {step} is committed locally in {self.root} but was not published to "
                f"{self.remote.url}: {info['message']} (the next save uploads it again)"
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
            return self._finish_commit(job_id, job, manifest, err)
        return err

    def _committed(self, job_id: int, job: _InFlight, st: Mapping[str, Any]) -> None:
        # called with self.cond held
        s = job.handle.stats
        s.write_seconds = st.get("write_seconds", 0.0)
        s.commit_seconds = st.get("commit_seconds", 0.0)
        s.paused_seconds = st.get("paused_seconds", 0.0)
        s.bytes, s.committed_at, s.path = st["bytes"], st["committed_at"], st["path"]
        s.upload_seconds = st.get("upload_seconds", 0.0)
        s.uploaded_bytes = st.get("uploaded_bytes", 0)
        s.remote_path = st.get("remote_path")
        s.export_seconds = st.get("export_seconds", 0.0)
        s.export_path = st.get("export_path")
        s.records_fallbacks = st.get("records_fallbacks", 0)
        s.throttled_seconds = st.get("throttled_seconds", 0.0)
        s.escalated_after_seconds = st.get("escalated_after_seconds")
        s.escalations = list(st.get("escalations", ()))
        if s.committed_at is not None and s.saved_at is not None:
            s.durable_seconds = max(0.0, s.committed_at - s.saved_at)
        self._release(job)
        del self.inflight[job_id]
        if (
            self.resumed_from is not None
            and job.handle.step > self.resumed_from
            and self.opts.keep_resumed == "until_newer"
        ):
            self.resumed_from = None  # a newer checkpoint now protects the run
        self.cond.notify_all()

    def _committed_on_disk(self, job_id: int, job: _InFlight) -> dict[str, Any] | None:
        """The manifest of ``job``'s step if this very job renamed it into place, else None.

        The worker writes the manifest (with this engine's run id and the job's id) before the
        rename, so a final directory carrying both is this job's commit, complete and durable.
        Several ranks: rank 0's worker wrote it, naming the run's shared token and the attempt
        (every rank counts attempts of a step alike).
        """
        final = self.root / _layout.dir_name(self.layout, job.handle.step)
        if not final.is_dir():
            return None
        try:
            manifest = read_manifest(final)
        except (CheckpointError, OSError):
            return None
        if self.dist_cfg is not None:
            mine = (self.dist_cfg.token, job.attempt)
            theirs = (manifest.get("dist_token"), manifest.get("attempt"))
        else:
            mine = (self.run_id, job_id)
            theirs = (manifest.get("run_id"), manifest.get("job_id"))
        return manifest if theirs == mine else None

    def _finish_commit(
        self, job_id: int, job: _InFlight, manifest: dict[str, Any], cause: BaseException | None
    ) -> SaveFailed | None:
        """Finish a commit the worker renamed into place but left (died, or failed after it).

        Only the tracker is missing: write it from here, forward only. Returns None once the
        handle is completed as committed, or the error to fail it with, which says that the
        step IS committed (it loads, and a second save of it is refused). Called with cond held.
        """
        from .commit import advance_tracker

        step = job.handle.step
        final = self.root / _layout.dir_name(self.layout, step)
        try:
            if self.rank == 0:  # (the tracker is rank 0's to write, as in the worker)
                fsync_dir(self.root)  # the rename is durable before the tracker names it
                advance_tracker(self.root, self.layout, step)
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
            "the trainer wrote the tracker" if self.rank == 0 else "rank 0 writes the tracker",
        )
        export = self.opts.export
        if export is not None and export.due(step) and self.rank == 0:
            from .export import export_dir

            out = export_dir(export, step)
            if not (out / _layout.MANIFEST).is_file():
                # Killed mid-export: the export did not happen, and the handle must say so.
                err = ExportFailed(
                    f"step {step} IS committed at {final} (it loads), but its worker stopped "
                    f"before its Hugging Face export to {out} was complete; the next worker "
                    "start writes it again (asyncckpt.export.export_step also does)"
                )
                err.__cause__ = cause
                return err
        if self.remote is not None:
            err = UploadFailed(
                f"step {step} IS committed locally at {final} (it loads), but its worker stopped "
                f"before it was published to {self.remote.url}; the next save uploads it"
            )
            err.__cause__ = cause
            return err
        self._committed(
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
        if self.opts.on_commit is not None:
            try:
                self.opts.on_commit(stats)
            except Exception:  # a dashboard bug must not break checkpointing
                log.exception("on_commit callback raised")

    def _release(self, job: _InFlight) -> None:
        if not job.released:
            job.released = True
            self.slot_owner[job.slot] = None
            self.cond.notify_all()

    def take_pending_error(self) -> SaveFailed | None:
        """The last failure, once, unless the caller already saw it on its handle."""
        err, self.pending_error = self.pending_error, None
        if err is not None and self.pending_handle is not None and self.pending_handle._observed:
            return None
        return err

    def _fail(self, job_id: int, err: SaveFailed) -> None:
        # called with self.cond held
        job = self.inflight.pop(job_id)
        self._release(job)
        self.pending_error = err
        self.pending_handle = job.handle
        self.cond.notify_all()
        log.error("%s", " ".join(str(err).split()))  # one line per failure
        worker_tb = getattr(err.__cause__, "worker_traceback", None)
        if worker_tb:
            log.debug("step %d: the worker's traceback:\n%s", job.handle.step, worker_tb)
        job.handle._finish(err)

    # ------------------------------------------------------------------ save
    def check_can_save(self, step: Any) -> int:
        step = _check_step(step)
        if not self.started:
            raise CheckpointError(
                "the engine is not started: use `async with engine:` / `with engine:`"
            )
        err = self.take_pending_error()
        if err is not None:
            raise SaveFailed(f"an earlier save failed: {err}") from err.__cause__
        final = self.root / _layout.dir_name(self.layout, step)
        if final.exists() or any(j.handle.step == step for j in self.inflight.values()):
            raise CheckpointError(f"step {step} is already committed or in flight at {final}")
        if not self.opts.allow_older_steps:
            self._check_forward(step)
        return step

    def _check_forward(self, step: int) -> None:
        """Refuse a step below the newest committed or in-flight one (the tracker would lag).

        A step this engine found corrupt does not count (it is quarantined, or another rank
        does that). One without asyncckpt's manifest (plain DCP, Megatron: loadable, so it
        counts) is named as such in the refusal: often it is no checkpoint of this run at all.
        """
        known_corrupt = self.restorer.known_corrupt
        dirs = [d for d in self.restorer.committed() if d.step not in known_corrupt]
        newest = dirs[-1].step if dirs else None
        if dirs and step < dirs[-1].step and not (dirs[-1].path / _layout.MANIFEST).exists():
            raise CheckpointError(
                f"step {step} is older than step {newest}: {dirs[-1].path} is not an asyncckpt "
                f"checkpoint (it has no {_layout.MANIFEST}; written by another tool, or by "
                "hand) but holds DCP's .metadata, so it loads and counts as the newest step. "
                "Steps must increase (the tracker names the newest checkpoint and never moves "
                "back): move it out of the root if it is not a checkpoint of this run, or pass "
                "allow_older_steps=True to write older steps anyway"
            )
        with self.cond:
            flying = max((j.handle.step for j in self.inflight.values()), default=None)
        for other, what in ((newest, "committed"), (flying, "in flight")):
            if other is not None and step < other:
                raise CheckpointError(
                    f"step {step} is older than step {other}, {what} in {self.root}: steps must "
                    "increase (the tracker names the newest checkpoint and never moves back). "
                    "Resuming an older run? Delete the newer checkpoints, or pass "
                    "allow_older_steps=True to write it anyway (the tracker keeps naming "
                    f"step {other})"
                )

    def disk_slots(self) -> list[int]:
        """The staging slots of disk saves (the memory tier's are memory_tier's to hand out)."""
        return [i for i in self.slot_owner if i not in self.memory.slots]

    def acquire_slot(self, key: tuple, block: bool = True) -> int | None:
        """A free staging slot, preferring one already laid out for ``key``."""
        with self.cond:
            while True:
                free = [i for i in self.disk_slots() if self.slot_owner[i] is None]
                if free:
                    same = [i for i in free if self.slots[i].key == key]
                    slot = (same or free)[0]
                    self.slot_owner[slot] = -1  # reserved
                    return slot
                if not block:
                    return None
                if self.pending_error is not None:
                    return None
                self.cond.wait(0.5)

    def unreserve(self, slot: int) -> None:
        with self.cond:
            if self.slot_owner[slot] == -1:
                self.slot_owner[slot] = None
                self.cond.notify_all()

    def begin_save(
        self,
        step: Any,
        state: Any,
        metrics: Mapping[str, float] | None,
        metadata: dict[str, Any] | None = None,
    ) -> _PendingSave:
        """Validate and flatten: every error about the input is raised here, before any write."""
        from .manifest import check_metadata

        step = self.check_can_save(step)
        clean = _check_metrics(metrics)
        meta = check_metadata(metadata)
        if self.opts.export is not None and self.opts.export.due(step):
            from .export import check_source

            check_source(state, self.opts.export.component)
        flat = self.prepare_state(state)
        key = flat.key if flat.key is not None else layout_key(flat.tensors)
        stats = SaveStats(step, saved_at=time.time())
        pending = _PendingSave(
            step,
            flat,
            key,
            clean,
            stats,
            time.perf_counter(),
            SaveHandle(step, stats),
            versions(flat.tensors),
        )
        pending.metadata = meta
        return pending

    def take_slot(self, pending: _PendingSave, block: bool = True) -> bool:
        """Reserve a staging slot (back-pressure); False only if ``block`` is False and none is free."""
        slot = self.acquire_slot(pending.key, block=block)
        if slot is None:
            if not block:
                return False
            self.check_can_save(pending.step)  # raises the failure that freed nothing
        pending.slot = slot
        pending.stats.wait_seconds = time.perf_counter() - pending.started
        if pending.stats.wait_seconds > 0.001:
            log.info(
                "save of step %d waited %.3fs for a staging buffer",
                pending.step,
                pending.stats.wait_seconds,
            )
        return True

    def finish_save(self, pending: _PendingSave, overlap: bool = False) -> SaveHandle:
        """Stage into the reserved slot and hand the job to the worker.

        ``overlap``: return at once; a background thread copies (and hands the job over) while
        the training loop goes on, and the handle's ``staged`` says when the copy is done.
        """
        assert pending.slot is not None
        if overlap:
            if any(t.is_cuda for t in pending.flat.tensors.values()):
                pending.ready = ready_events(pending.flat.tensors)
            pending.stats.overlapped = True
            thread = threading.Thread(
                target=self._stage_behind, args=(pending,), name="asyncckpt-stage", daemon=True
            )
            self.staging = pending.handle
            try:
                thread.start()
            except BaseException:
                self.staging = None
                self.unreserve(pending.slot)
                raise
            self.schedule.mark_saved(pending.step)
            return pending.handle
        try:
            handle = self._stage_and_send(pending)
        except BaseException:
            self.unreserve(pending.slot)
            raise
        self.schedule.mark_saved(pending.step)
        return handle

    def _stage_behind(self, pending: _PendingSave) -> None:
        """An overlapped save's staging, on its own thread: a failure fails the handle."""
        handle = pending.handle
        try:
            self._stage_and_send(pending)
        except BaseException as e:  # noqa: BLE001 - reported on the handle, not lost
            self.unreserve(pending.slot)
            if not handle.done():
                err = SaveFailed(f"staging step {pending.step} failed: {e!r}; nothing was written")
                err.__cause__ = e
                self._fail_unsent(handle, err)
            else:
                handle._observed = False  # no caller saw it raise: the next save reports it
        finally:
            handle._staged.set()

    def staging_busy(self) -> bool:
        """True while an overlapped save is still copying."""
        h = self.staging
        return h is not None and not h._staged.is_set()

    def wait_staged(self) -> None:
        """Wait until the overlapped save under way (if any) has copied the state."""
        h = self.staging
        if h is not None:
            h._staged.wait()

    def _fail_unsent(self, handle: SaveHandle, err: SaveFailed) -> None:
        """Fail a save that was never handed to the worker (nothing was written)."""
        with self.cond:
            self.pending_error = err
            self.pending_handle = handle
            self.cond.notify_all()
        log.error("%s", err)
        handle._finish(err)

    def resume(
        self, state: Any, mode: str, path: str | os.PathLike | None, strict: bool = True
    ) -> int | None:
        """SkyRL's resume modes: "latest", "from_path" (needs ``path``) or "none"."""
        if mode == "none":
            return None
        if mode == "latest":
            return self.restorer.load_latest(state, strict)
        if mode == "from_path":
            if path is None:
                raise ValueError('resume mode "from_path" needs path=')
            return self.restorer.load(state, path=path, strict=strict)
        raise ValueError(f'resume mode must be "latest", "from_path" or "none", not {mode!r}')

    def _stage_and_send(self, pending: _PendingSave) -> SaveHandle:
        step, flat, stats, slot_idx = pending.step, pending.flat, pending.stats, pending.slot
        objects, metrics = flat.objects, pending.metrics
        slot = self.slots[slot_idx]
        pin = any(t.is_cuda for t in flat.tensors.values())
        t0 = time.perf_counter()
        allocated = slot.ensure(flat.tensors, pin, pending.key)
        t1 = time.perf_counter()
        if allocated:
            stats.alloc_seconds = t1 - t0
        slot.copy_in(flat.tensors, any_cuda=pin, ready=pending.ready)
        stats.stage_seconds = time.perf_counter() - t1
        stats.staged_bytes = slot.nbytes
        handle = pending.handle
        torn = modified_since(flat.tensors, pending.versions)
        if torn:
            # Invariant 13: the arena may hold two moments of the state; never send it.
            cause = StateModifiedWhileStaging(torn)
            err = SaveFailed(
                f"save of step {step} failed: the state changed while it was staged ({cause}); "
                "nothing was written, older checkpoints are intact. Wait for the copy before "
                "mutating the state (handle.staged(), engine.stage_before_step(optimizer))"
            )
            err.__cause__ = cause
            self.unreserve(slot_idx)
            self._fail_unsent(handle, err)
            return handle
        faults.point("after_stage")
        prune = self.prune_request(step)
        with self.cond:
            self.next_job += 1
            job_id = self.next_job
            job = SaveJob(
                job_id=job_id,
                step=step,
                arena_ids=list(slot.arena_ids),
                specs=None,  # the worker has them for these arenas (_send_arenas)
                objects=objects,
                paths=flat.paths,  # or None when sent: the worker has them (see below)
                metrics=dict(metrics),
                metadata=pending.metadata,
                prune=prune,
                extra=flat.extra,
                attempt=self.attempts.get(step, 0),
                saved_at=stats.saved_at,
                # Recorded in the manifest ("stats"), for `python -m asyncckpt stats`.
                figures={
                    "stage_seconds": stats.stage_seconds,
                    "wait_seconds": stats.wait_seconds,
                    "alloc_seconds": stats.alloc_seconds,
                    "staged_bytes": stats.staged_bytes,
                },
            )
            self.attempts[step] = job.attempt + 1
            self.slot_owner[slot_idx] = job_id
            self.inflight[job_id] = _InFlight(
                handle, slot_idx, time.monotonic(), attempt=job.attempt
            )
        sending = False
        try:
            with self.preemption.handing_off():
                self._wait_ready()
                # After the wait: a fault that fired in a worker that died is disarmed by now.
                job.faults = faults.snapshot()
                # One worker's link throughout: if a new worker replaces it meanwhile, this
                # job goes to the dead one (and fails), and the new one gets everything.
                link = self.link
                # A replayed plan hands out the same paths object: the worker keeps the
                # last paths it got (20,000 of them pickled into every job add up).
                if link.paths is flat.paths:
                    job.paths = None
                payload = _encode_job(job)  # before the pipe: a pickling error cuts nothing
                sending = True
                with self._sending():
                    self._send_arenas(slot, link)
                    M.send(link.conn, payload)
                    link.paths = flat.paths
        except OSError as e:
            with self.cond:
                if job_id in self.inflight:
                    err = WorkerDied(f"could not hand step {step} to the worker: {e}")
                    self._fail(job_id, err)
        except BaseException as e:
            # Interrupted (Ctrl-C), or no worker came up. Unsent, the job must not stay in
            # flight: close() and a SIGTERM's drain would wait for it forever. (Interrupted
            # mid-send, the worker is being replaced and its death settles the job.)
            handle._observed = True  # the caller sees this very exception instead
            if not sending:
                with self.cond:
                    if job_id in self.inflight:
                        self._fail(
                            job_id,
                            SaveFailed(
                                f"step {step} was not handed to the worker ({e!r}); "
                                "nothing was written"
                            ),
                        )
            raise
        finally:
            # Only now (the job sent, or failed): a SIGTERM's drain would wait for it.
            self.preemption.run_deferred()
        self.wait_mapped(slot, link)
        handle._staged.set()  # copied and handed over: invariant 12 holds from here
        return handle

    def wait_mapped(self, slot: StagingSlot, link: WorkerLink) -> None:
        """Until the worker has received (mapped) the slot's arenas: it fetches their shared
        memory from this process, so a save must not return before (invariant 12). Once per
        slot layout; a worker that dies meanwhile fails the save its own way."""
        with self.cond:
            while set(slot.arena_ids) & link.unmapped:
                if link is not self.link or not self.started:
                    return
                self.cond.wait(0.5)

    def track(self, job: SaveJob, slot: int) -> SaveHandle:
        """A job sent outside ``save`` (the memory tier writing the checkpoint it holds): in
        flight like any save, its slot the write's until released. Called with cond held."""
        handle = SaveHandle(job.step, SaveStats(job.step, saved_at=job.saved_at))
        handle._staged.set()
        self.slot_owner[slot] = job.job_id
        self.inflight[job.job_id] = _InFlight(handle, slot, time.monotonic(), attempt=job.attempt)
        return handle

    def prune_request(self, step: int) -> PruneRequest | None:
        """What the worker prunes after committing ``step`` (None: nothing, or not this rank)."""
        if self.local_keep is None or not self.prunes_here:
            return None
        return PruneRequest(
            policy=self.local_keep,
            # The commit of a newer step ends the protection of the resumed-from one.
            resumed_from=(
                self.resumed_from
                if self.resumed_from is not None
                and (self.resumed_from >= step or self.opts.keep_resumed == "run")
                else None
            ),
            pinned=tuple(self.pinned),
            run_id=self.run_id,
            scope=self.opts.prune_scope,
        )

    @contextlib.contextmanager
    def _sending(self) -> Iterator[None]:
        """Messages to the worker: one interrupted part-way would leave half a message in the
        pipe, and the worker could never read past it. Replace the worker then."""
        try:
            yield
        except OSError:
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                self.proc.kill()
            raise

    def _send_arenas(self, slot: StagingSlot, link: WorkerLink) -> None:
        # The worker first drops the arenas of this slot's old layout (both processes must
        # let go of them for the shared memory to be freed), then maps the new ones.
        for aid in slot.take_retired():
            if aid in link.arenas:
                M.send(link.conn, M.encode(M.Drop(aid)))
                link.arenas.discard(aid)
                link.specs = {k for k in link.specs if aid not in k}
        for aid, arena in zip(slot.arena_ids, slot.arenas, strict=True):
            if aid not in link.arenas:
                with self.cond:
                    link.unmapped.add(aid)
                M.send(link.conn, M.encode(M.Arena(aid, arena)))
                link.arenas.add(aid)
        # Where each tensor sits in the arenas depends only on the layout: sent once with
        # them (20,000 specs pickled per save cost more than the copy of their tensors).
        key = tuple(slot.arena_ids)
        if key not in link.specs:
            M.send(link.conn, M.encode(M.Specs(key, slot.specs)))
            link.specs.add(key)

    def prepare(self, state: Any) -> None:
        """Allocate (and hand to the worker) every staging slot for this state's layout."""
        flat = self.prepare_state(state)
        pin = any(t.is_cuda for t in flat.tensors.values())
        with self.cond:
            free = [i for i in self.disk_slots() if self.slot_owner[i] is None]
        for i in free:
            self.slots[i].ensure(flat.tensors, pin)
            if self.started:
                try:
                    with self.preemption.handing_off():
                        self._wait_ready()
                        with self._sending():
                            self._send_arenas(self.slots[i], self.link)
                            self._send_paths(flat.paths, self.link)
                finally:
                    self.preemption.run_deferred()

    @staticmethod
    def _send_paths(paths: Any, link: WorkerLink) -> None:
        # Ahead of the first save, which then sends none (see _stage_and_send).
        if paths is not None and link.paths is not paths:
            M.send(link.conn, M.encode(M.Paths(paths)))
            link.paths = paths

    def prepare_state(self, state: Any) -> Any:
        """Split ``state`` for staging in this engine's format (formats.staged.Prepared)."""
        from .formats import components, staged

        if self.components is not None:
            return components.prepare(self.components, state, rank=self.rank, legacy=self.legacy)
        return staged.prepare(self.fmt, state, legacy=self.legacy, cache=self.flatten_cache)

    # ------------------------------------------------------------------ reading: restore.py
    def _on_loaded(self, step: int) -> None:
        self.resumed_from = step

    def install_sigterm(self) -> None:
        self.preemption.install()

    def uninstall_sigterm(self) -> None:
        self.preemption.uninstall()


def _check_picklable(**options: Any) -> None:
    """What travels to the worker process must pickle: refused here, not at the first save."""
    import pickle

    for name, value in options.items():
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            raise TypeError(
                f"{name}= must be picklable (it runs in the checkpoint worker process): "
                f"{type(e).__name__}: {e}; define it at module level, with no lambdas"
            ) from e


def _encode_job(job: SaveJob) -> bytes:
    try:
        return M.encode(M.Save(job))
    except Exception as e:  # noqa: BLE001 - pickle raises many types
        raise SaveFailed(
            f"step {job.step} cannot be sent to the checkpoint worker: part of the job cannot be "
            f"pickled ({type(e).__name__}: {e}); a retention policy or an object in the state "
            "must be picklable (no lambdas, no local classes); nothing was written"
        ) from e


def _resolve_root(
    root: str | os.PathLike, opts: EngineOptions
) -> tuple[Path, RemoteTier | None, RetentionPolicy | None]:
    """(local root, remote tier, local retention) of an engine.

    A path: that root, ``opts.remote`` as its tier (if any) and ``opts.keep`` on disk. A URL
    (``s3://bucket/run``): the store is where checkpoints live, with ``opts.keep``; they are
    written and committed first in a local spool directory, which keeps only the newest (a
    warm copy for a fast resume on the same machine).
    """
    from .paths import check_local_root, is_url
    from .retention import KeepLast

    if isinstance(root, str) and is_url(root):
        if opts.remote is not None:
            raise ValueError(
                f"{root} is already the remote tier; pass remote= only with a local root"
            )
        tier = RemoteTier(root, keep=opts.keep, storage_options=dict(opts.storage_options or {}))
        spool = Path(opts.spool) if opts.spool is not None else _default_spool(tier)
        return check_local_root(spool), tier, KeepLast(1)
    if opts.storage_options is not None or opts.spool is not None:
        raise ValueError(
            "storage_options= and spool= are for a URL root (s3://...); for a local root with "
            "an object-store copy pass remote=RemoteTier(url, storage_options=...)"
        )
    if opts.remote is not None and not isinstance(opts.remote, RemoteTier):
        raise TypeError(f"remote must be a RemoteTier, not {opts.remote!r}")
    return check_local_root(root), opts.remote, opts.keep


def _default_spool(tier: RemoteTier) -> Path:
    """``$ASYNCCKPT_SPOOL`` (or the temp dir)/asyncckpt-spool/<scheme>/<bucket>/<path>-<key>.

    ``key`` hashes everything that identifies the store (``RemoteTier.identity``: protocol,
    endpoint, bucket, prefix): two stores with the same bucket and prefix at two endpoints (a
    staging and a production S3, two test servers) never share a spool."""
    import tempfile

    base = Path(
        os.environ.get("ASYNCCKPT_SPOOL") or Path(tempfile.gettempdir()) / "asyncckpt-spool"
    )
    scheme, rest = tier.url.split("://", 1)
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")] or ["root"]
    return base.joinpath(scheme, *parts[:-1], f"{parts[-1]}-{tier.spool_key()}")


def _check_tier(tier: Any, overlap: bool) -> str:
    tier = memory_tier.check_tier(tier)
    if tier == "memory" and overlap:
        raise ValueError("a memory save copies while save() blocks: overlap=True is for disk")
    return tier


def _check_overlap(overlap: Any) -> bool:
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, not {overlap!r}")
    return overlap


def _check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError("metrics must be a mapping of name -> number")
    clean = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise TypeError(f"metric names must be str, got {k!r}")
        if isinstance(v, (str, bytes, bytearray)):
            # float("0.5") would pass: a string is a caller's mistake (a formatted value, a
            # wrong key), not a number to convert silently.
            raise TypeError(
                f"metric {k!r} must be a number, got the string {v!r}; nothing was saved"
            )
        try:
            clean[k] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} must be a number, got {v!r}") from None
    return clean


async def _load_in_thread(fn: Callable[[], Any]) -> Any:
    """``fn`` (a load) in a worker thread; its warnings are re-emitted here, where
    ``stacklevel`` reaches the awaiting caller's line (from the thread it named anyio's code)."""
    from .restore import deferring_warnings

    caught: list[str] = []
    try:
        return await anyio.to_thread.run_sync(deferring_warnings(fn, caught))
    finally:
        for msg in caught:
            # 1: here, 2: the facade's method, 3: the user's await.
            warnings.warn(msg, stacklevel=3)


@dataclass
class _PendingSave:
    """A save between validation and hand-off: what both facades pass through ``_Core``."""

    step: int
    flat: Any
    key: tuple  # staging.layout_key of the tensors: which slot layout fits
    metrics: dict[str, float]
    stats: SaveStats
    started: float
    handle: SaveHandle
    versions: list[int]  # the tensors' version counters when save was called (torn states)
    slot: int | None = None
    ready: dict[int, Any] | None = None  # overlapped: CUDA events of the save() call's streams
    metadata: dict[str, Any] = field(default_factory=dict)  # save(metadata=...), checked


class PauseHooks:
    """Step pre/post hooks on an optimizer that open and close a ``pause_writes`` region."""

    def __init__(self, pause: WritePause, optimizer: Any) -> None:
        self._pause = pause
        self._open = False
        self._handles = [
            optimizer.register_step_pre_hook(self._enter),
            optimizer.register_step_post_hook(self._exit),
        ]

    def _enter(self, *_: Any) -> None:
        if self._open:  # the previous step raised before its post hook: close that region
            self._pause.exit()
        self._pause.enter()
        self._open = True

    def _exit(self, *_: Any) -> None:
        if self._open:
            self._open = False
            self._pause.exit()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._exit()


class CheckpointEngine:
    """Asynchronous checkpointing for a training loop (asyncio or trio, via anyio).

    >>> engine = CheckpointEngine("ckpts", layout="global_step", keep=KeepLast(3))
    >>> async with engine:
    ...     handle = await engine.save(step, {"model": model, "optim": optim})

    Formats: ``"dcp"`` (default for ``layout="global_step"``), ``"torch_dist"`` (Megatron
    dist_checkpointing; default for ``layout="megatron"``; megatron ``ShardedTensor`` /
    ``ShardedObject`` state dicts are accepted as they are) and ``"megatron_legacy"`` (alias
    ``"torch"``: Megatron-LM's per-rank ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files, with
    ``distrib_optim.pt`` for a ``"distrib_optim"`` entry; ``legacy_ranks`` gives tp/pp ranks,
    else megatron's parallel_state or one directory per rank).

    Multi-rank: under ``torch.distributed`` (or with ``rank=``/``world_size=``) every rank makes
    its own engine on the same root and calls ``save`` for the same steps. Each rank stages and
    writes only its own shards (DTensor and megatron shards: the local piece); the workers agree
    over their own gloo group and rank 0 commits once every rank's shards are durable; any
    failure fails every rank's handle and commits nothing. ``start`` is the only moment the
    ranks wait for each other on the trainer side (rank 0 publishes its side store's address
    under one key of the training group's store; no collective). ``store=(host, port)`` replaces
    that without an initialised group; ``dist_timeout`` bounds how long workers wait for each
    other per save; ``storage`` (``"shared"``, or ``"local"`` for node-local disks) picks the
    rank(s) that prune.

    Steps go forward: a save of a step lower than the newest committed or in-flight one is
    refused, since the tracker would name an older checkpoint than the newest on disk.
    ``allow_older_steps=True`` writes and commits it anyway, and the tracker keeps naming the
    newest step (it never moves backwards).

    ``on_commit(stats: SaveStats)`` is called once per committed save, before its handle
    completes, on the engine's reader thread (``asyncckpt-reader``), never on the training
    thread or the event loop: keep it quick (while it runs, no other event of the worker is
    handled: later commits wait, and so do the handles awaiting them) and thread-safe. An
    exception it raises is logged (logger ``asyncckpt``) and dropped; the save stays committed.
    ``asyncckpt.tensorboard.TensorBoardLogger(log_dir)`` is a ready one. Every manifest also
    records the figures (``python -m asyncckpt stats ROOT``).

    ``components``: a step made of parts, each in its own format at its own path inside the
    step directory, committed together (SkyRL's ``policy/``, ``critic/``, ``data.pt``,
    ``trainer_state.pt``; RLinf's ``actor/iter_NNNNNNN/`` and ``data/data.pt``): a dict of
    name -> ``Component(format, path, tracker)`` (or a format name), and the state passed to
    ``save`` is a dict of name -> that component's state. ``asyncckpt.frameworks`` has the
    specs of SkyRL and RLinf. A load may name only some components (the policy, to evaluate).

    ``durable_within``: seconds within which a save should be durable (committed) even when the
    training keeps every core busy. The worker stays throttled (gentle) for the first half of
    it, then escalates: no rate cap, no pauses, its threads back to normal priority and I/O
    class (where the OS allows). ``SaveStats`` reports ``durable_seconds``,
    ``throttled_seconds``, ``escalated_after_seconds`` and ``escalations``. A bound aimed at,
    not a guarantee: a disk slower than the state's size allows still takes its time.

    ``keep_resumed``: the checkpoint this engine loaded (resumed from) is never pruned until a
    newer one commits (``"until_newer"``, default), or for as long as this engine runs
    (``"run"``, Lightning's behaviour: the run's starting point survives ``keep=KeepLast(1)``).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        layout: str = "global_step",
        *,
        format: str | None = None,
        keep: RetentionPolicy | None = None,
        max_in_flight: int = 1,
        optimizer_offload: bool = False,
        throttle: ThrottleConfig | None = None,
        write_timeout: float | None = None,
        on_commit: Callable[[SaveStats], None] | None = None,
        verify_on_load: bool = True,
        prune_scope: str = "all",
        handle_sigterm: bool = True,
        preemption_save: bool = False,
        save_every_steps: int | None = None,
        save_every_seconds: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        local_rank: int | None = None,
        store: tuple[str, int] | None = None,
        dist_timeout: float = 600.0,
        storage: str = "shared",
        legacy_ranks: Any = None,
        allow_older_steps: bool = False,
        keep_resumed: str = "until_newer",
        components: Mapping[str, Component | str | Mapping[str, Component | str]] | None = None,
        remote: RemoteTier | None = None,
        storage_options: Mapping[str, Any] | None = None,
        spool: str | os.PathLike | None = None,
        export: HFExport | None = None,
        durable_within: float | None = None,
        memory_every_steps: int | None = None,
        persist_memory_on_close: bool = False,
    ) -> None:
        self._core = _Core(
            root,
            EngineOptions(
                layout=layout,
                format=format,
                keep=keep,
                max_in_flight=max_in_flight,
                optimizer_offload=optimizer_offload,
                throttle=throttle,
                write_timeout=write_timeout,
                on_commit=on_commit,
                verify_on_load=verify_on_load,
                prune_scope=prune_scope,
                handle_sigterm=handle_sigterm,
                preemption_save=preemption_save,
                save_every_steps=save_every_steps,
                save_every_seconds=save_every_seconds,
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                store=store,
                dist_timeout=dist_timeout,
                storage=storage,
                legacy_ranks=legacy_ranks,
                allow_older_steps=allow_older_steps,
                keep_resumed=keep_resumed,
                components=components,
                remote=remote,
                storage_options=storage_options,
                spool=spool,
                export=export,
                durable_within=durable_within,
                memory_every_steps=memory_every_steps,
                persist_memory_on_close=persist_memory_on_close,
            ),
        )

    # -------------------------------------------------------------- properties
    @property
    def preempted(self) -> bool:
        """True once SIGTERM (or ``request_preemption_save``) arrived: save once more and stop."""
        return self._core.preemption.preempted

    def request_preemption_save(self) -> None:
        """The user-set preemption flag: the next ``should_save`` answers yes."""
        self._core.preemption.request()

    def disk_usage(self) -> dict[str, int]:
        """Measured bytes of committed checkpoints and leftovers, and the disk's free space.

        Peak use while saving is (kept + in flight) checkpoints: pruning runs only after the
        new checkpoint committed.
        """
        from .prune import disk_usage

        return disk_usage(self.root, self.layout)

    @property
    def root(self) -> Path:
        return self._core.root

    @property
    def layout(self) -> str:
        return self._core.layout

    @property
    def worker_pid(self) -> int | None:
        core = self._core
        if core.proc is None:
            return None
        try:
            return core.proc.pid
        except ValueError:  # closed by stop()
            return core.worker_last_pid

    @property
    def worker_restarts(self) -> int:
        return self._core.restarts

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await anyio.to_thread.run_sync(self._core.start)
        self._core.install_sigterm()

    async def aclose(self) -> None:
        """Wait for every staged save to commit, then stop the worker."""
        self._core.uninstall_sigterm()
        await anyio.to_thread.run_sync(self._core.stop)

    async def __aenter__(self) -> CheckpointEngine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Staged data is never thrown away, also when the block raises.
        with anyio.CancelScope(shield=True):
            await self.aclose()

    def __enter__(self) -> CheckpointEngine:
        # A plain `with` would otherwise fail with a bare AttributeError (or, worse, run the
        # loop without a worker): say which engine a sync loop wants.
        raise TypeError(
            "CheckpointEngine is async: use `async with engine:`; a loop that is not async "
            "uses SyncCheckpointEngine (same arguments): `with SyncCheckpointEngine(root) as "
            "engine: engine.save(step, state)`"
        )

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:  # pragma: no cover
        pass

    # -------------------------------------------------------------- saving
    async def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
        *,
        overlap: bool = False,
        tier: str = "disk",
    ) -> SaveHandle:
        """Stage ``state`` and return once it is safe to mutate; the write goes on behind.

        ``tier="memory"``: only the copy; the worker keeps it (the newest memory save) and
        writes it only if the trainer dies, on SIGTERM, or at close with
        ``persist_memory_on_close=True`` (memory_tier.py). Its handle completes at once.

        ``metadata``: a small JSON object (<= 64 KiB) stored in the checkpoint's manifest and
        shown by ``list_checkpoints`` and ``python -m asyncckpt ls``.

        ``overlap=True``: return at once and copy in the background (a thread; on a GPU, a side
        stream) while the loop goes on; ``await handle.staged()`` (or an optimizer hooked with
        ``stage_before_step``) before the state is next mutated. A tensor modified in place
        before the copy ended fails the save (``SaveFailed``), in either mode.
        """
        core = self._core
        overlap = _check_overlap(overlap)  # before a slot is reserved
        tier = _check_tier(tier, overlap)
        if core.staging_busy():  # one copy at a time: the previous overlapped save's first
            await anyio.to_thread.run_sync(core.wait_staged)
        pending = core.begin_save(step, state, metrics, metadata)
        if tier == "memory":
            return memory_tier.save(core, pending)
        if not core.take_slot(pending, block=False):
            await anyio.to_thread.run_sync(core.take_slot, pending)
        return core.finish_save(pending, overlap=overlap)

    async def wait(self) -> None:
        """Wait until everything in flight has committed; raise if a save failed."""
        await anyio.to_thread.run_sync(self._core.drain, abandon_on_cancel=True)
        self._raise_pending()

    def _raise_pending(self) -> None:
        err = self._core.take_pending_error()
        if err is not None:
            raise err

    async def prepare(self, state: Any) -> None:
        """Allocate the staging arenas now, so the first save stalls no longer than later ones."""
        self._core.prepare(state)

    def should_save(self, step: int, *, force: bool = False) -> bool:
        """True when the schedule (every N steps / H seconds / preemption) says to save."""
        return self._core.schedule.should_save(step, force=force)

    def due(self, step: int, *, force: bool = False) -> str | None:
        """Which save is due at ``step``: ``"disk"`` when ``should_save`` says so (it is asked,
        with its effects), else ``"memory"`` every ``memory_every_steps``, else None.
        ``tier = engine.due(step); if tier: engine.save(step, state, tier=tier)``."""
        if self._core.schedule.should_save(step, force=force):
            return "disk"
        return "memory" if self._core.memory.due(step) else None

    def protect(self, step: int) -> None:
        """Never prune ``step``, whatever the retention policy."""
        self._core.pinned.add(_check_step(step))

    @contextlib.contextmanager
    def pause_writes(self) -> Iterator[None]:
        """Hold the background write while the block runs (an optimizer step on the CPU, say).

        The worker finishes the piece it is writing (at most 1 MiB) and waits until the block
        ends, but no longer than the throttle's ``max_pause_seconds`` per block, so a
        checkpoint always completes. Cheap (two counters in shared memory), nestable, usable
        from any thread, and a no-op with ``ThrottleConfig(max_pause_seconds=0)``.
        """
        pause = self._core.write_pause
        pause.enter()
        try:
            yield
        finally:
            pause.exit()

    def stage_before_step(self, optimizer: Any) -> Any:
        """Make every ``optimizer.step()`` first wait for an overlapped save's copy.

        A step pre-hook (``register_step_pre_hook``): the step, which mutates the parameters
        and the optimizer's state in place, waits until the copy is over; forward and backward
        before it overlap the copy. Returns torch's hook handle (``remove()`` takes it off).
        Other in-place writes to saved tensors (a BatchNorm's running statistics in a forward
        pass, an EMA of the weights) are not held: ``await handle.staged()``
        before them, or the save fails as torn.
        """
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(
                f"stage_before_step needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        core = self._core

        def wait_for_copy(*_: Any) -> None:
            h = core.staging
            if h is not None:
                h.staged_sync()

        return optimizer.register_step_pre_hook(wait_for_copy)

    def pause_writes_during(self, optimizer: Any) -> PauseHooks:
        """``pause_writes`` around every ``optimizer.step()``, via the optimizer's step hooks.

        For optimizer offload: ``engine.pause_writes_during(optimizer)`` once, after creating
        both. Returns a handle whose ``remove()`` takes the hooks off again.
        """
        if not (
            hasattr(optimizer, "register_step_pre_hook")
            and hasattr(optimizer, "register_step_post_hook")
        ):
            raise TypeError(
                f"pause_writes_during needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        return PauseHooks(self._core.write_pause, optimizer)

    # -------------------------------------------------------------- loading
    async def load_latest(self, state: Any, *, strict: bool = True) -> int | None:
        """Restore the newest good checkpoint into ``state`` in place; None if there is none.

        The whole target is checked against the checkpoint first: a shape or dtype that
        differs, or (``strict=True``) a tensor missing from the checkpoint or one the target
        does not declare, raises ``StateMismatch`` naming the keys, with nothing changed and
        no fallback to an older checkpoint (that is the caller's mistake, not damage). With
        ``strict=False`` the matching keys are loaded and the others skipped; what was skipped
        is logged and kept in ``last_load_report``. Empty containers in the target (a fresh
        optimizer's state) take whatever the checkpoint has under them.

        A damaged checkpoint falls back to the next older one, loudly; one pruned by another
        process while it is read is skipped quietly. A root that does not exist warns and
        returns None (a fresh job's first start); a path that is a checkpoint directory, or a
        root of the other layout, raises ``NotACheckpointRoot``.
        """
        return await _load_in_thread(lambda: self._core.restorer.load_latest(state, strict))

    async def load(
        self,
        state: Any,
        step: int | None = None,
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int:
        """Restore a given checkpoint (by step, or by directory) into ``state`` in place.

        Checked first like ``load_latest``; raises asyncckpt's errors (``StateMismatch``,
        ``CorruptCheckpoint``: all ``CheckpointError``) with torch's error as the cause.
        """
        return await _load_in_thread(
            lambda: self._core.restorer.load(state, step=step, path=path, strict=strict)
        )

    async def resume(
        self,
        state: Any,
        mode: str = "latest",
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int | None:
        """SkyRL's resume modes: "latest", "from_path" (needs ``path``) or "none"."""
        return await _load_in_thread(lambda: self._core.resume(state, mode, path, strict))

    @property
    def last_load_report(self) -> LoadReport | None:
        """What the last successful load did not restore one to one (``LoadReport``: step,
        path, ``missing``, ``unexpected`` and ``missing_objects`` keys); None before any."""
        return self._core.restorer.last_load_report

    def latest_step(self) -> int | None:
        dirs = self._core.restorer.committed()
        return dirs[-1].step if dirs else None

    def list_checkpoints(self) -> list[CheckpointInfo]:
        return self._core.restorer.list_checkpoints()

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The step of the best committed checkpoint by ``metric`` (``save(metrics=...)``):
        lowest for ``mode="min"``, highest for ``"max"``; ties go to the newer, NaN is never
        best. None before any checkpoint; ``ValueError`` if none reports ``metric``."""
        from .retention import best_step

        return best_step(self.list_checkpoints(), metric, mode)

"""Worker supervision: the root's locks, spawning the worker, its events, its death.

A mixin of the engine's core (``engine._Core``), which owns the table of saves in flight that a
dead or hung worker's jobs are settled in (``_fail``, ``_finish_commit``, ``_committed``): the
methods here start a worker and wait for it, read its events on a thread of their own, notice
when it dies or hangs (``write_timeout``), settle what it held and start a new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import multiprocessing.connection as mpc
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.multiprocessing as tmp

from . import layout as _layout
from .errors import CheckpointError, RootLocked, SaveFailed, WorkerDied, WriteTimeout
from .worker import WorkerConfig, worker_main

log = logging.getLogger("asyncckpt")

#: A worker killed by a signal while it starts is replaced, this many times in a row at most.
MAX_START_KILLS = 3

#: How long ``start`` waits for a spawned worker to import torch and report ready.
WORKER_START_TIMEOUT = 180.0


@dataclass
class WorkerLink:
    """One worker process's pipe and what was sent down it: the staging arenas it maps, the
    tensor specs of each arena set, the paths of the last job. A new worker gets a new link,
    so nothing is assumed of it that was sent to the one before."""

    conn: Any = None
    memory: Any = None  # the memory tier's pipe (memory_tier.py: Hold messages)
    memory_paths: Any = None  # the paths the last Hold carried
    arenas: set[int] = field(default_factory=set)
    unmapped: set[int] = field(default_factory=set)  # sent, and no Mapped back yet
    specs: set[tuple[int, ...]] = field(default_factory=set)
    paths: Any = None


class WorkerSupervision:
    """The worker's lifecycle, for ``engine._Core`` (which provides the job table)."""

    def _open_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create checkpoint root {self.root}: {e}") from e
        if not self.root.is_dir():
            raise CheckpointError(f"checkpoint root {self.root} is not a directory")
        probe = self.root / f"{_layout.TMP_PREFIX}probe-{uuid.uuid4().hex[:8]}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(f"checkpoint root {self.root} is not writable: {e}") from e
        lock_path = self.root / f"{_layout.LOCK_NAME}.rank{self.opts.rank}"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RootLocked(
                f"another CheckpointEngine (rank {self.opts.rank}) is using {self.root}; "
                "two engines must not write one root"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.lock_fd = fd
        # A worker orphaned by a killed trainer finishes the saves it had staged, bounded by
        # its write_timeout (default WorkerConfig.orphan_deadline_s); wait for it (it holds
        # the worker lock) before cleaning the temporaries it may still touch, and resume
        # from what it committed.
        wlock = _worker_lock_path(self.root, self.opts.rank)
        wfd = os.open(wlock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            bound = self.opts.write_timeout or WorkerConfig.orphan_deadline_s
            deadline = time.monotonic() + bound + 30
            told = False
            while True:
                try:
                    fcntl.flock(wfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RootLocked(f"a worker process still holds {wlock}") from None
                    if not told:
                        log.warning(
                            "waiting for the worker of an earlier trainer on %s: it is finishing "
                            "the saves that trainer staged (at most %.0fs)",
                            self.root,
                            bound,
                        )
                        told = True
                    time.sleep(0.05)
        finally:
            os.close(wfd)

    def _spawn_worker(self) -> None:
        ctx = tmp.get_context("spawn")
        jobs_r, jobs_w = ctx.Pipe(duplex=False)
        events_r, events_w = ctx.Pipe(duplex=False)
        memory_r, memory_w = ctx.Pipe(duplex=False)
        config = WorkerConfig(
            root=str(self.root),
            layout=self.layout,
            fmt=self.fmt,
            rank=self.opts.rank,
            run_id=self.run_id,
            throttle=self.throttle,
            parent_pid=os.getpid(),
            local_rank=self.local_rank,
            dist=self.dist_cfg,
            remote=self.remote,
            export=self.opts.export,
            orphan_deadline_s=self.opts.write_timeout or WorkerConfig.orphan_deadline_s,
            spool=self.spooled,
            store_socket=self.rendezvous.listener,
        )
        proc = ctx.Process(
            target=worker_main,
            args=(config, jobs_r, events_w, self.write_pause, memory_r),
            name=f"asyncckpt-worker-{self.opts.rank}",
            daemon=True,
        )
        self.worker_ready.clear()
        self.worker_start_error = None
        with _main_module_hidden():
            proc.start()
        jobs_r.close()
        events_w.close()
        memory_r.close()
        if self.link.memory is not None:
            self.link.memory.close()  # the dead worker's
        self.proc, self.events_conn = proc, events_r
        self.link = WorkerLink(jobs_w, memory_w)
        self.last_event_at = time.monotonic()

    def _wait_ready(self) -> None:
        if not self.worker_ready.wait(WORKER_START_TIMEOUT):
            raise CheckpointError("the checkpoint worker process did not start in time")
        if self.worker_start_error is not None:
            raise CheckpointError(self.worker_start_error)

    def _read_events(self) -> None:
        while not self.stopping:
            proc, conn = self.proc, self.events_conn
            try:
                ready = mpc.wait([conn, proc.sentinel], timeout=0.1)
            except OSError:
                ready = [proc.sentinel]
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    msg = None
                if msg is not None:
                    self._on_event(msg)
                    continue
            if (proc.sentinel in ready or conn in ready) and not self.stopping:
                proc.join(1)
                self._on_worker_death(proc, None)
                continue
            self._check_timeouts()

    def _on_worker_death(self, proc: Any, reason: SaveFailed | None) -> None:
        code = proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        was_ready = self.worker_ready.is_set()
        self.worker_ready.clear()  # saves from now on wait for the replacement
        killed = code is not None and code < 0
        if not was_ready and killed and self.start_kills < MAX_START_KILLS:
            # Killed from outside while it started (the OOM killer, a scheduler, a test): a
            # death like any other, and another worker starts; only a few in a row.
            self.start_kills += 1
        elif not was_ready:
            # Failed by itself while starting (or killed again and again): restarting would
            # only loop. Fail start/save clearly.
            self.worker_start_error = f"the checkpoint worker process failed to start ({how})"
            # Nobody serves the side store now: refuse the other ranks' workers rather than
            # leave them waiting on a socket that no process answers.
            self.rendezvous.close()
            with self.cond:  # a save staged while it started must not wait forever
                for job_id in list(self.inflight):
                    self._fail(job_id, WorkerDied(self.worker_start_error))
            self.stopping = True
            self.worker_ready.set()
            return
        # Before failing the handles: a save made as soon as one fails must wait for the new
        # worker, not write into the dead one's pipe, and must see the death counted.
        self.worker_ready.clear()
        self.restarts += 1
        finished = []
        with self.cond:
            for job_id, job in list(self.inflight.items()):
                # Died after the rename (before the tracker): committed; the handle says so.
                manifest = self._committed_on_disk(job_id, job)
                if manifest is not None:
                    cause = reason or WorkerDied(f"worker (pid {proc.pid}) died with {how}")
                    err = self._finish_commit(job_id, job, manifest, cause)
                    if err is None:
                        finished.append(job)
                        continue
                else:
                    err = reason or WorkerDied(
                        f"the checkpoint worker (pid {proc.pid}) died with {how} while writing "
                        f"step {job.handle.step}; nothing was committed for it"
                    )
                self._fail(job_id, err)
        for job in finished:
            self._report(job.handle.stats)
            job.handle._finish()
        if reason is None:
            log.error("checkpoint worker (pid %s) died with %s; starting a new one", proc.pid, how)
        self._spawn_worker()

    def _check_timeouts(self) -> None:
        limit = self.opts.write_timeout
        if limit is None:
            return
        now = time.monotonic()
        with self.cond:
            late = [j for j in self.inflight.values() if j.begun_at and now - j.begun_at > limit]
            queued = [j for j in self.inflight.values() if j.begun_at is None]
            stuck = None
            if queued and len(queued) == len(self.inflight) and self.worker_ready.is_set():
                # Nothing is being written, yet a save waits: the worker is stuck elsewhere
                # (e.g. pruning after the last commit) if it has been silent for the limit.
                # (Not while a new worker starts: its "ready" is the first sign of life.)
                oldest = min(queued, key=lambda j: j.sent_at)
                if now - max(oldest.sent_at, self.last_event_at) > limit:
                    stuck = oldest
        if late or stuck:
            proc = self.proc
            if late:
                what = f"writing step {late[0].handle.step} took longer than"
            else:
                what = (
                    f"step {stuck.handle.step} waited for a worker that made no progress "
                    "(hung outside a write, e.g. pruning) for longer than"
                )
            err = WriteTimeout(
                f"{what} write_timeout={limit}s; the worker was killed and restarted"
            )
            proc.kill()
            proc.join(5)
            self._on_worker_death(proc, err)


@contextlib.contextmanager
def _main_module_hidden() -> Any:
    # The spawn start method re-runs the trainer's main script in the child unless it is
    # guarded by `if __name__ == "__main__"`. The worker needs nothing from it (user objects
    # reach it already serialised), so hide it for the moment of the spawn.
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)


def _worker_lock_path(root: Path, rank: int) -> Path:
    return root / f"{_layout.LOCK_NAME}.worker{rank}"

"""Worker supervision: the root's locks, spawning the worker, its events, its death.

``WorkerSupervisor`` starts a worker and waits for it, reads its events on a thread of its own,
notices when it dies or hangs (``write_timeout``), has what it held settled and starts a new
one. It knows the saves in flight only through ``JobEvents`` (implemented by
``jobs.JobTable``). ``lock_root`` takes the root's locks for one rank.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection as mpc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.multiprocessing as tmp

from asyncckpt import faults
from asyncckpt.core import messages as M
from asyncckpt.errors import CheckpointError, RootLocked, SaveFailed, WorkerDied, WriteTimeout
from asyncckpt.io.throttle import AppliedThrottle
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.localfs import lock_holder, lock_path, unlock
from asyncckpt.worker.config import WorkerConfig
from asyncckpt.worker.entry import run_worker

log = logging.getLogger("asyncckpt")

#: A worker killed by a signal while it starts is replaced, this many times in a row at most.
MAX_START_KILLS = 3

#: How long ``start`` retries a rank lock held by someone else before it says the root is in
#: use: a reader probing whether a live engine holds it lets go at once (_trainer_holds).
LOCK_RETRY_S = 1.0
#: How long ``start`` waits for a spawned worker to import torch and report ready.
WORKER_START_TIMEOUT = 180.0


@dataclass
class WorkerLink:
    """One worker process's pipe and what was sent down it: the staging arenas it maps, the
    tensor specs of each arena set, the paths of the last job. A new worker gets a new link,
    so nothing is assumed of it that was sent to the one before."""

    conn: Any = None
    memory: Any = None  # the memory tier's pipe (memory/tier.py: Hold messages)
    memory_paths: Any = None  # the paths the last Hold carried
    arenas: set[int] = field(default_factory=set)
    unmapped: set[int] = field(default_factory=set)  # sent, and no Mapped back yet
    undropped: set[int] = field(default_factory=set)  # Drop sent, and no Dropped back yet
    unprotected: set[int] = field(default_factory=set)  # Protect sent, no Protected back yet
    specs: set[tuple[int, ...]] = field(default_factory=set)
    paths: Any = None


class JobEvents(Protocol):
    """What the supervisor tells the table of saves in flight (``jobs.JobTable``)."""

    def on_event(self, msg: Any) -> None:
        """A job's event from the worker (``Begun``, ``Committed``, ``Failed``, ``Pruned``...)."""

    def settle_dead_worker(self, pid: int | None, how: str, reason: SaveFailed | None) -> None:
        """The worker died (``how``; ``reason``: why it was killed): end what it held."""

    def fail_all(self, err: SaveFailed) -> None:
        """No worker will come: fail everything in flight with ``err``."""

    def overdue(self, limit: float, last_event_at: float, ready: bool) -> str | None:
        """Why the worker counts as hung after ``limit`` seconds, or None."""


class WorkerSupervisor:
    """One engine's worker process: spawn it, wait until it is ready, read its events on a
    thread of its own, notice when it dies or hangs (``write_timeout``), have the jobs it held
    settled (``JobEvents``) and start a new one. Owns the ``WorkerLink`` of the current worker.

    ``make_config()`` gives each new worker its ``WorkerConfig`` (the engine's, with what
    ``start`` learnt: the side store's address); ``on_started_failing()`` is told once a worker
    fails by itself at start (nobody will serve the other ranks' side store then);
    ``on_worker_lost(link, pid)`` once a worker that was serving died (the memory tier).
    """

    def __init__(
        self,
        jobs: JobEvents,
        make_config: Callable[[], WorkerConfig],
        write_pause: Any,
        *,
        write_timeout: float | None,
        on_start_failed: Callable[[], None],
        on_worker_lost: Callable[[WorkerLink, int | None], None] | None = None,
    ) -> None:
        self.jobs = jobs
        self.make_config = make_config
        self.write_pause = write_pause
        self.write_timeout = write_timeout
        self.on_start_failed = on_start_failed
        self.on_worker_lost = on_worker_lost  # what the memory tier held on that link is gone
        self.proc: Any = None
        self.last_pid: int | None = None  # once stop() closed the process object
        self.events_conn: Any = None
        self.ready = threading.Event()
        # Set at the first worker's Ready and never cleared: a worker of this engine took the
        # worker lock, so an earlier trainer's worker let go of it (earlier_worker.py).
        self.was_ready = threading.Event()
        self.report: AppliedThrottle | None = None  # what the worker applied (its Ready)
        self.start_error: str | None = None
        self.start_kills = 0  # workers killed while starting since the last one became ready
        # What the current worker holds (arenas, specs, paths); a new worker, a new link.
        self.link = WorkerLink()
        self.reader: threading.Thread | None = None
        self.send_lock = threading.RLock()  # (sending: whole messages, one thread at a time)
        self.stopping = False
        self.restarts = 0
        self.last_event_at = time.monotonic()  # the worker's last sign of life (write_timeout)

    @property
    def pid(self) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.pid
        except ValueError:  # closed by stop()
            return self.last_pid

    def watching(self) -> bool:
        """True while the reader thread owns the worker's events (jobs can still complete)."""
        return self.reader is not None and self.reader.is_alive()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.stopping = False
        self._spawn()
        self.reader = threading.Thread(
            target=self._read_events, name="asyncckpt-reader", daemon=True
        )
        self.reader.start()

    def stop(self) -> None:
        """Ask the worker to stop (it finishes what it holds), kill it if it will not."""
        self.stopping = True
        try:
            M.send(self.link.conn, M.encode(M.Stop()))
        except OSError:
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        # The reader first: it may be settling this worker's death, which reads the process
        # object that close() invalidates (a ValueError on the reader thread, once).
        if self.reader is not None:
            self.reader.join(5)
        if self.proc.exitcode is not None:
            # Its sentinel pipes, else freed only when the garbage collector finds the
            # engine (a trainer opening and closing engines ran out of fds).
            self.last_pid = self.proc.pid
            self.proc.close()
        self.link.conn.close()
        self.link.memory.close()
        self.events_conn.close()

    def _spawn(self) -> None:
        ctx = tmp.get_context("spawn")
        jobs_r, jobs_w = ctx.Pipe(duplex=False)
        events_r, events_w = ctx.Pipe(duplex=False)
        memory_r, memory_w = ctx.Pipe(duplex=False)
        config = self.make_config()
        proc = ctx.Process(
            target=run_worker,
            args=(config, jobs_r, events_w, self.write_pause, memory_r),
            name=f"asyncckpt-worker-{config.rank}",
            daemon=True,
        )
        self.ready.clear()
        self.start_error = None
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

    def wait_ready(self) -> None:
        if not self.ready.wait(WORKER_START_TIMEOUT):
            raise CheckpointError("the checkpoint worker process did not start in time")
        if self.start_error is not None:
            raise CheckpointError(self.start_error)

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        """Messages to the worker: one interrupted part-way would leave half a message in the
        pipe, and the worker could never read past it. Replace the worker then. One thread at
        a time: a save is sent in parts (header, body), and ``protect`` or a load's pin may
        be sent from another thread meanwhile."""
        with self.send_lock:
            try:
                yield
            except OSError:
                raise
            except BaseException:
                with contextlib.suppress(Exception):
                    self.proc.kill()
                raise

    # ------------------------------------------------------------------ reader thread
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
                self._on_death(proc, None)
                continue
            self._check_timeouts()

    def _on_event(self, msg: Any) -> None:
        self.last_event_at = time.monotonic()
        if isinstance(msg, M.Ready):
            self.report = msg.throttle_report
            self.start_kills = 0
            self.was_ready.set()
            self.ready.set()
        elif isinstance(msg, M.FaultFired):  # a fault point fired in the worker: disarm it here
            faults.consume(msg.fault_id)
        elif isinstance(msg, M.Mapped):
            self.link.unmapped.discard(msg.arena_id)
            self.jobs.on_event(msg)  # wakes a save waiting for it
        elif isinstance(msg, M.Dropped):
            self.link.undropped.discard(msg.arena_id)
            self.jobs.on_event(msg)  # wakes a save waiting for it (saving.let_worker_go)
        elif isinstance(msg, M.Protected):
            self.link.unprotected.discard(msg.step)
            self.jobs.on_event(msg)  # wakes protect() waiting for it (pins.py)
        else:
            self.jobs.on_event(msg)

    def _on_death(self, proc: Any, reason: SaveFailed | None) -> None:
        # Read once: stop() may close the process object while this runs on the reader thread.
        pid, code = proc.pid, proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        was_ready = self.ready.is_set()
        self.ready.clear()  # saves from now on wait for the replacement
        killed = code is not None and code < 0
        if not was_ready and killed and self.start_kills < MAX_START_KILLS:
            # Killed from outside while it started (the OOM killer, a scheduler, a test): a
            # death like any other, and another worker starts; only a few in a row.
            self.start_kills += 1
        elif not was_ready:
            # Failed by itself while starting (or killed again and again): restarting would
            # only loop. Fail start/save clearly.
            self.start_error = f"the checkpoint worker process failed to start ({how})"
            self.on_start_failed()
            self.jobs.fail_all(WorkerDied(self.start_error))  # a save staged meanwhile
            self.stopping = True
            self.ready.set()
            return
        # Before failing the handles: a save made as soon as one fails must wait for the new
        # worker, not write into the dead one's pipe, and must see the death counted.
        self.restarts += 1
        self.jobs.settle_dead_worker(pid, how, reason)
        if reason is None:
            log.error("checkpoint worker (pid %s) died with %s; starting a new one", pid, how)
        if self.on_worker_lost is not None:
            self.on_worker_lost(self.link, pid)  # (the dead worker's link, before a new one)
        self._spawn()

    def _check_timeouts(self) -> None:
        limit = self.write_timeout
        if limit is None:
            return
        what = self.jobs.overdue(limit, self.last_event_at, self.ready.is_set())
        if what is not None:
            proc = self.proc
            err = WriteTimeout(
                f"{what} write_timeout={limit}s; the worker was killed and restarted"
            )
            proc.kill()
            proc.join(5)
            self._on_death(proc, err)


def lock_root(
    root: Path, rank: int, write_timeout: float | None, *, wait_for_orphan: bool = True
) -> int:
    """Create and check ``root``, take this rank's lock on it (returned: close it to let go),
    and wait for a worker an earlier trainer left behind (unless ``wait_for_orphan=False``:
    the caller deals with it, earlier_worker.py)."""
    store = LocalStore(root)
    try:
        store.create_root()
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint root {root}: {e}") from e
    if not root.is_dir():
        raise CheckpointError(f"checkpoint root {root} is not a directory")
    try:
        store.check_writable()
    except OSError as e:
        raise CheckpointError(f"checkpoint root {root} is not writable: {e}") from e
    fd = store.lock(f"rank{rank}", wait=False, note_pid=True)
    deadline = time.monotonic() + LOCK_RETRY_S
    while fd is None and time.monotonic() < deadline:  # a reader's probe (_trainer_holds)
        time.sleep(0.02)
        fd = store.lock(f"rank{rank}", wait=False, note_pid=True)
    if fd is None:
        holder = lock_holder(lock_path(root, f"rank{rank}"))
        raise RootLocked(
            f"another CheckpointEngine (rank {rank}, {holder}) is using {root}; "
            "two engines must not write one root: stop that one or pick another root"
        )
    # A worker orphaned by a killed trainer finishes the saves it had staged, bounded by
    # its write_timeout (default WorkerConfig.orphan_deadline_s); wait for it (it holds
    # the worker lock) before cleaning the temporaries it may still touch, and resume
    # from what it committed.
    if not wait_for_orphan:
        return fd
    try:
        _wait_for_orphan(store, f"worker{rank}", root, write_timeout)
    except BaseException:
        unlock(fd)  # not started: the root is not ours
        raise
    return fd


def _wait_for_orphan(
    store: LocalStore, holder: str, root: Path, write_timeout: float | None
) -> None:
    bound = write_timeout or WorkerConfig.orphan_deadline_s
    deadline = time.monotonic() + bound + 30
    told = False
    while (wfd := store.lock(holder, wait=False)) is None:
        if time.monotonic() > deadline:
            path = lock_path(root, holder)
            raise RootLocked(f"a worker process ({lock_holder(path)}) still holds {path}")
        if not told:
            log.warning(
                "waiting for the worker of an earlier trainer on %s: it is finishing "
                "the saves that trainer staged (at most %.0fs)",
                root,
                bound,
            )
            told = True
        time.sleep(0.05)
    unlock(wfd)


def wait_for_worker(root: Path, rank: int) -> None:
    """Wait until the worker of an earlier trainer of ``rank`` on ``root`` is done (its lock
    is free): what it was committing is committed, or not, for good."""
    _wait_for_orphan(LocalStore(root), f"worker{rank}", root, None)


def wait_for_orphaned_workers(root: str | Path) -> None:
    """Wait until no worker process holds a lock on ``root``: a reader about to pick the
    newest checkpoint of a root it does not write. A worker orphaned by a killed trainer
    finishes the saves that trainer staged; reading before it is done resumes from an older
    step, and that run's next save then meets the orphan's newer commit."""
    store = LocalStore(Path(root))
    prefix = lock_path(root, "").name  # a holder's lock file is <prefix><holder>
    for path in sorted(Path(root).glob(prefix + "worker*")):
        holder = path.name[len(prefix) :]
        try:
            if _trainer_holds(store, "rank" + holder.removeprefix("worker")):
                continue  # a live engine's worker, not an orphan: it may run for days
            _wait_for_orphan(store, holder, Path(root), None)
        except PermissionError:  # a read-only root: no writer of ours can be finishing there
            log.debug("cannot check %s for a running worker (read-only)", path)


def _trainer_holds(store: LocalStore, holder: str) -> bool:
    """Whether a live engine holds the rank lock ``holder``. Tried by taking it and letting
    go at once (flock has no test; a pid would not say it across nodes); an engine starting
    in that instant retries (``lock_root``)."""
    fd = store.lock(holder, wait=False)
    if fd is None:
        return True
    unlock(fd)
    return False


@contextlib.contextmanager
def _main_module_hidden() -> Any:
    # The spawn start method re-runs the trainer's main script in the child unless it is
    # guarded by `if __name__ == "__main__"`. The worker needs nothing from it (user objects
    # reach it already serialised), so hide it for the moment of the spawn.
    main = sys.modules.get("__main__")
    saved: dict[str, Any] = {
        k: main.__dict__[k] for k in ("__file__", "__spec__") if main and k in main.__dict__
    }
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.pop("__spec__", None)
            main.__dict__.update(saved)

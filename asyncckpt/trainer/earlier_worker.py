"""The worker an earlier trainer of this rank left on the root, still finishing the saves that
trainer staged, when the engine's start did not wait for it.

A killed trainer's worker goes on: it commits what was staged, then holds the newest step in
memory for a new engine (hot_serve.py). Waiting for it at ``start()`` made every restart wait
for writes it did not ask for (a disk save in flight, then the memory step): seconds before
the first step. With one rank on a local root the engine starts at once instead:

* its worker takes the worker lock after the earlier one lets go, and cleans the root's
  leftovers before its first write (``WorkerConfig.clean_root``);
* a load that must read what the earlier worker commits waits for it here (``wait``); a step
  taken from that worker's memory before it was written is checked in the background
  (``HotResume.settle_later``).

Several ranks (one cleaner, a handshake over the side store) and URL roots (the store's
leftovers, the spool) still wait at the start (``supervisor.lock_root``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from asyncckpt.errors import RootLocked
from asyncckpt.storage.localfs import lock_held, lock_holder, lock_path
from asyncckpt.trainer.supervisor import wait_for_orphaned_workers, wait_for_worker

if TYPE_CHECKING:
    from asyncckpt.formats.loadcheck import LoadReport
    from asyncckpt.memory.hot_resume import HotResume

log = logging.getLogger("asyncckpt")


def holds_root(root: Path, rank: int) -> bool:
    """Whether a worker holds ``rank``'s worker lock on ``root`` (``localfs.lock_held``).
    Asked right after this engine took the rank's lock: no worker of its own runs yet, so one
    that holds it is an earlier trainer's."""
    return lock_held(lock_path(root, f"worker{rank}"))


class EarlierWorker:
    """An earlier trainer's worker still at work on ``root`` (rank ``rank``). ``own_ready``:
    set once this engine's own worker reported ready, which it does only after it took the
    worker lock, so after the earlier worker let go of it (it is never cleared)."""

    def __init__(self, root: Path, rank: int, bound_s: float, own_ready: threading.Event) -> None:
        self.root, self.rank = root, rank
        self.bound_s = bound_s  # its orphan deadline: it exits by then, whatever it does
        self.own_ready = own_ready
        self._done = threading.Event()
        self._told = False

    @property
    def done(self) -> bool:
        """True once the earlier worker is gone: what it was committing is committed, or not,
        for good (checked now, without waiting)."""
        if self._done.is_set():
            return True
        if self.own_ready.is_set() or not holds_root(self.root, self.rank):
            # (Not holding it: gone; or this engine's worker took it that instant, which it
            # does only once the earlier one let go.)
            self._done.set()
        return self._done.is_set()

    def at_work(self) -> bool:
        """Whether the earlier worker is still at work (said once in the log: a load waits
        for what it offers or commits)."""
        if self.done:
            return False
        if not self._told:
            self._told = True
            log.warning(  # (as supervisor.lock_root says it, where the start waits)
                "waiting for the worker of an earlier trainer on %s: it is finishing the "
                "saves that trainer staged (at most %.0fs), and the load takes what it "
                "offers or commits",
                self.root,
                self.bound_s,
            )
        return True

    def wait(self) -> None:
        """Block until the earlier worker is gone (``RootLocked`` past its deadline)."""
        deadline = time.monotonic() + self.bound_s + 30
        while self.at_work():
            if time.monotonic() > deadline:
                path = lock_path(self.root, f"worker{self.rank}")
                raise RootLocked(f"a worker process ({lock_holder(path)}) still holds {path}")
            time.sleep(0.02)


class OrphanWaits:
    """Where one engine's loads wait for the workers earlier trainers left (``Restorer.orphans``).
    Before the start (``started()`` false): every worker still committing on the root, and this
    rank's by its lock (supervisor.py). After a start that did not wait: this rank's
    ``earlier`` worker. After one that did: none."""

    def __init__(self, root: Path, started: Callable[[], bool]) -> None:
        self.root = root
        self.started = started
        self.earlier: EarlierWorker | None = None  # set by the start (trainer/parts.py)

    def for_worker(self, root: Path, rank: int) -> None:
        """The hot resume's wait for this rank's earlier worker (``WaitForWorker``)."""
        if self.earlier is not None:
            self.earlier.wait()  # (the lock alone: this engine's own worker takes it after)
        else:
            wait_for_worker(root, rank)

    def settle(self) -> None:
        """Before a load reads the disk: what an earlier worker commits is there."""
        if self.earlier is not None:
            self.earlier.wait()
        elif not self.started() and self.root.is_dir():
            wait_for_orphaned_workers(self.root)

    def at_work(self) -> Callable[[], bool] | None:
        """``hot_resume.ask``'s ``at_work``, where the engine knows better than the locks."""
        return None if self.earlier is None else self.earlier.at_work

    def still_writing(self) -> EarlierWorker | None:
        """The earlier worker the start did not wait for, while it is at work."""
        return self.earlier if self.earlier is not None and not self.earlier.done else None

    def taken_stands(self, hot: HotResume, layout: str, report: LoadReport) -> bool:
        """Whether a step ``hot`` took from memory before it was written stands. Where the
        start did not wait for the worker writing it: now, its commit checked in the
        background (``settle_later``); else once checked (``settle``)."""
        earlier = self.still_writing()
        if earlier is None:
            return hot.settle(layout, started=self.started())
        hot.settle_later(layout, earlier.wait)
        report.source_reason = "taken before it was written (its commit checked in the background)"
        return True

    def before_listing(self) -> None:
        """Before a look at the root that must show what the earlier worker commits (the
        engine's ``latest_step``, ``list_checkpoints``): a step loaded from its memory is
        then listed."""
        if self.earlier is not None:
            self.earlier.wait()

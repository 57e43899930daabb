"""A stand-in: the worker of a rank whose node is gone, run by the holder of that rank's
replicas as a plain child process (``python -m asyncckpt.worker.stand_in``; replication.py starts
it and hands it the replicas' shared memory by descriptor). It takes that rank's part in the
exchange at the trainers' death and writes that rank's files of the step agreed, as that
rank's worker would have.

It ends with the worker that started it (``watch_parent``), as a worker ends with its
trainer: it holds that rank's worker lock, which a new trainer of the rank waits for, and a
SIGKILLed worker left it writing for minutes. What a stand-in cut short leaves is the step's
temporary, never a commit (its part never reached the exchange; every rank's part must),
which the next start removes.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncckpt.worker.loop import SaveJob, WorkerConfig

log = logging.getLogger("asyncckpt")

#: The environment variable in which the starting worker names its pid.
PARENT_ENV = "ASYNCCKPT_STAND_IN_PARENT"
#: Seconds between two looks at whether the parent worker still lives.
PARENT_POLL_S = 0.2
#: The exit status of a stand-in whose parent worker is gone (or its deadline passed).
PARENT_GONE_EXIT = 3


class _Nowhere:
    """A stand-in's events: no trainer listens."""

    def send(self, msg: Any) -> None:
        pass


def parent_is_gone(parent_pid: int) -> bool:
    """Whether the worker that started this process is gone: a dead parent's children are
    re-parented (to init, pid 1, or a subreaper), so the parent pid changes."""
    return parent_pid <= 1 or os.getppid() != parent_pid


def _watch(parent_pid: int, deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    while not parent_is_gone(parent_pid):
        if time.monotonic() > end:
            log.warning(
                "the stand-in (pid %d) ran past its deadline (%.0fs): exiting; what it was "
                "writing is not committed (the next start removes it)",
                os.getpid(),
                deadline_s,
            )
            os._exit(PARENT_GONE_EXIT)
        time.sleep(PARENT_POLL_S)
    log.warning(
        "the worker that started this stand-in (pid %d) is gone: exiting; what it was "
        "writing is not committed (the next start removes it)",
        parent_pid,
    )
    os._exit(PARENT_GONE_EXIT)  # the kernel lets go of the rank's lock with the process


def watch_parent(parent_pid: int, deadline_s: float) -> None:
    """Exit this process (releasing the lock it holds) as soon as ``parent_pid`` is no longer
    its parent, and at the latest after ``deadline_s``: by then the parent worker's own
    deadline (``WorkerConfig.orphan_deadline_s``, from the trainers' death, before this
    start) ended it. Polled from a thread of its own: ``prctl(PR_SET_PDEATHSIG)`` would fire
    when the worker's *thread* that started it ends, not the worker."""
    if parent_is_gone(parent_pid):
        _watch(parent_pid, deadline_s)  # (exits at once)
    threading.Thread(
        target=_watch, args=(parent_pid, deadline_s), name="asyncckpt-stand-in-parent", daemon=True
    ).start()


def stand_in_main(config: WorkerConfig, jobs: list[SaveJob], arenas: dict[int, Any]) -> None:
    """Write the gone rank's part of the memory step agreed, from its replicas."""
    from asyncckpt import faults
    from asyncckpt.memory.hold import FixedHolder, persist_held
    from asyncckpt.memory.replication import recovery_over
    from asyncckpt.storage.local import LocalStore
    from asyncckpt.worker.loop import Worker, skip_torch_save_crc

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.dist is not None and config.dist.ranks_per_node:  # node-local roots
        from asyncckpt.formats.dcp import _PassThroughPlanner
        from asyncckpt.storage.localfs import makedirs

        _PassThroughPlanner.replicated_on_rank0 = True  # as every worker there
        makedirs(config.root)  # the holder's .asyncckpt-replicas/node<n> (replication.py)
    # The gone worker's lock: a new trainer of that rank waits for this process.
    lock_fd = LocalStore(config.root).lock(f"worker{config.rank}", wait=False)  # noqa: F841
    skip_torch_save_crc()
    faults.clear()
    worker = Worker(config, None, _Nowhere(), None, FixedHolder(jobs))
    worker.stand_in = True
    worker.arenas = dict(arenas)
    persist_held(worker)
    recovery_over(worker)


def main() -> None:
    # The parent first, before torch is imported (seconds): it may die meanwhile.
    # Named by the worker at spawn (replication.spawn_stand_in): one that died before this line
    # ran (its child re-parented, perhaps to a subreaper) is still told apart.
    parent = int(os.environ.pop(PARENT_ENV, 0) or os.getppid())
    if parent_is_gone(parent):
        sys.exit(f"the stand-in's parent worker is gone before it started (pid {os.getpid()})")
    from asyncckpt.memory.replication import read_stand_in

    config, jobs, arenas = read_stand_in(sys.stdin.buffer)
    watch_parent(parent, config.orphan_deadline_s)
    stand_in_main(config, jobs, arenas)


if __name__ == "__main__":
    main()

"""A stand-in: the worker of a rank whose node is gone, run by the holder of that rank's
replicas as a plain child process (``python -m asyncckpt.worker.stand_in``; replication.py starts
it and hands it the replicas' shared memory by descriptor). It takes that rank's part in the
exchange at the trainers' death and writes that rank's files of the step agreed, as that
rank's worker would have.

Its work (``stand_in_main``) is in main.py, beside a worker's start. It ends with the worker
that started it (``watch_parent``), as a worker ends with its
trainer: it holds that rank's worker lock, which a new trainer of the rank waits for, and a
SIGKILLed worker left it writing for minutes. What a stand-in cut short leaves is the step's
temporary, never a commit (its part never reached the exchange; every rank's part must),
which the next start removes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger("asyncckpt")

#: The environment variable in which the starting worker names its pid.
PARENT_ENV = "ASYNCCKPT_STAND_IN_PARENT"
#: Seconds between two looks at whether the parent worker still lives.
PARENT_POLL_S = 0.2
#: The exit status of a stand-in whose parent worker is gone (or its deadline passed).
PARENT_GONE_EXIT = 3


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


def main() -> None:
    # The parent first, before torch is imported (seconds): it may die meanwhile.
    # Named by the worker at spawn (replication.spawn_stand_in): one that died before this line
    # ran (its child re-parented, perhaps to a subreaper) is still told apart.
    parent = int(os.environ.pop(PARENT_ENV, 0) or os.getppid())
    if parent_is_gone(parent):
        sys.exit(f"the stand-in's parent worker is gone before it started (pid {os.getpid()})")
    # Only now the package's worker modules (they import torch: seconds).
    from asyncckpt.memory.replication import read_stand_in
    from asyncckpt.worker.main import stand_in_main

    config, jobs, arenas = read_stand_in(sys.stdin.buffer)
    watch_parent(parent, config.orphan_deadline_s)
    stand_in_main(config, jobs, arenas)


if __name__ == "__main__":
    main()

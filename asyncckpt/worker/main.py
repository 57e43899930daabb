"""The worker process's start (``worker_main``): its signals, lock and side store, the
services it runs beside its write composed around its ``Worker`` (loop.py), and its end; and
a stand-in's work (``stand_in_main``, started by stand_in.py)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from asyncckpt import faults
from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster.local_recovery import clean_local_root
from asyncckpt.cluster.peer_gone import note_worker
from asyncckpt.core import messages as M
from asyncckpt.core.layout import TMP_PREFIX
from asyncckpt.core.savejob import SaveJob
from asyncckpt.formats.dcp import _PassThroughPlanner
from asyncckpt.memory.hold import FixedHolder, Holder, MemoryHold
from asyncckpt.memory.replication import Replication
from asyncckpt.memory.service import WorkerService
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.localfs import makedirs, unlock
from asyncckpt.worker.config import WorkerConfig
from asyncckpt.worker.loop import Worker
from asyncckpt.worker.pins import Pins
from asyncckpt.worker.report import ToTrainer
from asyncckpt.worker.services import Export

log = logging.getLogger("asyncckpt")


def skip_torch_save_crc() -> None:
    # torch.save computes a crc32 of every record it writes; the manifest already checksums
    # every byte of every file (and is what load verifies), so that pass is pure CPU cost.
    # Readers do not need it: torch.load accepts archives written without it.
    torch.serialization.set_crc32_options(False)


def _watch_parent(parent_pid: int, deadline_s: float) -> None:
    """Bound the life of a worker whose trainer died.

    A save whose ``save()`` returned is fully staged here (the job is sent only after the
    copy), so the worker goes on after its trainer's death: it finishes every job that
    reached it whole, commits, writes the tracker and prunes; then the pipe's end of file
    ends its loop (a job cut off mid-message never starts). It must never linger, so after
    ``deadline_s`` it exits whatever it is doing (temporaries are removed at the next start).
    """
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    log.warning(
        "the trainer (pid %d) is gone: finishing the saves it staged (at most %.0fs)",
        parent_pid,
        deadline_s,
    )
    time.sleep(deadline_s)
    os._exit(3)


def clean_after_earlier_worker(root: str) -> None:
    """The root's leftovers removed by the worker, which now holds the worker lock after the
    earlier trainer's worker the trainer did not wait for (trainer/earlier_worker.py): what that
    one or a crash before it left. The trainer's own small notes being replaced at this moment
    (``.tmp-.asyncckpt-*``: the goodput ledger, the pins) stay; the next start removes any left."""
    trainer_notes = TMP_PREFIX + ".asyncckpt-"
    clean_local_root(root, keep=lambda name: name.startswith(trainer_notes))


def compose(
    worker: Worker, holder: Holder | None, replication: Replication | None, events: Any
) -> list[WorkerService]:
    """The services a worker runs beside its write, in the order their hooks are called:
    the pins and replication on the reader thread, the memory hold, then the export (its
    manifest fields before the hot resume's), and the hot resume's offer last."""
    services: list[WorkerService] = [Pins(worker.pins, events)]
    if replication is not None:
        services.append(replication)
    if holder is not None:  # a Hold counts once its slot's memory is mapped here
        holder.watch_arenas(worker.arenas, worker.received_all)
    services.append(MemoryHold(worker, holder, replication))
    services.append(Export(worker.config))
    services.append(worker.hot)
    return services


def worker_main(
    config: WorkerConfig, jobs: Any, events: Any, pause: Any = None, memory: Any = None
) -> None:
    """Entry point of the spawned worker process (``memory``: the memory tier's pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    events = ToTrainer(events)
    threading.Thread(
        target=_watch_parent, args=(config.parent_pid, config.orphan_deadline_s), daemon=True
    ).start()
    # Held until this process exits: a new engine on the root waits for it before cleaning.
    lock_fd = LocalStore(config.root).lock(f"worker{config.rank}", wait=True, note_pid=True)
    if config.clean_root:
        clean_after_earlier_worker(config.root)
    if config.dist is not None and not config.dist.ranks_per_node:  # one shared root
        note_worker(config.root, config.rank, config.dist.token)
    skip_torch_save_crc()
    # Faults come from the trainer with each job (it read $ASYNCCKPT_FAULTS); the copy this
    # process armed on import would fire a second time. Firing is reported back so that the
    # trainer disarms the point and a restarted worker does not fire it again.
    faults.clear()
    faults.set_reporter(lambda fault_id: events.send(M.FaultFired(fault_id)))
    side_store = None
    if config.store_socket is not None and config.dist is not None:  # (rank 0 of several)
        side_store = _dist.serve(config.dist, config.store_socket)  # noqa: F841 - kept alive
    if config.dist is not None and config.dist.ranks_per_node:  # node-local roots
        _PassThroughPlanner.replicated_on_rank0 = True  # whose files every node gets
    replication = None
    if config.replication is not None and config.dist is not None:
        replication = Replication(config.dist, config.replication, events)
    holder = None
    if memory is not None:
        holder = Holder(memory, events, replication.sender if replication else None)
    worker = Worker(config, jobs, events, pause)
    worker.replication = replication
    worker.services = compose(worker, holder, replication, events)
    try:
        worker.run()
    except (EOFError, OSError):
        pass  # the trainer closed the pipe; temporaries are removed at the next start
    for service in worker.services:  # (the hot resume: what it wrote stays in memory a while)
        service.close(lambda: unlock(lock_fd) if lock_fd is not None else None)


class _Nowhere:
    """A stand-in's events: no trainer listens."""

    def send(self, msg: Any) -> None:
        pass


def stand_in_main(config: WorkerConfig, jobs: list[SaveJob], arenas: dict[int, Any]) -> None:
    """Write the gone rank's part of the memory step agreed, from its replicas (a stand-in:
    stand_in.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.dist is not None and config.dist.ranks_per_node:  # node-local roots
        _PassThroughPlanner.replicated_on_rank0 = True  # as every worker there
        makedirs(config.root)  # the holder's .asyncckpt-replicas/node<n> (replication.py)
    # The gone worker's lock: a new trainer of that rank waits for this process.
    lock_fd = LocalStore(config.root).lock(f"worker{config.rank}", wait=False)  # noqa: F841
    skip_torch_save_crc()
    faults.clear()
    worker = Worker(config, None, _Nowhere(), None)
    worker.arenas = dict(arenas)
    hold = MemoryHold(worker, FixedHolder(jobs), stand_in=True)
    worker.services = [hold, Export(config), worker.hot]  # (as that rank's worker: it may be 0)
    hold.persist()
    hold.recovery_over()

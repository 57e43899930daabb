"""A stand-in: the worker of a rank whose node is gone, run by the holder of that rank's
replicas as a plain child process (``python -m asyncckpt.stand_in``; replication.py starts
it and hands it the replicas' shared memory by descriptor). It takes that rank's part in the
exchange at the trainers' death and writes that rank's files of the step agreed, as that
rank's worker would have."""

from __future__ import annotations

import signal
import sys
from typing import Any

from . import faults
from .memory_hold import FixedHolder, persist_held
from .replication import read_stand_in, recovery_over
from .storage.local import LocalStore
from .worker import SaveJob, Worker, WorkerConfig, skip_torch_save_crc


class _Nowhere:
    """A stand-in's events: no trainer listens."""

    def send(self, msg: Any) -> None:
        pass


def stand_in_main(config: WorkerConfig, jobs: list[SaveJob], arenas: dict[int, Any]) -> None:
    """Write the gone rank's part of the memory step agreed, from its replicas."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if config.dist is not None and config.dist.ranks_per_node:  # node-local roots
        from .formats.dcp import _PassThroughPlanner
        from .storage.localfs import makedirs

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
    config, jobs, arenas = read_stand_in(sys.stdin.buffer)
    stand_in_main(config, jobs, arenas)


if __name__ == "__main__":
    main()

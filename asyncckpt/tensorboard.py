"""A ready ``on_commit`` callback that logs every save's figures to TensorBoard.

    from asyncckpt.tensorboard import TensorBoardLogger

    engine = CheckpointEngine("ckpts", on_commit=TensorBoardLogger("runs/ckpt"))

Needs ``tensorboard`` (``pip install 'asyncckpt[tensorboard]'``); it writes through
``torch.utils.tensorboard.SummaryWriter``, imported only when a logger is made.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from asyncckpt.stats import SaveStats
from asyncckpt.storage.goodput import read_ledger, summarize

#: The ``SaveStats`` figures logged, each as the scalar ``<prefix><name>`` at the save's step.
SCALARS = (
    "blocked_seconds",
    "stage_seconds",
    "wait_seconds",
    "alloc_seconds",
    "write_seconds",
    "commit_seconds",
    "paused_seconds",
    "bytes",
    "staged_bytes",
    "throughput_bytes_per_s",
)
#: The goodput ledger's figures (every run on the root added up, storage/goodput.py), logged
#: at each commit as ``<prefix>goodput/<name>``: where the wall time went so far.
GOODPUT_SCALARS = (
    "goodput",
    "productive_seconds",
    "save_blocking_seconds",
    "load_seconds",
    "startup_seconds",
    "wasted_seconds",
    "wall_seconds",
)


class TensorBoardLogger:
    """``on_commit`` callback: each committed save's figures as TensorBoard scalars.

    Every name of ``SCALARS`` is logged as ``prefix + name`` at ``global_step=stats.step``
    with the commit's wall time, then the writer is flushed (one flush per checkpoint), so a
    running TensorBoard shows a save as soon as it commits.

    ``log_dir``: where a new ``SummaryWriter`` writes (closed by ``close``). Or ``writer``:
    an existing ``SummaryWriter`` (e.g. the training loop's own), which stays the caller's
    to close. The engine calls ``on_commit`` on its reader thread, not the training thread;
    ``SummaryWriter`` may be used from both (it queues events to its own writer thread).

    ``goodput=True``: also log the root's goodput ledger (``GOODPUT_SCALARS``, read from the
    directory the checkpoint was committed in, when it has one).
    """

    def __init__(
        self,
        log_dir: str | os.PathLike | None = None,
        *,
        writer: Any = None,
        prefix: str = "checkpoint/",
        goodput: bool = False,
    ) -> None:
        if (log_dir is None) == (writer is None):
            raise ValueError("TensorBoardLogger needs exactly one of log_dir= or writer=")
        self.prefix = prefix
        self.goodput = goodput
        self._owned = writer is None
        if log_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "TensorBoardLogger needs tensorboard: pip install 'asyncckpt[tensorboard]' "
                    f"(or tensorboard) ({e})"
                ) from e
            writer = SummaryWriter(log_dir=os.fspath(log_dir))
        self.writer = writer
        self._lock = threading.Lock()  # close() from the training thread vs a late commit
        self._closed = False

    def __call__(self, stats: SaveStats) -> None:
        with self._lock:
            if self._closed:
                return
            for name in SCALARS:
                self.writer.add_scalar(
                    self.prefix + name,
                    float(getattr(stats, name)),
                    global_step=stats.step,
                    walltime=stats.committed_at,
                )
            self._log_goodput(stats)
            self.writer.flush()

    def _log_goodput(self, stats: SaveStats) -> None:
        ledger = read_ledger(Path(stats.path).parent) if self.goodput and stats.path else None
        if ledger is None:
            return
        total = summarize(ledger.runs).as_dict()
        for name in GOODPUT_SCALARS:
            if total[name] is not None:
                self.writer.add_scalar(
                    f"{self.prefix}goodput/{name}",
                    float(total[name]),
                    global_step=stats.step,
                    walltime=stats.committed_at,
                )

    def close(self) -> None:
        """Flush; close the writer if this logger made it. Later commits are not logged."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.writer.flush()
            if self._owned:
                self.writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

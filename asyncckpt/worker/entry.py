"""The worker process's entry point, as the trainer names it when it spawns the worker.

The trainer hands ``multiprocessing`` a function to run in the new process, and importing that
function's module imports everything it imports. ``worker.main`` brings the DCP writer, and
``torch.distributed.checkpoint`` costs a trainer about a second to import (DTensor's op
tables): a restart that resumes from memory would wait for code only the worker runs. So the
trainer imports this module, and the worker's modules are imported in the worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncckpt.worker.config import WorkerConfig


def run_worker(
    config: WorkerConfig, jobs: Any, events: Any, pause: Any = None, memory: Any = None
) -> None:
    """``worker.main.worker_main``, imported in the worker process."""
    from asyncckpt.worker.main import worker_main

    worker_main(config, jobs, events, pause, memory)

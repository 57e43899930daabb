"""The export as a worker's service beside its write (memory/service.py says what a service
is): a component as Hugging Face safetensors every N steps; the pins are pins.py."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from asyncckpt.core.savejob import SaveJob
from asyncckpt.memory.service import WorkerService
from asyncckpt.worker.config import WorkerConfig
from asyncckpt.worker.export import (
    export_step,
    missing_exports,
    prune_exports,
    wanted_record,
)
from asyncckpt.worker.report import error_info

log = logging.getLogger("asyncckpt")


class Export(WorkerService):
    """``WorkerConfig.export``: every ``export.every_steps``, rank 0 writes the component as
    Hugging Face safetensors from the committed directory (``after_commit``), which records
    the export as wanted (``manifest``) so that one a killed worker left undone is written
    at the next start (``on_start``)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.root = Path(config.root)
        self.rank = config.dist.rank if config.dist is not None else 0

    def on_start(self) -> None:
        """At start (rank 0): the exports that committed checkpoints record as wanted and that
        are not there (the worker before this one died, or its trainer was killed, mid-export),
        written now, before any job; then crashed exports' leftovers removed."""
        export = self.config.export
        if export is None or self.rank != 0:
            return
        try:
            for step, path in missing_exports(export, self.root, self.config.layout):
                log.warning("asyncckpt: step %d's export was not completed; exporting it", step)
                export_step(export, path, step)
            prune_exports(export)
        except Exception as e:  # noqa: BLE001 - the next start tries again; saves go on
            log.warning("asyncckpt: redoing an interrupted export failed: %s", e)

    def manifest(self, job: SaveJob) -> dict[str, Any]:
        """The manifest's record of the export due at ``job``'s step: a worker killed before
        the export was published leaves a checkpoint that says so (``on_start``)."""
        export = self.config.export
        if export is None or not export.due(job.step):
            return {}
        return {"hf_export": wanted_record(export)}

    def after_commit(self, job: SaveJob, final: Path, stats: dict[str, Any]) -> dict | None:
        """Rank 0, every rank's shards in the committed directory (consolidated here, never in
        the trainer), then the export's own retention. Returns None or the failure's info,
        marked as an export failure (the step stays committed)."""
        export = self.config.export
        if self.rank != 0 or export is None or not export.due(job.step):
            return None
        t0 = time.perf_counter()
        try:
            path = export_step(export, final, job.step)
            prune_exports(export, job.step)  # (just written and checksummed: trusted)
        except BaseException as e:  # noqa: BLE001 - reported on the save's handle
            info = error_info(e)
            info["export"] = True
            return info
        stats["export_seconds"] = time.perf_counter() - t0
        stats["export_path"] = str(path)
        return None

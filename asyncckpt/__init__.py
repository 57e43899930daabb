"""asyncckpt: asynchronous save-and-prune checkpointing for PyTorch training loops.

The public surface is re-exported here; everything else is an implementation detail.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncckpt import faults
from asyncckpt.errors import (
    AllCheckpointsQuarantined,
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    ExportFailed,
    NotACheckpointRoot,
    NotReplicated,
    NotSerializable,
    NoValidCheckpoint,
    RootLocked,
    SaveFailed,
    StagingMemoryError,
    StateMismatch,
    StateModifiedWhileStaging,
    UncommittedResume,
    UnsupportedStorage,
    WorkerDied,
    WriteTimeout,
)
from asyncckpt.formats.components import Component
from asyncckpt.io.throttle import ThrottleConfig
from asyncckpt.options import (
    Distributed,
    MemoryTier,
    ObjectStore,
    Preemption,
    Retention,
    Schedule,
    Staging,
)
from asyncckpt.retention import (
    CheckpointInfo,
    KeepAll,
    KeepBest,
    KeepEvery,
    KeepInterval,
    KeepLast,
    KeepSteps,
    RetentionPolicy,
    SaveSchedule,
)
from asyncckpt.stats import SaveStats
from asyncckpt.storage import RemoteTier, UploadFailed
from asyncckpt.storage.manifest import VerifyReport, verify

if TYPE_CHECKING:
    from asyncckpt.engine import CheckpointEngine, PauseHooks, SaveHandle
    from asyncckpt.formats.loadcheck import LoadReport
    from asyncckpt.formats.reading import read_checkpoint
    from asyncckpt.storage.fresh_start import start_fresh
    from asyncckpt.sync import SyncCheckpointEngine
    from asyncckpt.worker.export import HFExport

# The engines (and the load check) import torch (seconds); they load on first use (PEP 562), so ``import asyncckpt``
# and the CLI's ``--help`` stay fast. ``from asyncckpt import CheckpointEngine`` works as before.
_LAZY = {
    "CheckpointEngine": ".engine",
    "PauseHooks": ".engine",
    "SaveHandle": ".engine",
    "LoadReport": ".formats.loadcheck",
    "SyncCheckpointEngine": ".sync",
    "read_checkpoint": ".formats.reading",
    "HFExport": ".export",
    "start_fresh": ".storage.fresh_start",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFound",
    "Component",
    "CorruptCheckpoint",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepInterval",
    "KeepLast",
    "KeepSteps",
    "PauseHooks",
    "NoValidCheckpoint",
    "AllCheckpointsQuarantined",
    "start_fresh",
    "NotReplicated",
    "NotSerializable",
    "RetentionPolicy",
    "RootLocked",
    "SaveFailed",
    "SaveHandle",
    "SaveSchedule",
    "SaveStats",
    "StagingMemoryError",
    "StateModifiedWhileStaging",
    "SyncCheckpointEngine",
    "ThrottleConfig",
    "UncommittedResume",
    "VerifyReport",
    "WorkerDied",
    "WriteTimeout",
    "faults",
    "verify",
    "UnsupportedStorage",
    "StateMismatch",
    "NotACheckpointRoot",
    "LoadReport",
    "read_checkpoint",
    "ExportFailed",
    "HFExport",
    "RemoteTier",
    "UploadFailed",
    "Schedule",
    "Retention",
    "Distributed",
    "Preemption",
    "ObjectStore",
    "MemoryTier",
    "Staging",
]

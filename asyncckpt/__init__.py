"""asyncckpt: asynchronous save-and-prune checkpointing for PyTorch training loops.

The public surface is re-exported here; everything else is an implementation detail.
"""

from . import faults
from .engine import CheckpointEngine, PauseHooks, SaveHandle
from .errors import (
    CheckpointError,
    CorruptCheckpoint,
    NotACheckpointRoot,
    NoValidCheckpoint,
    RootLocked,
    SaveFailed,
    StagingMemoryError,
    StateMismatch,
    WorkerDied,
    WriteTimeout,
)
from .loadcheck import LoadReport
from .manifest import VerifyReport, verify
from .retention import (
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
from .stats import SaveStats
from .sync import SyncCheckpointEngine
from .throttle import ThrottleConfig

__version__ = "0.1.0"

__all__ = [
    "CheckpointEngine",
    "CheckpointError",
    "CheckpointInfo",
    "CorruptCheckpoint",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepInterval",
    "KeepLast",
    "KeepSteps",
    "PauseHooks",
    "NoValidCheckpoint",
    "RetentionPolicy",
    "RootLocked",
    "SaveFailed",
    "SaveHandle",
    "SaveSchedule",
    "SaveStats",
    "StagingMemoryError",
    "SyncCheckpointEngine",
    "ThrottleConfig",
    "VerifyReport",
    "WorkerDied",
    "WriteTimeout",
    "faults",
    "verify",
    "StateMismatch",
    "NotACheckpointRoot",
    "LoadReport",
]

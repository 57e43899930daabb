"""The exceptions asyncckpt raises; all derive from ``CheckpointError``."""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every asyncckpt error."""


class SaveFailed(CheckpointError):
    """A save did not commit. ``__cause__`` holds the worker's error where there was one."""


class WorkerDied(SaveFailed):
    """The background worker process died while it held a save; a new worker is started."""


class WriteTimeout(SaveFailed):
    """A write took longer than ``write_timeout``; the hung worker was killed."""


class NotReplicated(CheckpointError):
    """A memory save's replica is not held by the peer node's worker (``handle.replicated``):
    the peer was unreachable or had no room, a newer save superseded it before it was sent,
    or the save is not a replicated one (``memory=MemoryTier(replicas=1)``, ``tier="memory"``).
    The save itself stands: its own worker holds it."""


class StateModifiedWhileStaging(CheckpointError):
    """A tensor of the state was modified in place, or its storage freed, resized or replaced
    (``untyped_storage().resize_()``, ``set_()``), before its save was fully staged.

    The cause of that save's ``SaveFailed``: ``keys`` names the tensors (their flattened keys,
    as in the checkpoint), ``storage`` those of them whose storage moved. Nothing of that save
    was written.
    """

    def __init__(
        self, keys: list[str], storage: list[str] | None = None, unseen: list[str] | None = None
    ) -> None:
        self.keys = list(keys)
        """The tensors modified or moved, by their flattened keys (as in the checkpoint)."""
        self.storage = list(storage or [])
        """Of ``keys``, those whose storage was freed, resized or replaced."""
        self.unseen = list(unseen or [])
        """Of ``keys``, those found by comparing bytes after an overlapped save's copy or a
        chunked save's last chunk (no version counter moved: a write through ``.data`` or
        NumPy)."""
        moved = set(self.storage) | set(self.unseen)
        written = [k for k in self.keys if k not in moved]
        parts = []
        if self.unseen:
            parts.append(
                f"{len(self.unseen)} tensor(s) whose bytes changed while being staged though "
                f"no version counter moved (a write through .data or NumPy): {_few(self.unseen)}"
            )
        if written:
            parts.append(
                f"{len(written)} tensor(s) modified in place while being staged: {_few(written)}"
            )
        if self.storage:
            parts.append(
                f"{len(self.storage)} tensor(s) whose storage was freed, resized or replaced "
                f"while being staged: {_few(self.storage)}"
            )
        super().__init__("; ".join(parts))


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:10]) + (f" and {len(keys) - 10} more" if len(keys) > 10 else "")


class NotSerializable(CheckpointError, TypeError):
    """An entry of the state cannot be saved: it is neither a tensor nor a value that pickles
    (a lambda, a lock, an open file, a generator). Raised by ``save`` before anything is
    written. ``key`` is the entry's path in the state (dotted, as in the checkpoint),
    ``type_name`` its type. A ``TypeError`` too, for callers that caught that before."""

    def __init__(self, message: str, key: str | None = None, type_name: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        """The entry's path in the state, dotted as in the checkpoint (``"extra.fn"``)."""
        self.type_name = type_name
        """The entry's type (``"function"``, ``"_thread.lock"``)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.key, self.type_name))


class StagingMemoryError(CheckpointError, MemoryError):
    """Not enough free memory to allocate the staging arenas without swapping."""


class RootLocked(CheckpointError):
    """Another engine holds this checkpoint root."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint failed its manifest checksums or could not be read."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """No checkpoint at the step or path asked for: never committed, or pruned (also while it
    was being read). A ``FileNotFoundError`` too, for callers that caught that before."""


class NoValidCheckpoint(CheckpointError):
    """No committed checkpoint in the root passed verification."""


class AllCheckpointsQuarantined(NoValidCheckpoint):
    """Every checkpoint of the root was found damaged and moved into its quarantine: nothing
    is left to resume from, and ``load_latest`` will not start from scratch in silence.
    ``quarantined`` lists them (where each is, why). Repair one and move
    it back to its old name to resume from it, or ``asyncckpt.start_fresh(root)`` to start
    from scratch on purpose."""

    def __init__(self, message: str, quarantined: list[Any] | None = None) -> None:
        super().__init__(message)
        self.quarantined = list(quarantined or [])
        """The quarantined checkpoints: where each one is now, and why it was moved."""


class UploadFailed(SaveFailed):
    """A checkpoint committed locally could not be published to the object store."""


class ExportFailed(SaveFailed):
    """A step committed, but its Hugging Face export (``HFExport``) could not be written."""


class UnsupportedStorage(CheckpointError, ValueError):
    """The root is not a local (or mounted) directory, e.g. an ``s3://`` URL."""


class StateMismatch(CheckpointError, ValueError):
    """The load target does not fit the checkpoint (shapes, dtypes, missing or extra keys).

    A mistake in the caller's state, not damage: ``load_latest`` raises it at once instead of
    falling back to an older checkpoint, and nothing in the target has been changed.
    """


class NotACheckpointRoot(CheckpointError, ValueError):
    """The path given as a checkpoint root is not one (a checkpoint directory, a file, or a root
    of the other layout)."""


class UncommittedResume(CheckpointError):
    """A step loaded from a surviving worker's memory while that worker committed it did not
    commit (or committed other bytes): raised by the engine's ``start()``."""

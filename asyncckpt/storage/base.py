"""The ``Store`` protocol: every durable write and read of a checkpoint root goes through it.

A root is listed, checked against its manifests, read back, pruned and pointed at by a
tracker the same way wherever it lives; only how a write is made durable and visible differs
(invariants 1 and 10). ``LocalStore`` (a local or mounted root): a temporary directory is
sealed by fsync and published by an atomic rename, a deletion is a rename to trash, locks are
``flock``s. ``FsspecStore`` (an object store): sealing uploads every file, publishing writes a
marker last, a deletion removes the marker first, and there are no locks.

The operations are primitives, without fault points: the commit order (``commit.py``) and the
pruner (``prune.py``) are written once over a ``Store`` and announce the fault points named
in ``points`` between them (docs/faults.md); the HF export publishes through the same order
(``commit.publish``, ``commit.publish_replacing``). The CLI, the engine, the worker, the remote tier and the export all use a store;
tests/storage/test_storage_protocol.py puts both implementations through the same contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from asyncckpt.retention import CheckpointInfo


@dataclass(frozen=True)
class StoredCheckpoint:
    step: int
    name: str  # its directory name under the store's root (layout.dir_name)


@dataclass(frozen=True)
class FaultPoints:
    """The fault points (asyncckpt.faults) the commit order and the pruner announce for a
    store: before ``publish``, before the tracker, between ``retire`` and ``reclaim``, and
    after each file ``seal`` makes durable (None: no point there)."""

    publish: str | None
    tracker: str | None
    retire: str | None
    file: str | None = None


@runtime_checkable
class Store(Protocol):
    url: str  # where it is, for messages: a path or a URL
    points: FaultPoints

    # ------------------------------------------------------------------ read
    def committed(self, layout: str) -> list[StoredCheckpoint]:
        """Committed checkpoints, oldest step first; nothing uncommitted is ever listed."""
        ...

    def detect_layout(self, default: str = "global_step") -> str:
        """The layout of the root's checkpoints (``layout.detect_layout``'s rule)."""
        ...

    def describe(self, c: StoredCheckpoint) -> CheckpointInfo:
        """What a retention policy sees of ``c`` (its manifest; something even without one)."""
        ...

    def read_manifest(self, name: str) -> dict[str, Any]: ...

    def url_of(self, name: str) -> str:
        """Where ``name`` is, for messages and listings: a path, or a URL ('/' kept)."""
        ...

    def read_tracker(self) -> int | None:
        """The step the tracker names; None if there is none or it is not a step number."""
        ...

    def has_tracker(self) -> bool:
        """Whether a tracker is there at all (``read_tracker`` None: missing, or garbage)."""
        ...

    def exists(self, name: str) -> bool:
        """Whether anything is under ``name`` (committed, or retired and not reclaimed)."""
        ...

    def check(
        self, name: str, on_bytes: Callable[[int], None] | None = None, *, quick: bool = False
    ) -> list[str]:
        """Problems of ``name`` against its manifest (empty: good); ``quick``: sizes only."""
        ...

    def fetch(self, name: str, local_dir: Path) -> None:
        """Copy committed checkpoint ``name`` into the new local directory ``local_dir``."""
        ...

    def leftovers(self, layout: str) -> list[str]:
        """Names of what crashes left (temporaries, trash, uploads without a marker)."""
        ...

    # ------------------------------------------------------------------ write
    def stage(self, name: str, token: str | None = None) -> Path:
        """A new, empty local temporary directory to write ``name``'s files into (never a
        checkpoint name: invisible to every listing until ``publish``)."""
        ...

    def seal(self, staged: Path, name: str, on_file: Callable[[int], None] | None = None) -> int:
        """Make what ``staged`` holds durable, still invisible; returns its bytes.
        ``on_file(size)`` after each file made durable (the files' own fsync is the writer's
        locally; an object store uploads them here)."""
        ...

    def publish(
        self, staged: Path, name: str, on_bytes: Callable[[int], None] | None = None
    ) -> int | None:
        """Make the sealed ``staged`` visible as committed ``name``, atomically; refuses
        (``FileExistsError``) when ``name`` is committed already. A store that copies bytes
        (an upload) reports them to ``on_bytes`` and returns how many; a rename returns None."""
        ...

    def discard(self, staged: Path) -> None:
        """Remove a temporary that will not be published."""
        ...

    def write_tracker(self, layout: str, step: int) -> bool:
        """Point the tracker at ``step`` (forward only: False if it names a newer one)."""
        ...

    def retire(self, name: str) -> Any:
        """Make ``name`` stop being a checkpoint at once (``FileNotFoundError`` if it is not
        one); returns what ``reclaim`` removes."""
        ...

    def reclaim(self, retired: Any) -> None:
        """Reclaim the space of a retired checkpoint (a crash before it leaves a leftover)."""
        ...

    def delete(self, name: str) -> None:
        """``retire`` then ``reclaim``."""
        ...

    def quarantine(self, name: str, problems: list[str]) -> str:
        """Set aside committed ``name`` found corrupt (kept, never a checkpoint any more);
        returns where it went."""
        ...

    def lock(self, holder: str, *, wait: bool) -> int | None:
        """Hold the root's lock of ``holder`` (``rank<r>``, ``worker<r>``) until the process
        exits or ``unlock``; None if another process holds it (``wait=False``)."""
        ...

    def clean_leftovers(self, layout: str) -> list[str]:
        """Remove ``leftovers``; only where no other writer is at work on the root."""
        ...


#: The name of earlier releases (committed checkpoints only): the same protocol.
CommittedStore = Store

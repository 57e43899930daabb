"""The ``CommittedStore`` protocol: what every tier that holds committed checkpoints offers.

A committed checkpoint is listed, checked against its manifest, read back, pruned and pointed
at by a tracker the same way wherever it lives; only how a commit is made visible differs
(invariants 1 and 10): on a local file system an atomic rename (``LocalStore``, over
``commit.py`` and ``prune.py``), on an object store a marker written last and deleted first
(``FsspecStore``). The CLI's URL commands, the remote tier's retention and the tests of both
tiers (tests/test_storage_protocol.py) go through this protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class StoredCheckpoint:
    step: int
    name: str  # its directory name under the store's root (layout.dir_name)


@runtime_checkable
class CommittedStore(Protocol):
    url: str  # where it is, for messages: a path or a URL

    def committed(self, layout: str) -> list[StoredCheckpoint]:
        """Committed checkpoints, oldest step first; nothing uncommitted is ever listed."""
        ...

    def read_manifest(self, name: str) -> dict[str, Any]: ...

    def read_tracker(self) -> int | None: ...

    def write_tracker(self, layout: str, step: int) -> bool:
        """Point the tracker at ``step`` (forward only: False if it names a newer one)."""
        ...

    def check(
        self, name: str, on_bytes: Callable[[int], None] | None = None, *, quick: bool = False
    ) -> list[str]:
        """Problems of ``name`` against its manifest (empty: good); ``quick``: sizes only."""
        ...

    def fetch(self, name: str, local_dir: Path) -> None:
        """Copy committed checkpoint ``name`` into the new local directory ``local_dir``."""
        ...

    def delete(self, name: str) -> None:
        """Make ``name`` stop being a checkpoint at once, then reclaim its space."""
        ...

    def leftovers(self, layout: str) -> list[str]:
        """Names of what crashes left (temporaries, trash, uploads without a marker)."""
        ...

    def clean_leftovers(self, layout: str) -> list[str]:
        """Remove ``leftovers``; only where no other writer is at work on the root."""
        ...

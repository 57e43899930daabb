"""``LocalStore``: the ``CommittedStore`` of a local or mounted root (the engine's own tier).

Every guarantee stays where it was implemented: commits by fsync + atomic rename and trackers
by temp-file + rename (``commit.py``), deletion through a trash rename that never follows a
symlink nor leaves the root (``prune.py``), checksums (``manifest.py``), names (``layout.py``).
This class only gives them the protocol's shape.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import layout as _layout
from .base import StoredCheckpoint


class LocalStore:
    def __init__(self, root: str | os.PathLike) -> None:
        from ..paths import check_local_root

        self.root = check_local_root(root)
        self.url = str(self.root)

    def committed(self, layout: str) -> list[StoredCheckpoint]:
        return [StoredCheckpoint(c.step, c.path.name) for c in _layout.scan(self.root, layout)]

    def read_manifest(self, name: str) -> dict[str, Any]:
        from ..manifest import read_manifest

        return read_manifest(self.root / name)

    def read_tracker(self) -> int | None:
        return _layout.read_tracker(self.root)

    def write_tracker(self, layout: str, step: int) -> bool:
        from ..commit import write_tracker

        return write_tracker(self.root, layout, step)

    def check(
        self, name: str, on_bytes: Callable[[int], None] | None = None, *, quick: bool = False
    ) -> list[str]:
        from ..manifest import check_dir

        return check_dir(self.root / name, quick=quick, on_bytes=on_bytes)

    def fetch(self, name: str, local_dir: Path) -> None:
        source = self.root / name
        if not source.is_dir() or source.is_symlink():
            raise FileNotFoundError(f"{source} is not a committed checkpoint")
        shutil.copytree(source, local_dir, symlinks=True)

    def delete(self, name: str) -> None:
        from ..prune import trash_and_delete

        trash_and_delete(self.root, self.root / name)

    def leftovers(self, layout: str) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if _layout.is_leftover(e.name))
        except FileNotFoundError:
            return []

    def clean_leftovers(self, layout: str) -> list[str]:
        from ..prune import clean_leftovers

        return clean_leftovers(self.root)

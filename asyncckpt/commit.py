"""Commit: the only step that makes a checkpoint visible, and the cleanup of crashes.

Order (invariant 1): shards and manifest fsynced in the temporary directory -> fsync of that
directory -> atomic rename to the final name -> fsync of the root -> tracker rewritten
atomically (temp file, fsync, rename, fsync of the root). A crash anywhere leaves either the
old state or the new one, plus leftovers that ``clean_leftovers`` removes at the next start.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from . import faults
from . import layout as _layout
from .manifest import fsync_dir


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def rename_into_place(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically publish ``tmp_dir`` as ``final_dir`` (which must not exist)."""
    fsync_dir(tmp_dir)
    faults.point("before_rename")
    if final_dir.exists():
        raise FileExistsError(errno.EEXIST, "checkpoint already committed", str(final_dir))
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def write_tracker(root: Path, layout: str, step: int) -> None:
    """Point the tracker file(s) at ``step``: temp file, fsync, rename, fsync of the root."""
    faults.point("before_tracker")
    for name in _layout.tracker_names(layout):
        tmp = root / f"{_layout.TMP_PREFIX}{name}-{new_token()}"
        with open(tmp, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / name)
    fsync_dir(root)


def remove_tree(path: Path) -> None:
    """Remove a directory tree without following symlinks (a link is unlinked, never entered)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for entry in os.scandir(path):
        p = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            remove_tree(p)
        else:
            p.unlink(missing_ok=True)
    path.rmdir()

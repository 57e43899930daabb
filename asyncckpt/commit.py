"""Commit: the only step that makes a checkpoint visible, and the cleanup of crashes.

Order (invariant 1): shards and manifest fsynced in the temporary directory -> fsync of that
directory -> atomic rename to the final name -> fsync of the root -> tracker rewritten
atomically (temp file, fsync, rename, fsync of the root). A crash anywhere leaves either the
old state or the new one, plus leftovers that ``clean_leftovers`` removes at the next start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from pathlib import Path

from . import faults
from . import layout as _layout
from .manifest import fsync_dir


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def write_synced(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory is fsynced by the commit)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit_step(
    root: Path, layout: str, step: int, tmp_dir: Path, final_dir: Path, manifest: dict
) -> None:
    """The commit proper, one path for one rank and many (rank 0 runs it once every rank's
    shards are durable in ``tmp_dir``): manifest, atomic rename, tracker."""
    from .manifest import write_manifest

    write_manifest(tmp_dir, manifest)
    rename_into_place(tmp_dir, final_dir)
    write_tracker(root, layout, step)


def rename_into_place(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically publish ``tmp_dir`` as ``final_dir`` (which must not exist)."""
    fsync_dir(tmp_dir)
    faults.point("before_rename")
    if final_dir.exists():
        raise FileExistsError(errno.EEXIST, "checkpoint already committed", str(final_dir))
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def write_tracker(root: Path, layout: str, step: int) -> bool:
    """Point the tracker file(s) at ``step``, forward only; False if it names a newer step.

    Temp file, fsync, rename, fsync of the root. A tracker is never moved back from a newer
    committed checkpoint (an older step saved with ``allow_older_steps``, or a commit the
    trainer finishes after its worker died): readers of the tracker resume from the newest.
    """
    faults.point("before_tracker")
    return advance_tracker(root, layout, step)


def advance_tracker(root: Path, layout: str, step: int) -> bool:
    """``write_tracker`` without its fault point (the trainer finishing a dead worker's commit)."""
    current = _layout.read_tracker(root)
    if (
        current is not None
        and current > step
        # A tracker naming a step that is not there (deleted by hand) protects nothing.
        and (root / _layout.dir_name(layout, current)).is_dir()
    ):
        return False
    for name in _layout.tracker_names(layout):
        tmp = root / f"{_layout.TMP_PREFIX}{name}-{new_token()}"
        try:
            with open(tmp, "w") as f:
                f.write(f"{step}\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, root / name)
        except BaseException:
            # A full disk (ENOSPC) fails the write or the fsync: the temporary must not
            # stay in the root until the next start.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    fsync_dir(root)
    return True


def remove_tree(path: Path) -> None:
    """Remove ``path`` without following symlinks: a link or file is unlinked, a real
    directory removed (on Linux ``shutil.rmtree`` walks directory file descriptors, so a
    directory swapped for a link mid-walk cannot redirect it either)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)

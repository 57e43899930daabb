"""The local file system's write side: every call of the package that changes names on a disk,
syncs them, or locks them (tests/test_architecture.py keeps it so).

Primitives only: no fault point fires here and no order is imposed. The commit order
(``commit.py``, also the HF export's) and the pruner (``prune.py``) put them in order and
announce the fault points between them, so each reuses the same calls. Nothing here
imports the rest of the package (the manifest, the formats and ``LocalStore`` all stand on it).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import shutil
import socket
import stat
import time
import uuid
from pathlib import Path

from asyncckpt.core.layout import LOCK_NAME, TMP_PREFIX


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def lock_path(root: str | os.PathLike, holder: str) -> Path:
    """The lock file ``holder`` holds on ``root``: ``rank<r>`` (a trainer's engine) or
    ``worker<r>`` (its worker process); the one place a lock's name is made."""
    return Path(root) / f"{LOCK_NAME}.{holder}"


# ------------------------------------------------------------------------------ fsync
def fsync_fd(fd: int) -> None:
    os.fsync(fd)


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so that the names in it (creations, renames) are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync every directory under ``path`` and ``path`` itself, deepest first (links not
    followed): every name in the tree durable. A directory's fsync covers only the names
    directly in it, and writers leave their sub-directories' names to the seal."""
    for here, _dirs, _files in os.walk(os.fspath(path), topdown=False, onerror=_raise):
        fsync_dir(here)


def _raise(e: OSError) -> None:
    raise e  # (os.walk skips a directory it cannot list without a word)


def write_synced(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` and fsync it (the directory is fsynced by whoever commits)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_synced(path: str | os.PathLike, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace the file ``path`` atomically by one holding ``data``: a temporary beside it,
    fsynced, renamed over it, the directory fsynced (unless ``sync_dir=False``: the caller
    syncs it once after several). A failure (ENOSPC) leaves no temporary behind."""
    path = Path(path)
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{new_token()}"
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def write_note(path: str | os.PathLike, data: bytes) -> None:
    """Write a small advisory file, whole or not at all for a reader (a temporary beside it,
    renamed over it), without fsync: nothing is lost with it in a crash."""
    path = Path(path)
    part = path.parent / f"{TMP_PREFIX}{path.name}-{new_token()}"
    try:
        with open(part, "wb") as f:
            f.write(data)
        os.replace(part, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


# ------------------------------------------------------------------------------ names
def makedirs_synced(path: str | os.PathLike) -> None:
    """``mkdir -p``, each new directory's name made durable."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue  # made meanwhile by someone else
        fsync_dir(d.parent)
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))


def makedirs(path: str | os.PathLike) -> None:
    """``mkdir -p`` without syncs (inside a temporary: its seal makes the names durable)."""
    os.makedirs(path, exist_ok=True)


def mkdir(path: str | os.PathLike, *, exist_ok: bool = False) -> None:
    try:
        os.mkdir(path)
    except FileExistsError:
        if not exist_ok or not Path(path).is_dir():
            raise


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``os.rename``: atomic within one file system (the caller fsyncs the parent)."""
    os.rename(src, dst)


def rename_new(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst``, which must not exist (a committed step is never replaced)."""
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, "already exists", os.fspath(dst))
    os.rename(src, dst)


def remove_tree(path: str | os.PathLike) -> None:
    """Remove ``path`` without following symlinks: a link or file is unlinked, a real
    directory removed (on Linux ``shutil.rmtree`` walks directory file descriptors, so a
    directory swapped for a link mid-walk cannot redirect it either)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def rmdir_if_empty(path: str | os.PathLike) -> bool:
    """rmdir ``path``; False if it is not empty (or not there): anything in it is kept."""
    try:
        os.rmdir(path)
    except OSError:
        return False
    return True


def direct_child(root: Path, path: Path) -> Path:
    """``root/name`` for a direct child of ``root``, refusing anything else (never leave root)."""
    name = path.name
    if name in ("", ".", "..") or os.sep in name or (os.altsep and os.altsep in name):
        raise ValueError(f"refusing to delete {path}: not a named entry")
    if path.parent.resolve() != root.resolve():
        raise ValueError(f"refusing to delete {path}: not a direct child of {root}")
    return root / name


def link_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Hard-link ``src`` as ``dst`` (a new name): a differential save's unchanged file. A
    symlink is never followed (invariant 9); ``dst`` must not exist."""
    os.link(src, dst, follow_symlinks=False)


def link_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Hard-link every file under ``src`` into the new directory ``dst`` (same relative
    names; symlinks skipped): a second name for files another process renames meanwhile."""
    src, dst = Path(src), Path(dst)
    os.mkdir(dst)
    for p in sorted(src.rglob("*")):
        if p.is_symlink() or not p.is_file():
            continue
        to = dst / p.relative_to(src)
        os.makedirs(to.parent, exist_ok=True)
        os.link(p, to, follow_symlinks=False)


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the directory ``src`` to the new ``dst``; symlinks are copied as links."""
    shutil.copytree(src, dst, symlinks=True)


# ------------------------------------------------------------------------------ locks
def lock_file(path: str | os.PathLike, *, wait: bool, note_pid: bool = False) -> int | None:
    """An exclusive ``flock`` on the file ``path`` (made if missing); returns its descriptor,
    held until ``unlock``. ``wait=False``: None when another process holds it.
    ``note_pid``: the file then says which process holds it (for a human)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    if note_pid:  # the pid first, on a line of its own (pinfile reads it), then host, since
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{socket.gethostname()}\n{time.time():.0f}\n".encode())
    return fd


def lock_holder(path: str | os.PathLike) -> str:
    """Who holds the lock file ``path`` as its note says: "pid 123 on host h since <time>",
    or "a process that left no note" (it took it without ``note_pid``, or an older version)."""
    try:
        lines = Path(path).read_text().split()
        pid = int(lines[0])
    except (OSError, ValueError, IndexError):
        return "a process that left no note"
    said = f"pid {pid}"
    if len(lines) > 1:
        said += f" on host {lines[1]}"
    if len(lines) > 2 and lines[2].isdigit():
        when = datetime.datetime.fromtimestamp(int(lines[2])).isoformat(sep=" ")
        said += f" since {when}"
    return said


def lock_dir(path: str | os.PathLike) -> int:
    """An exclusive ``flock`` on the directory ``path`` (an export's temporary while it is
    written: ``locked_elsewhere`` tells it from a crash's leftover)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlock(fd: int) -> None:
    os.close(fd)  # closing the descriptor releases its flock


def locked_elsewhere(path: str | os.PathLike) -> bool:
    """Whether another process holds ``path``'s directory lock, or it cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False  # not a directory we can open: not held by anyone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return True  # no flock here (some network filesystems): leave it be
    finally:
        os.close(fd)  # drops our lock too
    return False


def lock_held(path: str | os.PathLike) -> bool:
    """Whether a process (this one included, through another descriptor) holds the lock
    file ``path`` (``lock_file``); False when there is no such file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def held_locks(root: str | os.PathLike) -> list[str]:
    """The names of ``root``'s lock files (``lock_path``) some process holds now: a live
    engine's ranks and workers."""
    try:
        names = sorted(
            e.name for e in os.scandir(os.fspath(root)) if e.name.startswith(f"{LOCK_NAME}.")
        )
    except OSError:
        return []
    return [n for n in names if lock_held(Path(root) / n)]


__all__ = [
    "copy_tree",
    "direct_child",
    "fsync_dir",
    "fsync_fd",
    "fsync_file",
    "lock_dir",
    "lock_file",
    "link_tree",
    "held_locks",
    "lock_held",
    "lock_holder",
    "lock_path",
    "locked_elsewhere",
    "makedirs",
    "makedirs_synced",
    "mkdir",
    "new_token",
    "remove_tree",
    "rename",
    "rename_new",
    "replace_synced",
    "rmdir_if_empty",
    "unlock",
    "write_note",
    "write_synced",
]

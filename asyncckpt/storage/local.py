"""``LocalStore``: the ``Store`` of a local or mounted root (the engine's own tier).

Commits by fsync + atomic rename, trackers by temp file + rename, deletion through a trash
rename that never follows a symlink nor leaves the root, quarantine by a rename into
``.quarantine/``, locks by ``flock``: every call that changes the disk goes through
``localfs.py``. Names come from ``layout.py``, checksums from ``manifest.py``. No fault point
fires here (``commit.py`` and ``prune.py`` announce them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncckpt.core import layout as _layout
from asyncckpt.core.paths import check_local_root
from asyncckpt.retention import CheckpointInfo
from asyncckpt.storage import localfs
from asyncckpt.storage.base import FaultPoints, StoredCheckpoint
from asyncckpt.storage.manifest import check_dir, read_manifest

log = logging.getLogger("asyncckpt.storage.prune")

POINTS = FaultPoints(publish="before_rename", tracker="before_tracker", retire="mid_prune")


def tree_size(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Apparent size of the regular files under ``path``, never following symlinks.

    ``seen``: the (device, inode) of files already counted, updated here: a file hard-linked
    into several checkpoints (a differential save's) counts once across the calls sharing it."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(path, followlinks=False):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if seen is not None and st.st_nlink > 1:
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def read_checkpoint_info(path: str | os.PathLike, step: int | None = None) -> CheckpointInfo:
    """The one disk read behind the policies: a committed directory's manifest.

    ``step`` (from the directory name) wins over the manifest's. A directory without a readable
    manifest (written by another tool, with only DCP's ``.metadata``) is described from the disk:
    its mtime as commit time, its measured size, no metrics and no run id.
    """
    path = Path(path)
    try:
        data = json.loads((path / _layout.MANIFEST).read_text())
        info = CheckpointInfo.from_manifest(data, path=path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        if step is None:
            raise ValueError(f"{path} has no readable manifest and no step was given") from None
        st = os.lstat(path)
        return CheckpointInfo(step, st.st_mtime, {}, tree_size(path), None, path)
    if step is not None and step != info.step:
        info = dataclasses.replace(info, step=step)
    return info


def damage_kind(problems: list[str]) -> str:
    """One word for the name of a quarantined checkpoint, from ``check_dir``'s problems."""
    text = "; ".join(problems)
    for needle, kind in (
        (_layout.MANIFEST, "manifest"),
        (": missing", "missing"),
        ("truncated", "truncated"),
        ("checksum", "checksum"),
    ):
        if needle in text:
            return kind
    return "corrupt"


def _note(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def writer_alive(note: dict[str, Any]) -> bool | None:
    """Whether the process a writer note names still runs: same pid and start time on this
    host (a reused pid is another process); None when it ran on another host."""
    import socket

    import psutil

    if note.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(note["pid"]))
        if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped by its trainer
            return False
        started = note.get("pid_started_at")
        # (create_time is from the boot time and clock ticks: equal up to rounding)
        return started is None or abs(proc.create_time() - float(started)) < 1.0
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


class LocalStore:
    points = POINTS

    def __init__(self, root: str | os.PathLike) -> None:

        self.root = check_local_root(root)
        self.url = str(self.root)

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    def path(self, name: str) -> Path:
        return self.root / name

    def url_of(self, name: str) -> str:
        return str(self.root / name)

    # ------------------------------------------------------------------ read
    def committed(self, layout: str) -> list[StoredCheckpoint]:
        return [StoredCheckpoint(c.step, c.path.name) for c in _layout.scan(self.root, layout)]

    def detect_layout(self, default: str = "global_step") -> str:
        return _layout.detect_layout(self.root, default)

    def describe(self, c: StoredCheckpoint) -> CheckpointInfo:
        return read_checkpoint_info(self.root / c.name, c.step)

    def read_manifest(self, name: str) -> dict[str, Any]:

        return read_manifest(self.root / name)

    def read_tracker(self) -> int | None:
        return _layout.read_tracker(self.root)

    def has_tracker(self) -> bool:
        return os.path.lexists(self.root / _layout.TRACKER)

    def check(
        self, name: str, on_bytes: Callable[[int], None] | None = None, *, quick: bool = False
    ) -> list[str]:

        return check_dir(self.root / name, quick=quick, on_bytes=on_bytes)

    def fetch(self, name: str, local_dir: Path) -> None:
        source = self.root / name
        if not source.is_dir() or source.is_symlink():
            raise FileNotFoundError(f"{source} is not a committed checkpoint")
        localfs.copy_tree(source, local_dir)

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.root / name)

    def leftovers(self, layout: str | None = None) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if _layout.is_leftover(e.name))
        except FileNotFoundError:
            return []

    # ------------------------------------------------------------------ write
    def create_root(self) -> None:
        """Make the root if missing (``mkdir -p``); ``OSError`` if it cannot be made (a file
        in the way, no permission)."""
        localfs.makedirs(self.root)

    def check_writable(self) -> None:
        """Create and remove a file in the root; ``OSError`` if it cannot (read-only mount,
        no permission). The probe has a temporary's name: a crash leaves only a leftover."""
        probe = self.root / _layout.tmp_name_of("probe", localfs.new_token()[:8])
        localfs.write_synced(probe, b"")
        localfs.remove_tree(probe)

    def stage(
        self,
        name: str,
        token: str | None = None,
        *,
        exist_ok: bool = False,
        writer: dict[str, Any] | None = None,
    ) -> Path:
        """``root/.tmp-<name>-<token>``; ``exist_ok``: several ranks share one temporary.
        ``writer`` (the worker's: pid, host, rank, step...): noted beside it for ``writes``
        until it is published or discarded."""
        tmp = self.root / _layout.tmp_name_of(name, token or localfs.new_token())
        localfs.mkdir(tmp, exist_ok=exist_ok)
        if writer is not None:
            note = _layout.writer_note_name(tmp.name, int(writer.get("rank", 0)))
            localfs.write_note(self.root / note, json.dumps(writer).encode())
        return tmp

    def _drop_notes(self, staged: Path) -> None:
        # Advisory only: one left by a crash is a leftover like its temporary.
        for note in self.root.glob(f"{staged.name}.writer-*.json"):
            with contextlib.suppress(OSError):
                localfs.remove_tree(note)

    def writes(self) -> list[dict[str, Any]]:
        """Temporaries and trash in the root, each ``{"name", "state", ...}``: ``state`` is
        ``"in progress"`` (a worker that noted itself, still alive; with its note's pid, host,
        rank, step, started_at, tier), ``"unknown"`` (noted by a process on another host:
        not checkable from here) or ``"leftover"`` (its writer is gone, or it has no note:
        removed at the next start). Notes themselves are not listed."""
        try:
            names = sorted(e.name for e in os.scandir(self.root) if _layout.is_leftover(e.name))
        except FileNotFoundError:
            return []
        notes = {n for n in names if _layout.is_writer_note(n)}
        out = []
        for name in names:
            if name in notes:
                continue
            writers = [
                w
                for n in sorted(notes)
                if n.startswith(name + ".writer-") and (w := _note(self.root / n))
            ]
            alive = [writer_alive(w) for w in writers]
            if any(a is True for a in alive):
                state = "in progress"
            elif any(a is None for a in alive):
                state = "unknown"
            else:
                state = "leftover"
            entry: dict[str, Any] = {"name": name, "state": state}
            if writers:
                entry.update(writers[0])
                entry["ranks"] = sorted(int(w.get("rank", 0)) for w in writers)
            out.append(entry)
        return out

    def seal(self, staged: Path, name: str, on_file: Callable[[int], None] | None = None) -> int:
        """Every name in the directory's tree durable (each file was fsynced by its writer;
        sub-directories' names are left to this: components, a fetched replica)."""
        localfs.fsync_tree(staged)
        return 0

    def publish(
        self, staged: Path, name: str, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """Atomic rename to ``name`` (refused if it exists), then fsync of the root."""
        final = self.root / name
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, "checkpoint already committed", str(final))
        localfs.rename_new(staged, final)
        localfs.fsync_dir(self.root)
        self._drop_notes(staged)

    def discard(self, staged: Path) -> None:
        self._drop_notes(staged)
        try:
            localfs.remove_tree(staged)
        except FileNotFoundError:
            return
        localfs.fsync_dir(self.root)

    def write_tracker(self, layout: str, step: int) -> bool:
        """Temp file, fsync, rename, fsync of the root; forward only.

        A tracker is never moved back from a newer committed checkpoint (an older step saved
        with ``allow_older_steps``, or a commit the trainer finishes after its worker died):
        readers of the tracker resume from the newest."""
        current = _layout.read_tracker(self.root)
        if (
            current is not None
            and current > step
            # A tracker naming a step that is not there (deleted by hand) protects nothing;
            # one that is, also under a name a scan lists (``global_step_0100``), does.
            and (
                (self.root / _layout.dir_name(layout, current)).is_dir()
                or any(c.step == current for c in _layout.scan(self.root, layout))
            )
        ):
            return False
        for name in _layout.tracker_names(layout):
            localfs.replace_synced(self.root / name, f"{step}\n".encode(), sync_dir=False)
        localfs.fsync_dir(self.root)
        return True

    def retire(self, name: str) -> Path:
        """Rename ``name`` (a direct child of the root) to a trash name, fsync the root: from
        then on it is out of the namespace. Returns the trash path."""
        path = localfs.direct_child(self.root, self.root / name)
        os.lstat(path)  # FileNotFoundError before anything else happens
        trash = self.root / _layout.trash_name(path.name, localfs.new_token())
        localfs.rename(path, trash)
        localfs.fsync_dir(self.root)
        return trash

    def unretire(self, retired: Path, name: str) -> None:
        """Put a retired ``name`` back (its replacement failed to publish)."""
        localfs.rename(retired, self.root / name)
        localfs.fsync_dir(self.root)

    def reclaim(self, retired: Path) -> None:
        try:
            localfs.remove_tree(retired)
        except FileNotFoundError:
            pass  # out of the namespace already; someone cleaned the trash (clean_leftovers)

    def delete(self, name: str) -> None:
        self.reclaim(self.retire(name))

    def quarantine(self, name: str, problems: list[str]) -> str:
        """Move committed ``name`` into ``root/.quarantine/`` with a note of why (a rename
        within the root: nothing is deleted; moving it back to its old name restores it)."""
        path = localfs.direct_child(self.root, self.root / name)
        qdir = self.root / _layout.QUARANTINE_DIR
        localfs.mkdir(qdir, exist_ok=True)
        now = time.time()
        qname = _layout.quarantine_name(path.name, damage_kind(problems), now)
        if (qdir / qname).exists():  # the same step twice in one second (downloaded again)
            qname = f"{qname}-{localfs.new_token()[:6]}"
        target = qdir / qname
        localfs.rename(path, target)  # FileNotFoundError: it went (pruned by another process)
        localfs.fsync_dir(self.root)
        note = {"name": path.name, "quarantined_at": now, "problems": problems}
        localfs.replace_synced(
            qdir / f"{qname}{_layout.QUARANTINE_INFO_SUFFIX}", json.dumps(note, indent=1).encode()
        )
        return str(target)

    def lock(self, holder: str, *, wait: bool, note_pid: bool = False) -> int | None:
        return localfs.lock_file(localfs.lock_path(self.root, holder), wait=wait, note_pid=note_pid)

    def clean_leftovers(
        self, layout: str | None = None, *, keep: Callable[[str], bool] | None = None
    ) -> list[str]:
        """Remove temporaries and trash left by a crash; returns the names removed (``keep``:
        names to leave alone).

        Only at start, while holding the root's lock: a temporary of a save in flight looks
        exactly like a leftover. Failures are logged and skipped (retried next start)."""
        removed = []
        for name in self.leftovers():
            if keep is not None and keep(name):
                continue
            try:
                localfs.remove_tree(localfs.direct_child(self.root, self.root / name))
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("asyncckpt: could not remove leftover %s: %s", self.root / name, e)
                continue
            removed.append(name)
        if removed:
            localfs.fsync_dir(self.root)
        return removed

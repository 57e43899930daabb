"""Committed checkpoints on an object store (S3, GCS, any fsspec URL), without a rename.

An object store cannot rename a directory atomically, so commit is a marker object
(``layout.COMMIT_MARKER``) inside the checkpoint's prefix (invariant 10):

- publish: every file of a locally committed checkpoint is uploaded (its manifest, with the
  CRC-32C of every file, among them), then the marker, last; then the tracker objects.
- list / load / verify / prune see a checkpoint only when its marker exists: a crash anywhere
  in an upload leaves a prefix with no marker, invisible and removed by the next ``clean``.
- delete: the marker first (from then on the checkpoint does not exist), then the rest.

Uploads go file by file through a few threads, each file with retries and backoff and a time
limit: a stalled upload (a known hang of other trainers' S3 paths) fails the upload with
``UploadFailed`` instead of hanging the worker. fsspec's S3 and GCS back-ends split large files
into multi-part uploads themselves.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncckpt.core import layout as _layout
from asyncckpt.errors import CheckpointError, UnsupportedStorage, UploadFailed
from asyncckpt.retention import CheckpointInfo
from asyncckpt.storage.base import FaultPoints, StoredCheckpoint
from asyncckpt.storage.localfs import remove_tree
from asyncckpt.storage.manifest import checksum_stream, entry_problem, read_manifest, recorded_bytes

if TYPE_CHECKING:
    from asyncckpt.retention import CheckpointInfo

log = logging.getLogger("asyncckpt")

POINTS = FaultPoints(
    publish="before_marker",
    tracker="before_remote_tracker",
    retire="mid_remote_prune",
    file="mid_upload",
)


class FsspecStore:
    """One checkpoint root on an fsspec file system (``s3://bucket/run``, ``gs://...``, ...).

    ``storage_options`` go to ``fsspec.core.url_to_fs`` (e.g. ``endpoint_url``, ``key``,
    ``secret`` for s3fs). ``timeout`` bounds each file's upload attempt, ``retries`` how many
    attempts a file gets (with exponential backoff from ``backoff`` seconds).
    """

    points = POINTS

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 0.5,
        threads: int = 8,
    ) -> None:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a declared dependency
            raise UploadFailed("object storage needs fsspec: pip install fsspec") from e
        self.url = url.rstrip("/")
        try:
            self.fs, self.base = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except ImportError as e:
            scheme = self.url.split("://", 1)[0]
            raise UploadFailed(
                f"{self.url}: fsspec has no back-end for {scheme}:// installed "
                f"(for s3:// pip install s3fs, for gs:// pip install gcsfs): {e}"
            ) from e
        self.base = self.base.rstrip("/")
        self.timeout = timeout
        self.retries = max(1, retries)
        self.backoff = backoff
        self.threads = max(1, threads)
        self._sealed: set[tuple[str, str]] = set()  # (staged, name): uploaded, no marker yet

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def path(self, *names: str) -> str:
        return "/".join([self.base, *names])

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def probe(self) -> None:
        """At engine start: the root exists and takes writes (one small object written and
        deleted), else ``CheckpointError`` in one line -- not ``UploadFailed`` after a few
        steps have committed locally. One attempt within ``timeout``, no retries."""

        path = self.path(f"{_layout.TMP_PREFIX}probe-{uuid.uuid4().hex[:8]}")
        pool = cf.ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-probe")
        try:
            pool.submit(self.fs.pipe_file, path, b"").result(timeout=self.timeout)
            pool.submit(self.fs.rm_file, path).result(timeout=self.timeout)
        except cf.TimeoutError:
            raise CheckpointError(
                f"checkpoint store {self.url} did not answer within {self.timeout:g} s"
            ) from None
        except FileNotFoundError as e:  # s3fs/gcsfs: NoSuchBucket
            raise CheckpointError(
                f"checkpoint store {self.url} does not exist (no such bucket?): {_one_line(e)}"
            ) from e
        except (OSError, ValueError) as e:  # PermissionError, the service's other errors
            raise CheckpointError(
                f"checkpoint store {self.url} is not writable: {_one_line(e)}"
            ) from e
        finally:
            pool.shutdown(wait=False)

    # ---------------------------------------------------------------- what is committed
    def committed(self, layout: str) -> list[StoredCheckpoint]:
        """Checkpoints whose marker exists, oldest step first (one listing)."""
        self.fs.invalidate_cache()  # another process (a trainer, the CLI) may have written
        out = []
        for marker in self.fs.glob(self.path("*", _layout.COMMIT_MARKER)):
            name = marker.rstrip("/").split("/")[-2]
            step = _layout.parse_dir_name(layout, name)
            if step is not None:
                out.append(StoredCheckpoint(step, name))
        out.sort(key=lambda c: c.step)
        return out

    def read_manifest(self, name: str) -> dict[str, Any]:
        return json.loads(self.fs.cat_file(self.path(name, _layout.MANIFEST)))

    def read_tracker(self) -> int | None:
        try:
            text = self.fs.cat_file(self.path(_layout.TRACKER)).decode().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        return int(text) if text.isdigit() else None

    def has_tracker(self) -> bool:
        return self.fs.exists(self.path(_layout.TRACKER))

    def is_committed(self, name: str) -> bool:
        return self.fs.exists(self.path(name, _layout.COMMIT_MARKER))

    def exists(self, name: str) -> bool:
        """Whether anything is stored under ``name`` (committed or not)."""
        self.fs.invalidate_cache()
        return self.fs.exists(self.path(name))

    def describe(self, c: StoredCheckpoint) -> CheckpointInfo:

        try:
            info = CheckpointInfo.from_manifest(self.read_manifest(c.name))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # Committed but its manifest is unreadable: still a checkpoint (kept by step).
            return CheckpointInfo(step=c.step, committed_at=0.0)
        return info if info.step == c.step else dataclasses.replace(info, step=c.step)

    # ---------------------------------------------------------------- publish
    def stage(self, name: str, token: str | None = None) -> Path:
        """A local temporary directory whose files ``seal`` uploads as ``name``."""
        return Path(
            tempfile.mkdtemp(prefix=_layout.tmp_name_of(name, token or uuid.uuid4().hex[:12]))
        )

    def discard(self, staged: Path) -> None:

        self._sealed = {k for k in self._sealed if k[0] != str(staged)}
        if staged.exists() and Path(tempfile.gettempdir()) in staged.parents:
            remove_tree(staged)  # only a temporary of ``stage``: a committed local dir stays

    def seal(self, staged: Path, name: str, on_file: Callable[[int], None] | None = None) -> int:
        """Upload every file of ``staged`` under ``name``, the manifest last; no marker yet.

        A prefix of that name without a marker is a crashed upload: replaced. One with a marker
        is already committed: ``FileExistsError`` (a step is never overwritten in place).
        ``on_file(size)`` after each file is up, within that file's upload attempt.
        """
        if self.is_committed(name):
            raise FileExistsError(f"{self.url_of(name)} is already committed")
        if self.fs.exists(self.path(name)):
            self.fs.rm(self.path(name), recursive=True)
        files = sorted(p for p in staged.rglob("*") if p.is_file() and not p.is_symlink())
        # The manifest goes up last of the files: a reader that found the marker finds it too.
        files.sort(key=lambda p: p.name == _layout.MANIFEST)
        rest, manifest = files[:-1], files[-1:]
        # A differential save's hard link to a file of a step the store already holds is copied
        # there by the store (server-side), not uploaded again.
        copies = self._linked_in_store(staged, rest)
        if copies:
            self._copy_all(
                [(src, self.path(name, *p.relative_to(staged).parts)) for p, src in copies]
            )
            copied = {p for p, _ in copies}
            rest = [p for p in rest if p not in copied]
        total = 0
        for group in (rest, manifest):
            total += self._put_all(
                [(p, self.path(name, *p.relative_to(staged).parts)) for p in group], on_file
            )
        self._sealed.add((str(staged), name))
        return total

    def publish(
        self, staged: Path, name: str, on_bytes: Callable[[int], None] | None = None
    ) -> int:
        """Write ``name``'s marker: from then on it is committed. Seals ``staged`` first if
        that was not done (one call uploads a locally committed checkpoint); returns the
        bytes uploaded by this call."""
        total = 0
        if (str(staged), name) not in self._sealed:
            total = self.seal(staged, name, on_bytes)
        self._sealed.discard((str(staged), name))
        marker = json.dumps({"step_dir": name, "committed_at": time.time()}).encode()
        marker_path = self.path(name, _layout.COMMIT_MARKER)
        self._with_retries(marker_path, self.fs.pipe_file, marker_path, marker)
        return total

    def _linked_in_store(self, staged: Path, files: list[Path]) -> list[tuple[Path, str]]:
        """Files of ``staged`` that are hard links to a file of a sibling step the store has
        committed (the same inode, whatever its name there), with that file's remote path.

        Only where the store's manifest of that step records the bytes ``staged``'s manifest
        records for the file (size and checksum): the store's step of that name may be another
        save's (a run restarted without its local root), whose file a copy would pass off as
        this one's."""

        linked = [p for p in files if p.stat().st_nlink > 1]
        if not linked:
            return []
        try:
            ours = read_manifest(staged)["files"]
        except (OSError, ValueError, KeyError):
            return []  # uploaded instead
        theirs: dict[str, dict[str, Any]] = {}

        def same_bytes(p: Path, step_name: str, rel: Path) -> bool:
            if step_name not in theirs:
                try:
                    theirs[step_name] = self.read_manifest(step_name)["files"]
                except (OSError, ValueError, KeyError):
                    theirs[step_name] = {}
            want, have = (
                ours.get(p.relative_to(staged).as_posix()),
                theirs[step_name].get(rel.as_posix()),
            )
            try:
                return (
                    want is not None
                    and have is not None
                    and recorded_bytes(want) == recorded_bytes(have)
                )
            except (KeyError, TypeError, ValueError):
                return False

        inodes: dict[tuple[int, int], tuple[str, Path]] = {}
        for d in staged.parent.iterdir():
            if d == staged or d.is_symlink() or not d.is_dir() or not self.is_committed(d.name):
                continue
            for q in d.rglob("*"):
                if q.is_file() and not q.is_symlink():
                    st = q.stat()
                    inodes.setdefault((st.st_dev, st.st_ino), (d.name, q.relative_to(d)))
        out: list[tuple[Path, str, dict[str, Any], int]] = []
        for p in linked:
            st = p.stat()
            found = inodes.get((st.st_dev, st.st_ino))
            if found is None:
                continue
            src = self.path(found[0], *found[1].parts)
            if not same_bytes(p, *found):
                log.info("%s: %s holds other bytes: uploaded", p, self.url_of(found[0]))
                continue
            if self.fs.exists(src) and self.fs.size(src) == st.st_size:
                out.append((p, src, theirs[found[0]][found[1].as_posix()], st.st_size))
        if not out:
            return []
        # A new checkpoint never inherits damage (the local link checks its source the same
        # way): the store's object is read and checksummed before the store copies it; one
        # that rotted since its upload is uploaded from the local file instead.
        with cf.ThreadPoolExecutor(min(self.threads, len(out))) as pool:
            whole = list(pool.map(lambda c: _object_whole(self.fs, *c[1:]), out))
        return [(p, src) for (p, src, _, _), ok in zip(out, whole, strict=True) if ok]

    def _copy_all(self, pairs: list[tuple[str, str]]) -> None:
        with cf.ThreadPoolExecutor(min(self.threads, len(pairs))) as pool:
            futures = [
                pool.submit(self._with_retries, dst, self.fs.copy, src, dst) for src, dst in pairs
            ]
            for fut in futures:
                fut.result()

    def _put_all(self, files: list[tuple[Path, str]], on_file: Callable[[int], None] | None) -> int:
        if not files:
            return 0
        total = 0
        with cf.ThreadPoolExecutor(min(self.threads, len(files))) as pool:
            futures = [
                pool.submit(self._with_retries, remote, self._put_one, local, remote, on_file)
                for local, remote in files
            ]
            for (local, _), fut in zip(files, futures, strict=True):
                fut.result()
                total += local.stat().st_size
        return total

    def _put_one(
        self, local: Path, remote: str, on_file: Callable[[int], None] | None = None
    ) -> None:
        self.fs.put_file(os.fspath(local), remote)
        if on_file is not None:
            # Within the attempt (its time limit): the commit order's ``mid_upload`` point
            # fires here, so a stall there is a stalled upload.
            on_file(local.stat().st_size)

    def _with_retries(self, what: str, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` with a time limit per attempt and backoff between attempts.

        An attempt that overruns ``timeout`` is abandoned (its thread cannot be killed; it is
        left to finish or fail on its own) and counts as a failure, so a stalled connection
        fails the upload clearly instead of hanging the worker.
        """
        last: BaseException | None = None
        for attempt in range(self.retries):
            pool = cf.ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-upload")
            try:
                pool.submit(fn, *args).result(timeout=self.timeout)
                return
            except cf.TimeoutError:
                last = TimeoutError(f"no answer within {self.timeout:g} s")
            except FileNotFoundError as e:  # a local file went away: retrying cannot help
                raise UploadFailed(f"uploading {what} to {self.url}: {e}") from e
            except OSError as e:  # fsspec turns the service's errors into OSErrors
                last = e
            finally:
                pool.shutdown(wait=False)
            if attempt + 1 < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise UploadFailed(
            f"uploading {what} to {self.url} failed after {self.retries} attempt(s): {last}"
        ) from last

    def write_tracker(self, layout: str, step: int) -> bool:
        """Point the store's tracker object(s) at ``step`` (after its marker); forward only.

        A PUT of a small object replaces it whole, which is what a tracker needs."""
        current = self.read_tracker()
        if (
            current is not None
            and current > step
            and self.is_committed(_layout.dir_name(layout, current))
        ):
            return False
        for tracker in _layout.tracker_names(layout):
            self._with_retries(tracker, self.fs.pipe_file, self.path(tracker), f"{step}\n".encode())
        return True

    # ---------------------------------------------------------------- read back
    def fetch(self, name: str, local_dir: Path) -> None:
        """Download committed checkpoint ``name`` into the new directory ``local_dir``."""
        if not self.is_committed(name):
            raise FileNotFoundError(f"{self.url_of(name)} is not committed (no marker)")
        local_dir.mkdir(parents=True)
        prefix = self.path(name)
        for remote in self.fs.find(prefix):
            rel = remote[len(prefix) + 1 :]
            if rel == _layout.COMMIT_MARKER:
                continue
            target = local_dir.joinpath(*rel.split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, os.fspath(target))

    def check(
        self, name: str, on_bytes: Callable[[int], None] | None = None, *, quick: bool = False
    ) -> list[str]:
        """Problems of committed checkpoint ``name`` against its manifest (empty: it verifies).

        Every file is streamed once from the store and checksummed as it arrives; ``quick``
        compares sizes only (one listing, no data read)."""

        try:
            manifest = self.read_manifest(name)
        except (OSError, ValueError) as e:
            return [f"{_layout.MANIFEST}: unreadable ({e})"]
        prefix = self.path(name)
        sizes = {  # one listing for every file's size
            p[len(prefix) + 1 :]: int(d.get("size", -1))
            for p, d in self.fs.find(prefix, detail=True).items()
        }

        def read_checksum(rel: str, algorithm: str) -> int:
            with self.fs.open(self.path(name, rel), "rb") as f:
                return checksum_stream(f, on_bytes, algorithm)[0]

        problems = []
        for rel, want in sorted(manifest.get("files", {}).items()):
            problem = entry_problem(
                rel,
                want,
                sizes.get(rel),
                None if quick else functools.partial(read_checksum, rel),
            )
            if problem is not None:
                problems.append(problem)
        return problems

    # ---------------------------------------------------------------- delete
    def retire(self, name: str) -> str:
        """Delete ``name``'s marker: from then on the checkpoint does not exist."""
        marker = self.path(name, _layout.COMMIT_MARKER)
        self.fs.invalidate_cache()
        if not self.fs.exists(marker):
            if self.fs.exists(self.path(name)):
                return name  # a crashed upload or delete: only its files are left to remove
            raise FileNotFoundError(f"{self.url_of(name)} is not a checkpoint")
        self.fs.rm_file(marker)
        return name

    def reclaim(self, retired: str) -> None:
        if self.fs.exists(self.path(retired)):
            self.fs.rm(self.path(retired), recursive=True)

    def delete(self, name: str) -> None:
        """Marker first (the checkpoint stops existing), then every other object."""
        try:
            self.reclaim(self.retire(name))
        except FileNotFoundError:
            pass  # nothing there: deleted already

    def quarantine(self, name: str, problems: list[str]) -> str:
        raise UnsupportedStorage(
            f"{self.url_of(name)}: an object store has no rename to set a checkpoint aside "
            "with; delete it (its marker goes first) or fetch it to look at it"
        )

    def lock(self, holder: str, *, wait: bool) -> int | None:
        raise UnsupportedStorage(
            f"{self.url}: an object store has no locks; one engine writes a URL root, through "
            "its local spool (which is locked)"
        )

    def leftovers(self, layout: str) -> list[str]:
        """Names of prefixes that look like checkpoints but hold no marker."""
        committed = {c.name for c in self.committed(layout)}
        try:
            entries = self.fs.ls(self.base, detail=False)
        except FileNotFoundError:
            return []
        names = (e.rstrip("/").split("/")[-1] for e in entries)
        return sorted(
            n for n in names if _layout.parse_dir_name(layout, n) is not None and n not in committed
        )

    def detect_layout(self, default: str = "global_step") -> str:
        """The layout of the store's committed checkpoints (``layout.pick_layout``'s rule:
        ``default`` if none, an error if several)."""
        names = [c.name for lay in _layout.LAYOUTS for c in self.committed(lay)]
        return _layout.pick_layout(names, self.url, default)

    def clean_leftovers(self, layout: str) -> list[str]:
        """Remove prefixes named like checkpoints but holding no marker (crashed uploads or
        deletes). Call it only where no other writer uploads to the same root."""
        removed = self.leftovers(layout)
        for name in removed:
            self.fs.rm(self.path(name), recursive=True)
        return removed


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _object_whole(fs: Any, path: str, entry: dict[str, Any], size: int) -> bool:
    """Whether the store's object at ``path`` (``size`` bytes) holds the bytes its manifest
    ``entry`` records, by the one rule ``check`` applies (streamed once and checksummed); a
    damaged or unreadable one is logged."""

    def read_checksum(algorithm: str) -> int:
        with fs.open(path, "rb") as f:
            return checksum_stream(f, None, algorithm)[0]

    try:
        problem = entry_problem(path, entry, size, read_checksum)
    except Exception as e:  # noqa: BLE001 - not copied: the local file is uploaded
        log.warning("asyncckpt: could not read %s to copy it (%s): uploaded instead", path, e)
        return False
    if problem is not None:
        log.warning(
            "asyncckpt: damaged in the store: %s. Not copied into the new step, its local "
            "file uploaded instead; the store's checkpoint holding it fails `asyncckpt verify`",
            problem,
        )
        return False
    return True


__all__ = ["FsspecStore"]

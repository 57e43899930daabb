"""The manifest: a checksum of every file of a checkpoint, and ``verify``.

Written into the temporary directory after every shard is durable and before the commit
rename, so a committed checkpoint always has one. At load, the checksums catch flipped bytes,
truncated or deleted shards (invariant 5).
"""

from __future__ import annotations

import functools
import json
import os
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from crc32c import crc32c as _crc32c

from asyncckpt.core import layout as _layout
from asyncckpt.core.paths import check_local_root
from asyncckpt.errors import CorruptCheckpoint

# The write side lives in storage/ (re-exported: ``manifest.fsync_dir`` is long-standing API).
from asyncckpt.storage.localfs import fsync_dir, fsync_file, write_synced  # noqa: F401

if TYPE_CHECKING:
    from asyncckpt.core.progress import Progress

FORMAT_VERSION = 1
_CHUNK = 8 << 20


#: The checksum new manifests record per file: CRC-32C, computed by the CPU's crc32
#: instruction (~12 GiB/s here, 4x zlib's crc32), so verifying a checkpoint at load costs a
#: fraction of reading it. Manifests written before record ``crc32`` (zlib) and still verify.
CHECKSUM = "crc32c"
_ALGORITHMS: dict[str, Callable[[Any, int], int]] = {
    "crc32c": _crc32c,
    "crc32": zlib.crc32,
}


def checksum(data: Any, value: int = 0) -> int:
    """The running CRC-32C of ``data`` after ``value`` (any bytes-like object)."""
    return _crc32c(data, value)


def checksum_file(
    path: str | os.PathLike,
    on_bytes: Callable[[int], None] | None = None,
    algorithm: str = CHECKSUM,
) -> tuple[int, int]:
    """(checksum, size) of a file.

    A large file is checksummed in parts by a few threads at once (reads and the checksum
    both release the GIL) and the parts' CRCs are combined into the whole file's: verifying a
    checkpoint at load is then bounded by the disk, not by one core. ``on_bytes(n)`` is called
    after each chunk read (progress bars), from the calling thread or a worker thread.
    """
    size = os.stat(path).st_size
    threads = _verify_threads()
    if size < 2 * _PART_BYTES or threads < 2:
        return _checksum_range(path, 0, size, algorithm, on_bytes), size
    parts = min(threads * 2, -(-size // _PART_BYTES))
    step = -(-size // parts)
    ranges = [(start, min(step, size - start)) for start in range(0, size, step)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads, thread_name_prefix="asyncckpt-verify") as pool:
        crcs = list(
            pool.map(lambda r: _checksum_range(path, r[0], r[1], algorithm, on_bytes), ranges)
        )
    crc = crcs[0]
    for (_, length), part in zip(ranges[1:], crcs[1:], strict=True):
        crc = crc_combine(crc, part, length, _POLYNOMIALS[algorithm])
    return crc, size


def _checksum_range(
    path: str | os.PathLike,
    start: int,
    length: int,
    algorithm: str,
    on_bytes: Callable[[int], None] | None,
) -> int:
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        return checksum_stream(f, on_bytes, algorithm, length)[0]


def checksum_stream(
    f: Any,
    on_bytes: Callable[[int], None] | None = None,
    algorithm: str = CHECKSUM,
    length: int | None = None,
) -> tuple[int, int]:
    """(checksum, bytes read) of a binary stream from where it stands: ``length`` bytes, or to
    its end (an object store's file, read once as it arrives)."""
    update = _ALGORITHMS[algorithm]
    crc = 0
    done = 0
    buf = bytearray(_CHUNK if length is None else min(_CHUNK, max(length, 1)))
    view = memoryview(buf)
    while length is None or done < length:
        want = len(buf) if length is None else min(len(buf), length - done)
        n = f.readinto(view[:want])
        if not n:
            break  # shorter than when it was measured: the size check reports it
        crc = update(view[:n], crc)
        done += n
        if on_bytes is not None:
            on_bytes(n)
    return crc, done


#: Files at least twice this size are checksummed in parts, in parallel.
_PART_BYTES = 64 << 20
#: The reflected CRC polynomials, for combining the parts' CRCs.
_POLYNOMIALS = {"crc32c": 0x82F63B78, "crc32": 0xEDB88320}


def _verify_threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def crc_combine(crc1: int, crc2: int, len2: int, polynomial: int) -> int:
    """The CRC of A + B from crc(A), crc(B) and len(B) (zlib's crc32_combine, for any
    reflected 32-bit CRC): crc(A) times x^(8 len2) modulo the polynomial, from a table of
    x^(2^k) (zlib 1.2.12's way: a few dozen GF(2) products, not 32x32 matrix squarings, so
    combining the parts of a file read in parallel costs microseconds)."""
    if len2 <= 0:
        return crc1
    table = _x2n_table(polynomial)
    p, k = 1 << 31, 3  # x^0; len2 bytes are 2^3 len2 bits
    while len2:
        if len2 & 1:
            p = _multmodp(table[k & 31], p, polynomial)
        len2 >>= 1
        k += 1
    return _multmodp(p, crc1, polynomial) ^ crc2


def _multmodp(a: int, b: int, polynomial: int) -> int:
    """a times b modulo the (reflected) polynomial."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ polynomial if b & 1 else b >> 1


@functools.cache
def _x2n_table(polynomial: int) -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial for k = 0..31."""
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(31):
        p = _multmodp(p, p, polynomial)
        table.append(p)
    return tuple(table)


class ChecksumMismatch(CorruptCheckpoint):
    """Files of a checkpoint failed their manifest entries while read (``problems``): damage,
    not an error of the reader or the target."""

    def __init__(self, message: str, problems: list[str]) -> None:
        super().__init__(message)
        self.problems = problems


def file_checksum(entry: dict[str, Any]) -> tuple[str, int]:
    """(algorithm, value) a manifest entry records: crc32c, or crc32 in older manifests."""
    for algorithm in _ALGORITHMS:
        if algorithm in entry:
            return algorithm, int(entry[algorithm])
    raise KeyError(f"no checksum in manifest entry {entry!r}")


#: The largest ``save(..., metadata=...)`` (its JSON): a note per checkpoint, not a data store.
METADATA_MAX_BYTES = 64 * 1024


def recorded_bytes(entry: dict[str, Any]) -> tuple[int, tuple[str, int]]:
    """What a manifest entry says of its file's bytes: (size, (algorithm, checksum)); two
    entries that say the same describe the same bytes."""
    return int(entry["size"]), file_checksum(entry)


def check_metadata(metadata: Any) -> dict[str, Any]:
    """The user's per-checkpoint metadata as it will be stored (a JSON copy: later changes to
    the caller's dict do not reach the checkpoint); raises at ``save()``, before anything is
    staged, if it is not a JSON object with str keys or is over ``METADATA_MAX_BYTES``."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (a JSON object), not {type(metadata).__name__}")
    bad = [k for k in metadata if not isinstance(k, str)]
    if bad:
        raise TypeError(f"metadata keys must be str, got {bad[0]!r}; nothing was saved")
    try:
        text = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"metadata must be JSON-serialisable (str, numbers, bool, None, lists, dicts with "
            f"str keys; no NaN): {e}; nothing was saved"
        ) from None
    if len(text.encode()) > METADATA_MAX_BYTES:
        raise ValueError(
            f"metadata is {len(text.encode()) / 1024:.0f} KiB as JSON, over the "
            f"{METADATA_MAX_BYTES // 1024} KiB limit (it lives in every manifest); save large "
            "data in the state instead; nothing was saved"
        )
    return json.loads(text)


def build_manifest(
    directory: Path,
    *,
    step: int,
    layout: str,
    fmt: str,
    metrics: dict[str, float] | None,
    run_id: str,
    known_crcs: dict[str, tuple[int, int]] | None = None,
    extra: dict[str, Any] | None = None,
    figures: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Checksum every file under ``directory``; reuse crcs computed while writing.

    ``figures`` (the save's ``SaveStats`` fields known by now: the trainer's stage, wait and
    alloc seconds and staged bytes, the worker's write and paused seconds) are recorded as
    ``manifest["stats"]``, with ``blocked_seconds`` (stage + wait + alloc),
    ``throughput_bytes_per_s`` (bytes / write seconds) and ``manifest_seconds`` (this
    checksum pass) added. ``bytes`` and ``committed_at`` stay top-level fields. The rest of the
    commit (writing this manifest, the rename, the tracker) happens after the manifest is
    written, so ``SaveStats.commit_seconds`` is not in it: ``manifest_seconds`` is the part of
    it known here. Manifests written before these figures have no ``stats``; readers
    (``asyncckpt.stats.read_stats``) show them as missing.
    """
    t0 = time.perf_counter()
    known_crcs = known_crcs or {}
    files: dict[str, dict[str, int]] = {}
    for p in sorted(directory.rglob("*")):
        if p.is_symlink() or not p.is_file():
            continue
        rel = p.relative_to(directory).as_posix()
        if rel == _layout.MANIFEST:
            continue
        size = p.stat().st_size
        known = known_crcs.get(rel)
        crc = known[0] if known is not None and known[1] == size else checksum_file(p)[0]
        files[rel] = {"size": size, CHECKSUM: crc}
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "layout": layout,
        "format": fmt,
        "committed_at": time.time(),
        "metrics": dict(metrics or {}),
        "bytes": sum(f["size"] for f in files.values()),
        "files": files,
        "run_id": run_id,
    }
    if extra:
        manifest.update(extra)
    if figures is not None:
        manifest["stats"] = _figures(figures, manifest["bytes"], time.perf_counter() - t0)
    return manifest


def _figures(figures: dict[str, float], nbytes: int, manifest_seconds: float) -> dict[str, Any]:
    stats: dict[str, Any] = dict(figures)
    stats["blocked_seconds"] = sum(
        float(figures.get(k, 0.0)) for k in ("stage_seconds", "wait_seconds", "alloc_seconds")
    )
    write = float(figures.get("write_seconds", 0.0))
    stats["throughput_bytes_per_s"] = nbytes / write if write > 0 else 0.0
    stats["manifest_seconds"] = manifest_seconds
    return stats


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    path = directory / _layout.MANIFEST
    write_synced(path, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    path = Path(directory) / _layout.MANIFEST
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{directory}: no {_layout.MANIFEST}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(f"{path}: unreadable manifest ({e})") from None


def _file_crc(path: Path, on_bytes: Callable[[int], None] | None, algorithm: str) -> int:
    return checksum_file(path, on_bytes, algorithm)[0]


def check_files(
    directory: str | os.PathLike,
    manifest: dict[str, Any],
    *,
    quick: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> list[str]:
    """Every problem found comparing the files on disk with the manifest (empty: good).

    ``quick=True`` checks that every file exists with its size and reads nothing (a truncated
    or missing shard, not a flipped byte); ``on_bytes`` is passed to ``checksum_file``."""
    directory = Path(directory)
    problems = []
    for rel, want in manifest.get("files", {}).items():
        p = directory / rel
        problem = entry_problem(
            rel,
            want,
            p.stat().st_size if p.is_file() else None,
            None if quick else functools.partial(_file_crc, p, on_bytes),
        )
        if problem is not None:
            problems.append(problem)
    return problems


def entry_problem(
    rel: str,
    want: dict[str, Any],
    size: int | None,
    read_checksum: Callable[[str], int] | None,
) -> str | None:
    """What is wrong with one file against its manifest entry, or None: ``size`` is the
    file's (None: it is missing), ``read_checksum(algorithm)`` reads it (None: sizes only).
    The one rule for every tier (local files, object stores)."""
    if size is None:
        return f"{rel}: missing"
    if size != want["size"]:
        return f"{rel}: size {size} != {want['size']} (truncated or grown)"
    if read_checksum is None:
        return None
    try:
        algorithm, expected = file_checksum(want)
    except (KeyError, TypeError, ValueError):
        return f"{rel}: the manifest records no checksum"
    crc = read_checksum(algorithm)
    if crc != expected:
        return f"{rel}: checksum mismatch ({algorithm} {crc:#010x} != {expected:#010x})"
    return None


def verify_dir(directory: str | os.PathLike) -> None:
    """Raise ``CorruptCheckpoint`` naming every problem if the directory fails its manifest."""
    manifest = read_manifest(directory)
    problems = check_files(directory, manifest)
    if problems:
        raise CorruptCheckpoint(f"{directory}: " + "; ".join(problems))


def check_dir(
    directory: str | os.PathLike,
    *,
    quick: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> list[str]:
    """``verify_dir`` as a list of problems (empty: the directory matches its manifest)."""
    try:
        manifest = read_manifest(directory)
    except CorruptCheckpoint as e:
        return [str(e)]
    return check_files(directory, manifest, quick=quick, on_bytes=on_bytes)


def manifest_bytes(manifest: dict[str, Any]) -> int:
    """Bytes a full check of this manifest reads."""
    try:
        return sum(int(f["size"]) for f in manifest.get("files", {}).values())
    except (TypeError, ValueError, KeyError, AttributeError):
        return 0


@dataclass
class CheckpointStatus:
    step: int
    path: Path
    ok: bool
    problems: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    root: Path
    layout: str
    checkpoints: list[CheckpointStatus]
    tracker_step: int | None
    tracker_problem: str | None
    leftovers: list[str]
    #: True when only sizes were compared (``verify(..., quick=True)``), no checksum read.
    quick: bool = False

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checkpoints) and self.tracker_problem is None


def verify(
    root: str | os.PathLike,
    layout: str | None = None,
    *,
    quick: bool = False,
    progress: Progress | None = None,
) -> VerifyReport:
    """Check every committed checkpoint of ``root`` against its manifest, and the tracker.

    ``quick=True`` compares sizes only (reads no data). ``progress`` (an
    ``asyncckpt.core.progress.Progress``) is told the bytes to read, each chunk read and each
    checkpoint checked; without it nothing is reported.
    """
    root = check_local_root(root)  # an s3:// URL is not an empty local directory
    layout = layout or _layout.detect_layout(root)
    dirs = _layout.scan(root, layout)
    manifests: list[dict[str, Any] | CorruptCheckpoint] = []
    for c in dirs:
        try:
            manifests.append(read_manifest(c.path))
        except CorruptCheckpoint as e:
            manifests.append(e)
    sizes = [0 if quick or isinstance(m, Exception) else manifest_bytes(m) for m in manifests]
    if progress is not None:
        progress.begin(f"verifying {root}", sum(sizes), len(dirs))
    statuses = []
    for c, manifest, size in zip(dirs, manifests, sizes, strict=True):
        read = 0

        def on_bytes(n: int) -> None:
            nonlocal read
            read += n
            if progress is not None:
                progress.advance(n)

        if isinstance(manifest, CorruptCheckpoint):
            problems = [str(manifest)]
        else:
            problems = check_files(c.path, manifest, quick=quick, on_bytes=on_bytes)
        statuses.append(CheckpointStatus(c.step, c.path, not problems, problems))
        if progress is not None:
            if size > read:  # files missing or of the wrong size: not read, but done
                progress.advance(size - read)
            progress.checkpoint_done(c.step, not problems)
    if progress is not None:
        progress.end()
    tracker_step = _layout.read_tracker(root)
    tracker_problem = None
    tracker_file = root / _layout.TRACKER
    if tracker_file.exists() and tracker_step is None:
        tracker_problem = f"{tracker_file.name} is not a step number"
    elif tracker_step is not None and tracker_step not in {s.step for s in statuses}:
        tracker_problem = f"{tracker_file.name} names step {tracker_step}, which is not committed"
    leftovers = (
        sorted(n for n in os.listdir(root) if _layout.is_leftover(n)) if root.is_dir() else []
    )
    return VerifyReport(
        root, layout, statuses, tracker_step, tracker_problem, leftovers, quick=quick
    )

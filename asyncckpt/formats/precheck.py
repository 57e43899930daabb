"""The check before a load reads anything into its target: every file against the manifest.

A load restores the whole target or changes nothing (invariant 11), so every checksum is
checked before the first byte goes into the target, and the reader then copies each file into
the targets from the page cache. What the check costs on top of reading the disk is therefore
what the load costs on top of a raw read; so the check

- reads all the files at once, in parts, by ``CHECK_THREADS`` threads (not one file after
  another: a cold disk then has several reads in flight);
- checksums the file's pages where the kernel put them (a read-only shared mapping, filled
  with ``madvise(MADV_POPULATE_READ)``), instead of copying every byte into a buffer first:
  the reader's copy into the targets is then the load's only copy, as in a raw read.

``MADV_POPULATE_READ`` (Linux 5.14) reads a range in and returns a read error as an
``OSError`` where touching a mapping would raise SIGBUS. Where a mapping or the populate is
refused (another OS, an older kernel, a filesystem without mmap) the check reads the files
with ``preadv`` into a buffer instead (``wholefiles.read_files``), says so once in the log
and counts it in ``fallbacks``: the same checksums, one more copy.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from asyncckpt.formats import wholefiles
from asyncckpt.storage.manifest import (
    _ALGORITHMS,
    _POLYNOMIALS,
    ChecksumMismatch,
    crc_combine,
    entry_problem,
    file_checksum,
)

log = logging.getLogger("asyncckpt")

#: Threads of the check: its reads wait on the disk, not on a core, so more of them than
#: cores keep the disk's queue full (a cold 512 MiB checkpoint of 64 files on a busy 2-core
#: VM: 4 threads as fast as a raw read by 4 threads, 2 threads 30% slower).
CHECK_THREADS = 4
#: Bytes populated, then checksummed, at a time: small enough that the pages just read are
#: checksummed before anything evicts them.
CHUNK_BYTES = 8 << 20

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else 0)

#: Checks that read the files through a buffer (no mapping or populate here); see the module.
fallbacks = 0
_mapping_refused = not _MADV_POPULATE_READ


@dataclass
class Checked:
    """What ``check_files`` found: ``damage`` (a file missing, of another size or checksum
    than its manifest entry: damage for certain) and ``unreadable`` (an I/O error)."""

    damage: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)

    def raise_any(self, directory: str | os.PathLike) -> None:
        """Raise ``ChecksumMismatch`` for damage, an ``OSError`` for an I/O error alone (a
        flaky mount is not damage), nothing when every file matched its entry."""
        if self.damage:
            message = f"{directory}: " + "; ".join(self.damage + self.unreadable)
            raise ChecksumMismatch(message, self.damage)
        if self.unreadable:
            raise OSError(f"{directory}: " + "; ".join(self.unreadable))


class _Refused(Exception):
    """A mapping or its populate was refused: the check reads through a buffer instead."""


@dataclass
class _Part:
    """``[start, end)`` of one open file, checksummed by one thread."""

    name: str
    fd: int
    size: int
    start: int
    end: int
    update: Callable[[Any, int], int]
    crc: int = 0
    error: OSError | None = None


def check_files(
    directory: str | os.PathLike,
    files: Mapping[str, Any],
    *,
    on_bytes: Callable[[int], None] | None = None,
    threads: int = CHECK_THREADS,
) -> Checked:
    """Check ``files`` (name in ``directory`` -> manifest entry) against their entries: every
    byte read once, all files at once, checksummed in place (see the module). ``on_bytes(n)``
    after each piece checked, from any thread (a progress bar)."""
    global fallbacks, _mapping_refused

    out = Checked()
    opened: dict[str, tuple[int, int, Any]] = {}  # name -> (fd, size, entry)
    try:
        for name, want in files.items():
            try:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            except FileNotFoundError:
                out.damage.append(entry_problem(name, want, None, None) or name)
                continue
            except OSError as e:
                out.unreadable.append(f"{name}: {e}")
                continue
            size = os.fstat(fd).st_size
            opened[name] = (fd, size, want)
            problem = entry_problem(name, want, size, None)  # sizes first: nothing to read
            if problem is not None:
                out.damage.append(problem)
                del opened[name]
                os.close(fd)
        if not _mapping_refused:
            try:
                _check_mapped(opened, out, on_bytes, threads)
                return out
            except _Refused as e:
                _mapping_refused = True
                log.info("checking checkpoint files through a buffer: %s", e)
        fallbacks += 1
        _check_read(opened, out, on_bytes, threads)
        return out
    finally:
        for fd, _, _ in opened.values():
            os.close(fd)


def _parts(opened: Mapping[str, tuple[int, int, Any]]) -> list[_Part]:
    parts = []
    for name, (fd, size, want) in opened.items():
        update = _ALGORITHMS.get(_algorithm(want), _ALGORITHMS["crc32c"])
        if not size:
            continue  # nothing to read: the checksum of no bytes is 0
        n = -(-size // wholefiles.PART_BYTES)
        step = -(-size // n)
        parts += [
            _Part(name, fd, size, s, min(s + step, size), update) for s in range(0, size, step)
        ]
    return parts


def _algorithm(want: Any) -> str:
    try:
        return file_checksum(want)[0]
    except (KeyError, TypeError, ValueError):
        return "crc32c"  # entry_problem names the missing checksum


def _check_mapped(
    opened: Mapping[str, tuple[int, int, Any]],
    out: Checked,
    on_bytes: Callable[[int], None] | None,
    threads: int,
) -> None:
    parts = _parts(opened)
    workers = max(1, min(threads, len(parts)))
    with ThreadPoolExecutor(workers, thread_name_prefix="asyncckpt-check") as pool:
        done = list(pool.map(lambda p: _checksum_mapped(p, on_bytes), parts))
    if any(isinstance(d, _Refused) for d in done):
        raise next(d for d in done if isinstance(d, _Refused))
    for name, (fd, size, want) in opened.items():
        mine = [p for p in parts if p.name == name]
        failed = next((p.error for p in mine if p.error is not None), None)
        if failed is not None:
            if os.fstat(fd).st_size != size:  # cut short while it was read
                out.damage.append(f"{name}: shorter than its {size} bytes (truncated)")
            else:
                out.unreadable.append(f"{name}: {failed}")
            continue
        crc = mine[0].crc if mine else 0
        for p in mine[1:]:
            crc = crc_combine(crc, p.crc, p.end - p.start, _POLYNOMIALS[_algorithm(want)])
        problem = entry_problem(name, want, size, wholefiles._known(crc))
        if problem is not None:
            out.damage.append(problem)


def _checksum_mapped(part: _Part, on_bytes: Callable[[int], None] | None) -> _Refused | None:
    """Checksum ``part`` through a read-only mapping; a refused mapping is returned (the
    check falls back), a read error kept in ``part.error``."""
    try:
        mapped = mmap.mmap(part.fd, part.end, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    except OSError as e:
        return _Refused(f"mmap: {e}")
    view = memoryview(mapped)
    try:
        for lo in range(part.start, part.end, CHUNK_BYTES):
            hi = min(part.end, lo + CHUNK_BYTES)
            page = lo - lo % mmap.PAGESIZE
            try:
                mapped.madvise(_MADV_POPULATE_READ, page, hi - page)
            except OSError as e:
                if e.errno == errno.EINVAL and lo == part.start:
                    return _Refused(f"madvise(MADV_POPULATE_READ): {e}")
                part.error = e  # EIO, or EFAULT for a file cut short meanwhile
                return None
            part.crc = part.update(view[lo:hi], part.crc)
            if on_bytes is not None:
                on_bytes(hi - lo)
    finally:
        # (A file cut short between a populate and its checksum would raise SIGBUS there:
        # committed files are never truncated, and the window is one chunk's checksum.)
        view.release()
        mapped.close()
    return None


def _check_read(
    opened: Mapping[str, tuple[int, int, Any]],
    out: Checked,
    on_bytes: Callable[[int], None] | None,
    threads: int,
) -> None:
    """The fallback: ``wholefiles.read_files`` with no spans (into its scratch buffers)."""
    reads = [
        wholefiles.FileRead(name, fd, size, want=want) for name, (fd, size, want) in opened.items()
    ]
    errors: dict[str, OSError] = {}
    problems = wholefiles.read_files(reads, threads, on_bytes=on_bytes, errors=errors)
    out.damage += problems.values()
    out.unreadable += [str(e) for e in errors.values()]


#: The check of the load in this context still running (``Pending``): a reader waits for it
#: (``before_target``) before its first byte goes into a target.
_pending: contextvars.ContextVar[Pending | None] = contextvars.ContextVar(
    "asyncckpt_pending_check", default=None
)


class Pending:
    """A check run on a thread of its own while the load plans and locates its records (a
    disk-bound check and CPU-bound planning overlap). Invariant 11 holds because the reader
    waits for it (``before_target``) before writing a target, and ``gating`` waits for it in
    any case; its error is the load's."""

    def __init__(self, check: Callable[[], None]) -> None:
        self._check = check
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncckpt-precheck", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._check()
        except BaseException as e:  # noqa: BLE001 - raised in the load's thread (wait)
            self.error = e

    def wait(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error


def before_target() -> None:
    """Called by a reader before its first byte goes into a target: the check of this load,
    if it still runs on a thread of its own, has passed (else its error is raised)."""
    pending = _pending.get()
    if pending is not None:
        pending.wait()


@contextlib.contextmanager
def gating(pending: Pending | None) -> Iterator[None]:
    """Around the reads of a load whose check is ``pending``: readers wait for it before
    writing a target; at the end it is waited for in any case, and a failed check is the
    load's error (not what a reader made of it: DCP wraps what a reader raises)."""
    if pending is None:
        yield
        return
    token = _pending.set(pending)
    try:
        yield
    except BaseException:
        pending._thread.join()
        if pending.error is not None:
            raise pending.error from None
        raise
    finally:
        _pending.reset(token)
    pending.wait()

"""Reading a checkpoint's files once, whole, checked as they are read.

A cold load used to read every file twice: a checksum pass over the files (the manifest),
then the reader's pass into the targets (from the page cache if it still held them). Here each
file is read once with large scatter reads (``preadv``) straight into the places its bytes
belong (a target tensor's memory, a record's buffer), in parts by a few threads, and the
checksum of each part is computed on the bytes just read (still in the CPU's cache) and
combined into the file's. The caller compares the result with the manifest before it applies
anything else of the checkpoint.

A destination is a ``memoryview`` of host bytes, or a ``uint8`` tensor on an accelerator
(read through a reused pinned buffer per thread, then copied across), or None: bytes of the
file nobody asked for (record headers, another rank's data), read only to check the file.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncckpt.formats.records import tensor_bytes
from asyncckpt.storage.manifest import (
    _ALGORITHMS,
    _POLYNOMIALS,
    crc_combine,
    entry_problem,
    file_checksum,
)

#: Bytes one ``preadv`` asks for at most (and then checksums, still in cache).
CHUNK_BYTES = 8 << 20
#: A file is read in parts of about this size, by several threads at once.
PART_BYTES = 64 << 20
#: Buffers one ``preadv`` fills at most (below every system's IOV_MAX).
MAX_IOV = 512


def read_threads() -> int:
    """Threads reading at once: reads and the checksum release the GIL; a few are enough to
    keep a disk's queue full."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(2, min(4, cpus))


@dataclass
class Span:
    """``offset`` of the file goes to ``dst``; ``filled``: ``dst`` already holds those
    bytes (read before, to recognise a record): only checksummed, in its place."""

    offset: int
    dst: Any  # memoryview of host bytes, or a uint8 tensor on an accelerator
    filled: bool = False

    @property
    def length(self) -> int:
        return self.dst.numel() if isinstance(self.dst, torch.Tensor) else len(self.dst)


@dataclass
class FileRead:
    """One file to read: ``spans`` (any order, none overlapping, inside ``size``). With
    ``want`` (the file's manifest entry) every byte is read and checksummed; without, only
    the spans are read."""

    name: str
    fd: int
    size: int
    spans: list[Span] = field(default_factory=list)
    want: dict[str, Any] | None = None


def _pieces(f: FileRead) -> list[tuple[int, int, Any, bool]]:
    """(offset, length, dst or None, filled) covering the whole file in order."""
    out: list[tuple[int, int, Any, bool]] = []
    at = 0
    for s in sorted(f.spans, key=lambda s: s.offset):
        n = s.length
        if s.offset < at or s.offset + n > f.size:
            raise ValueError(f"{f.name}: a record at {s.offset} overlaps another or the end")
        if s.offset > at:
            out.append((at, s.offset - at, None, False))
        if n:
            out.append((s.offset, n, s.dst, s.filled))
        at = s.offset + n
    if at < f.size:
        out.append((at, f.size - at, None, False))
    return out


class _Part:
    """A range ``[start, end)`` of a file, read by one thread; ``crc`` of its bytes."""

    def __init__(
        self,
        f: FileRead,
        start: int,
        end: int,
        update: Callable | None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.f, self.start, self.end, self.update = f, start, end, update
        self.on_bytes = on_bytes  # told the bytes of each read (a progress bar)
        self.crc = 0
        self.short = False  # the file ended before ``end``
        self.error: OSError | None = None  # the read failed (an I/O error, not damage)


_local = threading.local()


def _buffer(name: str, pinned: bool) -> torch.Tensor:
    """This thread's reused buffer of ``CHUNK_BYTES`` (pinned: for an accelerator's bytes)."""
    buf = getattr(_local, name, None)
    if buf is None:
        buf = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        buf = buf.pin_memory() if pinned else buf
        setattr(_local, name, buf)
    return buf


class _Batch:
    """Pieces read by one ``preadv`` (at most ``CHUNK_BYTES``, ``MAX_IOV`` buffers), then
    checksummed in file order; bytes nobody keeps land in this thread's scratch buffer, an
    accelerator's in its pinned buffer and are copied across after the read."""

    def __init__(self, part: _Part, at: int) -> None:
        self.part, self.at = part, at
        self.views: list[memoryview] = []
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.nbytes = self.scratch = self.pinned = 0

    def room(self) -> int:
        return 0 if len(self.views) >= MAX_IOV else CHUNK_BYTES - self.nbytes

    def add(self, dst: Any, lo: int, hi: int) -> None:
        n = hi - lo
        if dst is None:
            buf = _buffer("scratch", False)[self.scratch : self.scratch + n]
            self.views.append(tensor_bytes(buf))
            self.scratch += n
        elif isinstance(dst, torch.Tensor):
            buf = _buffer("pinned", True)[self.pinned : self.pinned + n]
            self.views.append(tensor_bytes(buf))
            self.copies.append((dst[lo:hi], buf))
            self.pinned += n
        else:
            self.views.append(dst[lo:hi])
        self.nbytes += n

    def flush(self) -> int:
        """Read and checksum the batch; the file offset after it (-1: the file ended)."""
        part, done = self.part, 0
        while done < self.nbytes:
            got = os.preadv(part.f.fd, _skip(self.views, done), self.at + done)
            if got <= 0:
                part.short = True
                return -1
            done += got
        if part.update is not None:
            for view in self.views:
                part.crc = part.update(view, part.crc)
        for dst, buf in self.copies:
            dst.copy_(buf)  # synchronous: the pinned buffer is reused by the next batch
        if part.on_bytes is not None and self.nbytes:
            part.on_bytes(self.nbytes)
        return self.at + self.nbytes


def _read_part(part: _Part) -> None:
    try:
        _read_part_spans(part)
    except OSError as e:  # kept for read_files, which names the file
        part.error = e


def _read_part_spans(part: _Part) -> None:
    batch = _Batch(part, part.start)
    for offset, length, dst, filled in _pieces(part.f):
        lo, hi = max(offset, part.start), min(offset + length, part.end)
        if lo >= hi:
            continue
        if filled or (dst is None and part.update is None):
            # Bytes already here (checksummed in their place, in order) or bytes nobody
            # wants and no checksum needs (skipped): the batch so far is read first.
            if batch.flush() < 0:
                return
            if filled and part.update is not None:
                part.crc = part.update(dst[lo - offset : hi - offset], part.crc)
            batch = _Batch(part, hi)
            continue
        a = lo
        while a < hi:
            b = min(hi, a + batch.room())
            if b > a:
                batch.add(dst, a - offset, b - offset)
                a = b
            if not batch.room():
                at = batch.flush()
                if at < 0:
                    return
                batch = _Batch(part, at)
    batch.flush()


def _skip(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes (after a short read)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def read_files(
    files: Sequence[FileRead],
    threads: int | None = None,
    *,
    on_bytes: Callable[[int], None] | None = None,
    errors: dict[str, OSError] | None = None,
) -> dict[str, str]:
    """Read every file into its spans, in parallel parts; returns the problems found against
    the files' manifest entries (name -> problem; empty: every checked file matched).

    A read that fails (an I/O error: not damage for certain) raises an ``OSError`` naming
    the file once every part has ended, or, with ``errors``, is put there (name -> error)
    and the other files are still checked. ``on_bytes(n)`` after each read, from any thread.
    """
    parts: list[_Part] = []
    for f in files:
        update = None
        if f.want is not None:
            try:
                update = _ALGORITHMS[file_checksum(f.want)[0]]
            except (KeyError, TypeError, ValueError):
                update = _ALGORITHMS["crc32c"]  # entry_problem names the missing checksum
        n = max(1, -(-f.size // PART_BYTES))
        step = -(-f.size // n) if f.size else 0
        starts = range(0, f.size, step) if step else [0]
        parts += [
            _Part(f, s, min(s + step, f.size) if step else 0, update, on_bytes) for s in starts
        ]
    workers = min(threads or read_threads(), len(parts))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="asyncckpt-read") as pool:
            list(pool.map(_read_part, parts))
    else:
        for p in parts:
            _read_part(p)
    problems: dict[str, str] = {}
    for f in files:
        mine = [p for p in parts if p.f is f]
        failed = next((p.error for p in mine if p.error is not None), None)
        if failed is not None:
            named = OSError(failed.errno, f"{f.name}: {failed.strerror or failed}")
            if errors is None:
                raise named from failed
            errors[f.name] = named
            continue
        if any(p.short for p in mine):
            problems[f.name] = f"{f.name}: shorter than its {f.size} bytes (truncated)"
            continue
        if f.want is None:
            continue
        try:
            algorithm = file_checksum(f.want)[0]
        except (KeyError, TypeError, ValueError):
            algorithm = "crc32c"
        crc = mine[0].crc
        for p in mine[1:]:
            crc = crc_combine(crc, p.crc, p.end - p.start, _POLYNOMIALS[algorithm])
        problem = entry_problem(f.name, f.want, f.size, _known(crc))
        if problem is not None:
            problems[f.name] = problem
    return problems


def _known(crc: int) -> Callable[[str], int]:
    """``entry_problem``'s ``read_checksum`` for a checksum computed already."""
    return lambda _algorithm: crc

"""Shard files written with ``O_DIRECT``: the checkpoint bypasses the page cache.

A buffered write copies every byte into the page cache, then kernel flusher threads (at full
priority, on any core, the trainer's included) write it back later, and the cache fills with
gigabytes nobody will read again. With ``O_DIRECT`` the bytes go from one small page-aligned
bounce buffer, reused for the whole file, straight to the device, inside the (throttled) worker
process: less memory traffic for the training to compete with, no writeback work elsewhere and
no page-cache growth. ``O_DIRECT`` wants aligned addresses, offsets and lengths; the bounce
buffer provides all three, and the last partial block is written padded and then truncated.

Where ``O_DIRECT`` is refused (tmpfs before Linux 6.6, some network filesystems, macOS)
``open_for_write`` falls back to a plain buffered file, and a ``DirectFile`` whose write is
refused (EINVAL: a stricter alignment, FUSE) clears ``O_DIRECT`` and goes on through the page
cache: the checkpoint is the same bytes either way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import mmap
import os
from pathlib import Path
from typing import Any, BinaryIO

log = logging.getLogger("asyncckpt.directio")

#: Offsets and lengths of O_DIRECT writes are multiples of this (covers 512 and 4K devices).
ALIGN = 4096
#: Bounce buffer per open file: fits the worker core's L2 cache, so the checksum of each piece
#: reads it from cache, and is large enough that one write call moves plenty of bytes.
BOUNCE_BYTES = 1 << 20

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectFile(io.RawIOBase):
    """A write-only file opened with ``O_DIRECT``, fed through a page-aligned bounce buffer.

    ``write`` accepts any bytes-like object of any length; ``tell`` is the logical size.
    ``close`` writes the last partial block and truncates the padding away. On an error the
    caller calls ``abort`` (or ``close``, which then skips the tail write).
    """

    def __init__(self, path: str | os.PathLike, *, buffer_bytes: int = BOUNCE_BYTES) -> None:
        super().__init__()
        if buffer_bytes < ALIGN or buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes must be a multiple of {ALIGN}, got {buffer_bytes}")
        if not _O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT
        self._fd = os.open(path, flags, 0o644)
        self.name = str(path)
        self._buf = mmap.mmap(-1, buffer_bytes)  # anonymous mmap: page-aligned
        self._view = memoryview(self._buf)
        self._fill = 0
        self._size = 0
        self._failed = False
        self.direct = True  # False once a refused write made it fall back to the page cache

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._size

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError("write to closed DirectFile")
        src = memoryview(data).cast("B")
        n = len(src)
        cap = len(self._view)
        done = 0
        try:
            while done < n:
                take = min(cap - self._fill, n - done)
                self._view[self._fill : self._fill + take] = src[done : done + take]
                self._fill += take
                done += take
                if self._fill == cap:
                    self._write_out(cap)
                    self._fill = 0
        except BaseException:
            self._failed = True
            raise
        self._size += n
        return n

    def _write_out(self, length: int) -> None:
        # For regular files a short O_DIRECT write only happens on errors such as a full disk;
        # retry the aligned remainder so the kernel reports the real error.
        off = 0
        while off < length:
            try:
                written = os.write(self._fd, self._view[off:length])
            except OSError as exc:
                # Some filesystems accept O_DIRECT at open and refuse the write (a stricter
                # alignment, FUSE): go on through the page cache rather than fail the save.
                if exc.errno != errno.EINVAL or not self._drop_o_direct():
                    raise
                continue
            if written <= 0 or (self.direct and written % ALIGN):
                raise OSError(errno.EIO, f"short O_DIRECT write to {self.name} ({written} bytes)")
            off += written

    def _drop_o_direct(self) -> bool:
        """Clear O_DIRECT on the open file; False if it was already cleared."""
        if not self.direct:
            return False
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
        self.direct = False
        log.info("O_DIRECT write refused for %s; writing through the page cache", self.name)
        return True

    def flush(self) -> None:
        # Whole blocks are already on their way; the tail is written by close (it needs padding).
        pass

    def abort(self) -> None:
        """Close without writing the buffered tail (the file is being thrown away)."""
        self._failed = True
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._failed and self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN
                self._view[self._fill : padded] = bytes(padded - self._fill)
                self._write_out(padded)
                os.ftruncate(self._fd, self._size)
        finally:
            self._fill = 0
            os.close(self._fd)
            super().close()
            # A failed write's traceback may still hold a slice of the buffer; then the mmap is
            # freed with the last reference instead of here.
            with contextlib.suppress(BufferError):
                self._view.release()
                self._buf.close()


def open_for_write(path: str | os.PathLike, *, direct: bool) -> io.RawIOBase | BinaryIO:
    """A binary file for a shard: ``DirectFile`` if asked and the filesystem allows it, else
    a buffered file (with a 1 MiB buffer)."""
    if direct and _O_DIRECT:
        try:
            return DirectFile(path)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            log.info("O_DIRECT refused for %s (%s); writing through the page cache", path, exc)
    return open(Path(path), "wb", buffering=1 << 20)

"""Progress of long reads (``verify``, the check ``prune`` makes before deleting).

The library stays quiet: ``verify(root)`` and ``prune(...)`` report nothing unless given a
``Progress``. The CLI passes a ``RichProgress``, a bar on stderr that shows only on a terminal
(disabled in pipes, files and tests) and disappears when done, so output stays clean.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncckpt.core.layout import TMP_PREFIX

__all__ = ["Progress", "RichProgress", "BytesReadSince", "DrainProgress"]


class Progress:
    """Receives progress; every method is a no-op here (subclass what you need).

    Order of calls: ``begin`` once per run of checks with the bytes and checkpoints it will read,
    then ``advance`` as bytes are read (about every 8 MiB, and once per checkpoint to make up
    the bytes of files found missing or of the wrong size), ``checkpoint_done`` after each
    checkpoint, and ``end``.
    """

    def begin(self, description: str, total_bytes: int, total_checkpoints: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def checkpoint_done(self, step: int, ok: bool) -> None:
        pass

    def end(self) -> None:
        pass


class RichProgress(Progress):
    """A rich progress bar on ``console`` (default: stderr); off unless it is a terminal.

    Use as a context manager around the calls that report to it.
    """

    def __init__(self, console: Any = None, *, transient: bool = True) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as _Bar

        self.console = console if console is not None else Console(stderr=True)
        self._bar = _Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=transient,
            disable=not self.console.is_terminal,
        )
        self._task: Any = None

    def __enter__(self) -> RichProgress:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.stop()

    def begin(self, description: str, total_bytes: int, total_checkpoints: int) -> None:
        if self._task is not None:
            self._bar.remove_task(self._task)
        self._task = self._bar.add_task(description, total=max(total_bytes, 1))

    def advance(self, nbytes: int) -> None:
        if self._task is not None:
            self._bar.advance(self._task, nbytes)

    def end(self) -> None:
        if self._task is not None:
            self._bar.remove_task(self._task)
            self._task = None


def io_counter(name: str, pid: int | str = "self") -> int | None:
    """A counter of ``/proc/<pid>/io`` (``rchar``, ``wchar``: bytes passed to read/write
    calls, page cache included); None where there is none (not Linux, no permission)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == name:
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


class _Poll:
    """Calls ``report(counter now - counter at start)`` every ``interval`` s until ``stop``."""

    def __init__(
        self, read: Callable[[], int | None], report: Callable[[int], None], interval: float
    ) -> None:
        self._read, self._report, self._interval = read, report, interval
        self._start = read()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._start is not None:
            self._thread = threading.Thread(
                target=self._run, name="asyncckpt-progress", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            now = self._read()
            if now is None or self._start is None:
                return
            self._report(max(0, now - self._start))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)


class BytesReadSince(_Poll):
    """The bytes this process has read since it was made, to ``report`` every ``interval`` s
    (a load's read, which reports no progress of its own); nothing where there is no count."""

    def __init__(self, report: Callable[[int], None], interval: float = 0.2) -> None:
        super().__init__(lambda: io_counter("rchar"), report, interval)


#: close() shows its bar only once it has waited this long (a quick close stays silent).
DRAIN_BAR_AFTER_S = 1.0


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _tmp_bytes(root: Path) -> int:
    """Bytes in the root's temporaries (``.tmp-*``): what the worker has written so far of
    the checkpoints it is writing (they are renamed into place at their commit)."""

    total = 0
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(TMP_PREFIX)]
    except OSError:
        return 0
    for entry in entries:
        for dirpath, _, files in os.walk(entry.path):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except OSError:  # committed (renamed) or removed meanwhile
                    pass
    return total


class DrainProgress:
    """A bar on stderr while ``close()`` (leaving ``async with engine:``) waits for staged
    saves to commit: bytes written of the staged bytes in flight, and the time waited. Shown
    on a terminal only (``console``'s ``is_terminal``), gone when the wait ends."""

    def __init__(self, root: Path, jobs: dict[int, tuple[int, int]], console: Any = None) -> None:
        from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as _Bar

        self.root = root
        self.jobs = dict(jobs)  # job id -> (step, staged bytes)
        self._done: set[int] = set()
        self._lock = threading.Lock()
        console = console if console is not None else _stderr_console()
        self._bar = _Bar(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        )
        steps = ", ".join(str(step) for step, _ in sorted(self.jobs.values()))
        self.total = max(1, sum(n for _, n in self.jobs.values()))
        self._task = self._bar.add_task(
            f"close: waiting for step {steps} to commit", total=self.total
        )
        self._bar.start()
        self._poll = _Poll(lambda: 0, lambda _: self._refresh(), 0.25)

    def in_flight(self, job_ids: set[int]) -> None:
        """The jobs still in flight (the others have committed or failed)."""
        with self._lock:  # cheap: the caller holds the engine's lock; the poll does the rest
            self._done |= set(self.jobs) - job_ids

    def _refresh(self) -> None:
        with self._lock:
            done = sum(self.jobs[j][1] for j in self._done)
        written = done + (_tmp_bytes(self.root) if len(self._done) < len(self.jobs) else 0)
        self._bar.update(self._task, completed=min(written, self.total))

    def close(self) -> None:
        self._poll.stop()
        self._bar.stop()

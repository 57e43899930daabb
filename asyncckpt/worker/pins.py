"""The worker's side of ``engine.protect`` (the trainer's is trainer/pins.py): the steps every
prune of this worker keeps (``WorkerPins``), and the service that applies a pin the moment it
arrives, also while a save is written (``Pins``)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

from asyncckpt.core import messages as M
from asyncckpt.memory.service import WorkerService


class WorkerPins:
    """The worker's side: the steps pinned since it started, those being loaded by its
    trainer now, and the lock its prunes hold. The reader thread hands each message over
    (``submit``) and goes on: it must never wait for a prune (the arenas and drops behind
    it would wait too); a thread of its own applies them in order and answers. A ``Protect``
    counts from the moment the reader read it (``arriving``): a job read after it may be
    written and pruned before that thread ran, and the trainer does not wait for the word
    when no job went before the pin (trainer/pins.py)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: set[int] = set()
        self.reading: dict[int, int] = {}  # step -> loads of it in progress
        self.arriving: dict[int, int] = {}  # step -> Protects read, not applied yet
        self._arrival = threading.Lock()  # (held for a dict update only: the reader takes it)
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, msg: Any, events: Any) -> None:
        """A ``Protect`` or ``Unprotect`` from the trainer (the reader thread: never waits)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._apply, args=(events,), name="asyncckpt-pins", daemon=True
            )
            self._thread.start()
        if isinstance(msg, M.Protect):
            with self._arrival:
                self.arriving[msg.step] = self.arriving.get(msg.step, 0) + 1
        self._todo.put(msg)

    def _apply(self, events: Any) -> None:
        while True:
            msg = self._todo.get()
            self.on(msg)
            if isinstance(msg, M.Protect):
                events.send(M.Protected(msg.step))

    def kept(self) -> tuple[int, ...]:
        """The steps pinned now (the remote tier's prune, never run beside a local one)."""
        with self.lock:
            return self._kept()

    def _kept(self) -> tuple[int, ...]:
        with self._arrival:
            arriving = set(self.arriving)
        return tuple(sorted(self.steps | set(self.reading) | arriving))

    def on(self, msg: Any) -> None:
        """Apply a ``Protect`` (or its end, ``Unprotect``): waits for a prune running now."""
        with self.lock:
            if isinstance(msg, M.Unprotect):
                left = self.reading.get(msg.step, 0) - 1
                if left > 0:
                    self.reading[msg.step] = left
                else:
                    self.reading.pop(msg.step, None)
            else:
                if msg.while_read:
                    self.reading[msg.step] = self.reading.get(msg.step, 0) + 1
                else:
                    self.steps.add(msg.step)
                with self._arrival:  # (applied: it counts as such from now on)
                    left = self.arriving.get(msg.step, 0) - 1
                    if left > 0:
                        self.arriving[msg.step] = left
                    else:
                        self.arriving.pop(msg.step, None)

    @contextlib.contextmanager
    def pruning(self) -> Iterator[tuple[int, ...]]:
        """Held for a whole prune (plan and deletions); yields the steps it must keep."""
        with self.lock:
            yield self._kept()


class Pins(WorkerService):
    """``engine.protect`` reaching the worker: a ``Protect`` or ``Unprotect`` from the reader
    thread, applied at once by ``pins``' thread, also while a save is written, never behind
    it (the main loop's prunes hold ``pins``' lock)."""

    def __init__(self, pins: WorkerPins, events: Any) -> None:
        self.pins = pins
        self.events = events

    def on_message(self, msg: object) -> bool:
        if not isinstance(msg, (M.Protect, M.Unprotect)):
            return False
        self.pins.submit(msg, self.events)
        return True

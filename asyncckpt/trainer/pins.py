"""``engine.protect(step)`` reaching a prune already on its way.

A save's prune request carries the steps pinned when the save was handed to the worker
(``saving.prune_request``); a ``protect`` called after that, while the save was written,
never reached its prune, which deleted the step the caller had just protected. So the pin
is also sent to the worker (``Protect``), whose reader thread hands it at once, also while
a save is being written, to a thread that adds it to the steps every prune of that worker
keeps (``WorkerPins``, the worker's side: worker/pins.py); ``protect`` returns once the worker said so (``Protected``). The
worker prunes holding the same lock, so a prune is either over when the pin lands or sees
it. A load pins the step it reads the same way, until it is over (``Pins.kept_while_read``).

The word is waited for only where a prune may be on its way: a job was handed to the worker
before the pin. The worker reads its pipe in order and prunes only as part of a job, and it
counts a pin from the moment it read it (``WorkerPins.arriving``); so with no job handed
before, every prune comes after the pin and keeps its step, and the pin is sent without
waiting. A load inside a freshly started engine (its worker still importing torch, seconds)
then reads at disk speed.

Other processes (``python -m asyncckpt prune``) see the engine's pins in a file under the
root while the engine runs (``Pins.publish``, pinfile.py); a load's pin stays in the worker.

Not covered: only this rank's worker hears of a pin, and on a shared root only rank 0's
worker prunes (call ``protect`` on every rank; another rank's load is not pinned there).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from asyncckpt.core import messages as M
from asyncckpt.staging.stager import Link
from asyncckpt.storage import pinfile

log = logging.getLogger("asyncckpt")

#: Seconds ``protect`` waits for the worker's word at most; then it says so and returns
#: (the pin still holds for every save handed over from then on).
PROTECT_WAIT_S = 60.0


class PinsWorker(Protocol):
    """What the pins need of the worker's supervisor (``supervisor.WorkerSupervisor``)."""

    @property
    def link(self) -> Link: ...

    @property
    def reader(self) -> threading.Thread | None: ...

    def sending(self) -> contextlib.AbstractContextManager[None]: ...


class Pins:
    """The trainer's side: the steps ``engine.protect`` pinned (``steps``: every save's prune
    request carries them), handed to the running worker and published under the root."""

    def __init__(
        self,
        root: Path,
        rank: int,
        worker: PinsWorker,
        words: M.WordWait,
        is_started: Callable[[], bool],
        handed: Callable[[], bool] = lambda: True,
    ) -> None:
        self.root = root
        self.rank = rank
        self.worker = worker
        self.words = words
        self.is_started = is_started
        # Whether a job (which may prune) was handed to a worker: asked while sending the
        # pin, so that a job handed after it is read after it. True: always wait.
        self.handed = handed
        self.steps: set[int] = set()  # engine.protect(step): never pruned

    def protect(self, step: int) -> None:
        """``engine.protect``: every later save's prune keeps ``step``, the worker's prunes of
        saves already handed to it, and other processes' (``python -m asyncckpt prune``)."""
        self.steps.add(step)
        if self.is_started():  # (else at the start: the root is not the engine's before)
            self.publish()
        self.protect_in_worker(step)

    def protect_in_worker(self, step: int, *, while_read: bool = False) -> Link | None:
        """Hand ``step``'s pin to the running worker and wait for its word if a job went
        before it (the trainer's side of ``engine.protect``; see the module); nothing to do
        before the start (every request carries it).
        ``while_read``: until ``Unprotect`` (a load of it). Returns the worker link it was sent
        on (None: not sent), whether or not the word came in time."""
        if not self.is_started():
            return None
        link = self.worker.link
        try:
            with self.worker.sending():
                first = not self.handed()  # (no job can be sent meanwhile: we hold the pipe)
                link.unprotected.add(step)
                M.send(link.conn, M.encode(M.Protect(step, while_read)))
        except OSError:  # the worker is dead: saves it had fail; the next requests carry the pin
            link.unprotected.discard(step)
            return None
        if first:
            return link  # every prune of that worker comes with a job sent after the pin
        if threading.current_thread() is self.worker.reader:
            return link  # (an on_commit callback: the word comes on this very thread)
        if self.words.wait_for_word(link, lambda: step in link.unprotected, PROTECT_WAIT_S):
            log.warning(
                "the worker did not confirm protect(%d) in %.0f s: a save already handed to it "
                "may still prune that step (saves from now on keep it)",
                step,
                PROTECT_WAIT_S,
            )
        return link

    def publish(self) -> None:
        """The engine's pins (``steps``) where other processes see them, while it holds the
        root: at its start and at each ``protect``."""
        try:
            pinfile.publish(self.root, self.rank, self.steps)
        except OSError as e:  # protect still holds in this engine's own prunes
            log.warning(
                "could not record the protected steps %s under %s (%s): `python -m asyncckpt "
                "prune` run beside this engine does not know of them",
                sorted(self.steps),
                self.root,
                e,
            )

    def withdraw(self) -> None:
        """At the engine's stop, before it lets go of the root: its pins end with it."""
        try:
            pinfile.withdraw(self.root, self.rank)
        except OSError as e:  # (ignored anyway once the engine's lock is free)
            log.debug("could not remove the pins file under %s: %s", self.root, e)

    @contextlib.contextmanager
    def kept_while_read(self, step: int) -> Iterator[None]:
        """No prune of the running worker deletes ``step`` while the block reads it (invariant
        3: a load of an older step while a save commits and prunes it failed half-way)."""
        link = self.protect_in_worker(step, while_read=True)
        try:
            yield
        finally:  # (also when its word came late: the pin it sent must end)
            if link is not None and link is self.worker.link:
                with contextlib.suppress(OSError), self.worker.sending():
                    M.send(link.conn, M.encode(M.Unprotect(step)))

"""``engine.protect(step)`` reaching a prune already on its way.

A save's prune request carries the steps pinned when the save was handed to the worker
(``saving.prune_request``); a ``protect`` called after that, while the save was written,
never reached its prune, which deleted the step the caller had just protected. So the pin
is also sent to the worker (``Protect``), where its reader thread adds it at once, also
while a save is being written, to the steps every prune of that worker keeps
(``WorkerPins``); ``protect`` returns once the worker said so (``Protected``). The worker
prunes holding the same lock, so a prune is either over when the pin lands or sees it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from . import messages as M

log = logging.getLogger("asyncckpt")

#: Seconds ``protect`` waits for the worker's word at most; then it says so and returns
#: (the pin still holds for every save handed over from then on).
PROTECT_WAIT_S = 60.0


class WorkerPins:
    """The worker's side: the steps pinned since it started, those being loaded by its
    trainer now, and the lock its prunes hold."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: set[int] = set()
        self.reading: dict[int, int] = {}  # step -> loads of it in progress

    def on(self, msg: Any) -> None:
        """A ``Protect`` (or its end, ``Unprotect``), from the reader thread: waits for a
        prune running now to end."""
        with self.lock:
            if isinstance(msg, M.Unprotect):
                left = self.reading.get(msg.step, 0) - 1
                if left > 0:
                    self.reading[msg.step] = left
                else:
                    self.reading.pop(msg.step, None)
            elif msg.while_read:
                self.reading[msg.step] = self.reading.get(msg.step, 0) + 1
            else:
                self.steps.add(msg.step)

    @contextlib.contextmanager
    def pruning(self) -> Iterator[tuple[int, ...]]:
        """Held for a whole prune (plan and deletions); yields the steps it must keep."""
        with self.lock:
            yield tuple(sorted(self.steps | set(self.reading)))


def protect_in_worker(saver: Any, step: int, *, while_read: bool = False) -> bool:
    """Hand ``step``'s pin to the running worker and wait for its word (the trainer's side
    of ``engine.protect``); nothing to do before the start (every request carries it).
    ``while_read``: until ``Unprotect`` (a load of it). Whether the worker has it."""
    if not saver.is_started():
        return False
    link = saver.worker.link
    try:
        with saver.worker.sending():
            link.unprotected.add(step)
            M.send(link.conn, M.encode(M.Protect(step, while_read)))
    except OSError:  # the worker is dead: saves it had fail; the next requests carry the pin
        link.unprotected.discard(step)
        return False
    deadline = time.monotonic() + PROTECT_WAIT_S
    with saver.jobs.cond:
        while step in link.unprotected:
            if link is not saver.worker.link or not saver.is_started():
                return False  # replaced: the saves it had failed with it
            if time.monotonic() > deadline:
                log.warning(
                    "the worker did not confirm protect(%d) in %.0f s: a save already handed "
                    "to it may still prune that step (saves from now on keep it)",
                    step,
                    PROTECT_WAIT_S,
                )
                return False
            saver.jobs.cond.wait(0.5)
    return True


@contextlib.contextmanager
def kept_while_read(saver: Any, step: int) -> Iterator[None]:
    """No prune of the running worker deletes ``step`` while the block reads it (invariant
    3: a load of an older step while a save commits and prunes it failed half-way)."""
    held = protect_in_worker(saver, step, while_read=True)
    link = saver.worker.link if held else None
    try:
        yield
    finally:
        if held and link is saver.worker.link:
            with contextlib.suppress(OSError), saver.worker.sending():
                M.send(link.conn, M.encode(M.Unprotect(step)))

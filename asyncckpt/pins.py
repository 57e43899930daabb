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
    """The worker's side: the steps pinned since it started, and the lock its prunes hold."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps: set[int] = set()

    def add(self, step: int) -> None:
        """Called by the reader thread: waits for a prune running now to end."""
        with self.lock:
            self.steps.add(step)

    @contextlib.contextmanager
    def pruning(self) -> Iterator[tuple[int, ...]]:
        """Held for a whole prune (plan and deletions); yields the steps pinned so far."""
        with self.lock:
            yield tuple(sorted(self.steps))


def protect_in_worker(saver: Any, step: int) -> None:
    """Hand ``step``'s pin to the running worker and wait for its word (the trainer's side
    of ``engine.protect``); nothing to do before the start (every request carries it)."""
    if not saver.is_started():
        return
    link = saver.worker.link
    try:
        with saver.worker.sending():
            link.unprotected.add(step)
            M.send(link.conn, M.encode(M.Protect(step)))
    except OSError:  # the worker is dead: saves it had fail; the next requests carry the pin
        link.unprotected.discard(step)
        return
    deadline = time.monotonic() + PROTECT_WAIT_S
    with saver.jobs.cond:
        while step in link.unprotected:
            if link is not saver.worker.link or not saver.is_started():
                return  # replaced: the saves it had failed with it
            if time.monotonic() > deadline:
                log.warning(
                    "the worker did not confirm protect(%d) in %.0f s: a save already handed "
                    "to it may still prune that step (saves from now on keep it)",
                    step,
                    PROTECT_WAIT_S,
                )
                return
            saver.jobs.cond.wait(0.5)

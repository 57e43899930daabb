"""Preemption: SIGTERM turns into "drain the staged saves, then one last save".

A scheduler's preemption notice (SIGTERM) must not throw away staged data. The handler drains
what is in flight, marks the run preempted and asks the save schedule for one final save; then
it behaves as SIGTERM would have without us (the previous Python handler, or termination unless
the user asked to make that final save, ``Preemption(final_save=True)``).

A SIGTERM that lands on the thread handing a staged save to the worker is deferred until the
hand-off ends: draining there would wait for that very save.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from asyncckpt.retention import SaveSchedule

log = logging.getLogger("asyncckpt")


class SigtermHandler:
    """The engine's SIGTERM handler and its preempted flag (one per engine).

    ``drain(timeout)``, ``stop()`` and ``in_flight()`` are the engine's; ``enabled`` and
    ``final_save`` are ``options.Preemption``'s ``handle_sigterm`` and ``final_save``.
    """

    def __init__(
        self,
        schedule: SaveSchedule,
        *,
        enabled: bool,
        final_save: bool,
        drain: Callable[[float], None],
        stop: Callable[[], None],
        in_flight: Callable[[], int],
        before_drain: Callable[[], object] | None = None,
    ) -> None:
        self.schedule = schedule
        self.enabled = enabled
        self.final_save = final_save
        self._drain, self._stop, self._in_flight = drain, stop, in_flight
        # The memory tier: write the memory checkpoint the worker holds (then drained too).
        self._before_drain = before_drain
        self.preempted = False
        self._previous: Any = None
        self._handler: Callable[[int, Any], None] | None = None
        # The thread handing a staged save to the worker, and a SIGTERM that arrived meanwhile
        # on that same (main) thread.
        self._handoff_thread: int | None = None
        self._deferred: tuple[int, Any] | None = None

    def request(self) -> None:
        """What SIGTERM does to the schedule, asked for by hand (another notice mechanism)."""
        self.preempted = True
        self.schedule.request_preemption_save()

    def install(self) -> None:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return
        prev = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            if self._handoff_thread == threading.get_ident():
                # This thread was handing a staged save to the worker (possibly waiting for a
                # restarted one): draining here would wait for that very save. Run once the
                # hand-off is over (bounded by the worker's start timeout).
                self._deferred = (signum, frame)
                return
            log.warning("SIGTERM: waiting for %d staged save(s) to commit", self._in_flight())
            self.request()
            if self._before_drain is not None:
                try:
                    self._before_drain()
                except Exception:  # noqa: BLE001 - the staged saves are drained all the same
                    log.exception("SIGTERM: writing the memory checkpoint failed")
            try:
                self._drain(600)
            except TimeoutError:
                log.error("SIGTERM: saves still in flight after 600 s")
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_DFL and not self.final_save:
                self._stop()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        self._previous = prev
        self._handler = on_sigterm
        signal.signal(signal.SIGTERM, on_sigterm)

    def uninstall(self) -> None:
        if self._previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
            self._handler = None

    @contextlib.contextmanager
    def handing_off(self) -> Iterator[None]:
        """Mark the hand-off of a staged save: a SIGTERM on this thread waits until it ends."""
        outer = self._handoff_thread
        self._handoff_thread = threading.get_ident()
        try:
            yield
        finally:
            self._handoff_thread = outer

    def run_deferred(self) -> None:
        """A SIGTERM deferred by ``handing_off``, now that the hand-off is over."""
        deferred, handler = self._deferred, self._handler
        if deferred is not None and self._handoff_thread is None:
            self._deferred = None
            if handler is not None:
                handler(*deferred)
            else:  # uninstalled meanwhile: to whatever handles it now
                signal.raise_signal(deferred[0])

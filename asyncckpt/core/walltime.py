"""Wall time spent in spans that several threads may be in at once.

With ``io_threads > 1`` a save's files are written by several threads, and each may wait on
the throttle or fingerprint its file at the same moment. Adding each thread's seconds would
report thread-seconds (4 threads waiting 1 s together: "4 s held") where the figures
(``SaveStats.throttled_seconds``, ``fingerprint_seconds``) mean the save's wall time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class OverlapClock:
    """Counts the wall time during which at least one thread is inside ``span()``:
    overlapping spans count once, not once per thread."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._inside = 0  # threads inside a span now, since _since
        self._since = 0.0
        self._seconds = 0.0

    @contextmanager
    def span(self) -> Iterator[None]:
        with self._lock:
            if self._inside == 0:
                self._since = self._clock()
            self._inside += 1
        try:
            yield
        finally:
            with self._lock:
                self._inside -= 1
                if self._inside == 0:
                    self._seconds += self._clock() - self._since

    @property
    def seconds(self) -> float:
        """The wall time counted so far, including a span still open."""
        with self._lock:
            open_for = self._clock() - self._since if self._inside else 0.0
            return self._seconds + open_for

    def reset(self) -> None:
        """Count from zero again (spans open now count from this moment)."""
        with self._lock:
            self._seconds = 0.0
            self._since = self._clock()

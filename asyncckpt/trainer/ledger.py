"""The engine's goodput meter: it times the engine's start, loads and saves, follows the steps
the loop reaches, and keeps this run's record in the root's ledger (storage/goodput.py).

The step time needs no call of the user's: it is the wall time between the steps ``save``,
``should_save`` and ``due`` see, less the time saves and loads took in between, over the steps
passed. Only rank 0 writes the ledger (storage/goodput.py says why); every rank measures, which
``Schedule(mtbf=)`` (autoschedule.py) decides from.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from asyncckpt.memory.tier import MemoryTier
from asyncckpt.options import Schedule
from asyncckpt.retention import SaveSchedule
from asyncckpt.stats import SaveStats
from asyncckpt.storage.goodput import (
    Goodput,
    Ledger,
    RunRecord,
    read_ledger,
    restart_seconds,
    summarize,
    wasted_steps,
    write_ledger,
)
from asyncckpt.trainer.autoschedule import AutoSchedule, Intervals, Measured

#: At most one write of the ledger per this many seconds between the engine's events (a run
#: killed loses at most this much of its record).
FLUSH_EVERY_S = 2.0
#: Steps kept to measure the step time, and saves to measure their cost.
STEP_WINDOW = 64
SAVE_WINDOW = 16


class GoodputMeter:
    """One engine's run in the ledger (see the module). Thread-safe: commits arrive on the
    engine's reader thread."""

    def __init__(
        self,
        root: Path,
        run_id: str,
        *,
        writes: bool,
        load_seconds: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.writes = writes
        self.clock, self.wall = clock, wall
        self.load_seconds = load_seconds  # the restorer's total so far
        self.t0 = clock()
        self.lock = threading.Lock()
        self.ledger = read_ledger(root) or Ledger()
        self.previous = self.ledger.runs[-1] if self.ledger.runs else None
        now = wall()
        self.record = RunRecord(run_id, now, now)
        self.blocked = 0.0
        self.steps: deque[tuple[int, float, float]] = deque(maxlen=STEP_WINDOW)
        self.costs: dict[str, deque[float]] = {
            t: deque(maxlen=SAVE_WINDOW) for t in ("memory", "disk")
        }
        self.durable: deque[float] = deque(maxlen=SAVE_WINDOW)
        self.flushed = -FLUSH_EVERY_S
        self.auto: AutoSchedule | None = None  # Schedule(mtbf=): told of every save

    # ------------------------------------------------------------------ events
    def built(self) -> None:
        """The engine is built (counted as start-up)."""
        with self.lock:
            self.record.startup_seconds += self.clock() - self.t0

    def started(self, seconds: float) -> None:
        """``start()`` took ``seconds`` (the wait for the previous run's worker included)."""
        with self.lock:
            self.record.startup_seconds += seconds
        self.flush(force=True)

    def resumed(self, step: int) -> None:
        """A load restored ``step``: the previous run's steps past it are repeated."""
        with self.lock:
            if self.record.resumed_step is None:
                prev = self.previous
                reached = prev.highest_step if prev is not None else None
                self.record.wasted_steps = wasted_steps(reached, step)
                if self.record.step_seconds is None and prev is not None:
                    self.record.step_seconds = prev.step_seconds  # until this run measures
            self.record.resumed_step = step
            self.steps.clear()  # the steps start over from here
        self.flush(force=True)

    def seen(self, step: int) -> None:
        """The loop is at ``step`` (``save``, ``should_save``, ``due``)."""
        if isinstance(step, bool) or not isinstance(step, int):
            return  # (should_save checks no step: a wrong one is not ours to refuse)
        now = self.clock()
        with self.lock:
            r = self.record
            if r.highest_step is None or step > r.highest_step:
                r.highest_step = step
            last = self.steps[-1] if self.steps else None
            if last is not None and step < last[0]:
                self.steps.clear()
            if last is None or step > last[0]:
                self.steps.append((step, now, self.blocked + self.load_seconds()))
                first, newest = self.steps[0], self.steps[-1]
                if newest[0] > first[0]:
                    busy = newest[1] - first[1] - (newest[2] - first[2])
                    r.step_seconds = max(0.0, busy) / (newest[0] - first[0])
        if now - self.flushed >= FLUSH_EVERY_S:
            self.flush()

    def saved(self, step: int, tier: str, seconds: float) -> None:
        """``save(step)`` held the loop ``seconds``."""
        with self.lock:
            self.blocked += seconds
            self.record.save_blocking_seconds += seconds
            self.record.saves += 1
            self.costs["memory" if tier == "memory" else "disk"].append(seconds)
        self.seen(step)
        if self.auto is not None:
            self.auto.saved()

    def then(self, on_commit: Callable[[SaveStats], None] | None) -> Callable[[SaveStats], None]:
        """The engine's ``on_commit``: ``committed``, then the user's."""

        def both(stats: SaveStats) -> None:
            self.committed(stats)
            if on_commit is not None:
                on_commit(stats)

        return both

    def committed(self, stats: SaveStats) -> None:
        """A disk save committed (on the reader thread): its time to durable."""
        if stats.durable_seconds is not None:
            with self.lock:
                self.durable.append(stats.durable_seconds)

    def closed(self) -> None:
        with self.lock:
            self.record.closed = True
        self.flush(force=True)

    # ------------------------------------------------------------------ figures
    def snapshot(self) -> RunRecord:
        with self.lock:
            r = dataclasses.replace(self.record, updated_at=self.wall())
        r.load_seconds = self.load_seconds()
        return r

    def totals(self) -> tuple[RunRecord, Goodput]:
        """This run's record and the ledger's runs added up, this one included."""
        run = self.snapshot()
        others = [r for r in self.ledger.runs if r.run_id != run.run_id]
        return run, summarize([*others, run])

    def measured(self) -> Measured:
        """What ``Schedule(mtbf=)`` decides from."""
        with self.lock:
            costs = {t: statistics.fmean(c) if c else None for t, c in self.costs.items()}
            durable = statistics.fmean(self.durable) if self.durable else None
            step = self.record.step_seconds
        restart = restart_seconds(self.ledger.runs) or 0.0
        return Measured(step, costs["memory"], costs["disk"], durable, restart)

    def flush(self, force: bool = False) -> None:
        """Write this run's record into the ledger (rank 0; at most every ``FLUSH_EVERY_S``
        unless ``force``). A failed write loses figures, never a save: it is not raised."""
        if not self.writes:
            return
        now = self.clock()
        if not force and now - self.flushed < FLUSH_EVERY_S:
            return
        self.flushed = now
        run = self.snapshot()
        with self.lock:
            self.ledger.put(run)
            try:
                write_ledger(self.root, self.ledger)
            except OSError:
                pass  # (a full or read-only disk: the saves say so themselves)


def auto_schedule(
    options: Schedule, meter: GoodputMeter, schedule: SaveSchedule, memory: MemoryTier
) -> AutoSchedule:
    """``Schedule(mtbf=)``'s decisions, measured by ``meter``, set on the engine's
    ``schedule`` (disk) and ``memory`` tier (their ``every_steps``)."""
    assert options.mtbf is not None

    fallback = Intervals(options.every_steps, options.memory_every_steps)

    def apply(chosen: Intervals) -> None:
        schedule.every_steps = chosen.disk_every
        if fallback.memory_every is not None:  # (None for a while: the disk alone, chosen)
            memory.every_steps = chosen.memory_every

    return AutoSchedule(options.mtbf, fallback, meter.measured, apply)

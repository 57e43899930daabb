"""``Schedule(mtbf=)``: how often to save, chosen from what the engine measured.

Young/Daly: with a save costing ``Ts`` seconds of the training loop and a failure every ``Tf``
seconds on average, the training time between two saves that loses the least is about
``sqrt(2 Ts Tf)``; with a restart cost ``Tr`` (start-up and load), NVIDIA's refinement gives the
period ``Tc = Ts + sqrt(2 (Tf + Tr) Ts + Ts^2)``, of which ``Tc - Ts`` is training
(``work_between_saves``). ``choose`` turns that into step intervals for the memory tier (its
save's blocking; none when fewer than two memory saves would fit between disk saves) and the
disk (its save's blocking; never fewer steps than the disk write takes); ``AutoSchedule`` re-decides every few saves from moving measurements, changes an
interval only when the new one differs by more than ``HYSTERESIS``, and logs each change.
Until it has measurements it keeps the user's intervals, and says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("asyncckpt")

#: Re-decide after this many saves (of any tier).
RETUNE_EVERY = 4
#: An interval changes only when the new choice differs from it by more than this fraction.
HYSTERESIS = 0.2
#: The disk interval to measure from when the user gave none (``Schedule(mtbf=)`` alone).
FIRST_DISK_EVERY = 20
#: Memory saves are chosen only when at least this many fit between two disk saves.
MEMORY_PER_DISK = 2


@dataclass(frozen=True)
class Measured:
    """What the engine measured (seconds; None: not yet)."""

    #: a training step, saves and loads left out
    step_seconds: float | None
    #: the time a memory save / a disk save holds the loop, mean of the recent ones
    memory_cost: float | None
    disk_cost: float | None
    #: from a disk save's call to its commit (the write), mean of the recent ones
    disk_durable: float | None
    #: start-up and load of a restarted run (the ledger's), 0 when none restarted yet
    restart: float = 0.0


@dataclass(frozen=True)
class Intervals:
    """Steps between saves of each tier (None: that tier is not scheduled by steps)."""

    disk_every: int | None
    memory_every: int | None


def work_between_saves(cost: float, mtbf: float, restart: float = 0.0) -> float:
    """Seconds of training between two saves: ``Tc - Ts = sqrt(2 (Tf + Tr) Ts + Ts^2)``
    (NVIDIA's refinement of Young/Daly; ``sqrt(2 Ts Tf)`` when ``Tr`` is 0 and ``Ts`` small)."""
    return math.sqrt(2.0 * (mtbf + restart) * cost + cost * cost)


def _steps(seconds: float, step_seconds: float) -> int:
    return max(1, round(seconds / step_seconds))


def choose(mtbf: float, m: Measured, fallback: Intervals) -> Intervals | None:
    """The intervals for ``m`` and ``mtbf``, or None while a measurement they need is missing.

    The memory tier is scheduled only where the user scheduled it (``fallback.memory_every``),
    and only while at least ``MEMORY_PER_DISK`` memory saves fit between two disk saves (else
    None: the disk alone); the disk always. A disk interval is never shorter than the disk
    write (``disk_durable`` over the step time, rounded up): a save every step of a write that
    takes ten would only queue."""
    step = m.step_seconds
    if step is None or step <= 0 or m.disk_cost is None:
        return None
    memory = None
    if fallback.memory_every is not None:
        if m.memory_cost is None:
            return None
        memory = _steps(work_between_saves(m.memory_cost, mtbf, m.restart), step)
    disk = _steps(work_between_saves(m.disk_cost, mtbf, m.restart), step)
    if m.disk_durable is not None:
        disk = max(disk, math.ceil(m.disk_durable / step))
    if memory is not None and memory * MEMORY_PER_DISK > disk:
        # A memory save blocks about as long as a disk save (both are the staging copy), so
        # the formula puts them about as far apart: fewer than two memory saves between two
        # disk saves cost their copies and host memory for next to no work saved.
        memory = None
    return Intervals(disk, memory)


def _moved(new: int | None, old: int | None) -> bool:
    if new is None or old is None:
        return new != old
    return abs(new - old) > HYSTERESIS * old


class AutoSchedule:
    """The engine's side: asks ``measure`` every ``RETUNE_EVERY`` saves and hands a changed
    choice to ``apply`` (which sets the schedule's intervals)."""

    def __init__(
        self,
        mtbf: float,
        fallback: Intervals,
        measure: Callable[[], Measured],
        apply: Callable[[Intervals], None],
    ) -> None:
        if fallback.disk_every is None:
            fallback = Intervals(FIRST_DISK_EVERY, fallback.memory_every)
        self.mtbf = mtbf
        self.fallback = fallback
        self.measure = measure
        self.apply = apply
        self.current = fallback
        self.chosen = False  # False: the user's intervals still (nothing measured yet)
        self.saves = 0
        apply(fallback)
        log.info(
            "Schedule(mtbf=%gs): saving every %s steps to disk%s until the step time and the "
            "saves' cost are measured",
            mtbf,
            fallback.disk_every,
            "" if fallback.memory_every is None else f", every {fallback.memory_every} to memory",
        )

    def saved(self) -> None:
        """After each save: re-decide every ``RETUNE_EVERY`` saves."""
        self.saves += 1
        if self.saves % RETUNE_EVERY:
            return
        m = self.measure()
        new = choose(self.mtbf, m, self.fallback)
        if new is None:
            return
        cur = self.current
        keep_disk = not _moved(new.disk_every, cur.disk_every)
        keep_memory = not _moved(new.memory_every, cur.memory_every)
        if self.chosen and keep_disk and keep_memory:
            return
        self.chosen = True
        self.current = Intervals(
            cur.disk_every if keep_disk else new.disk_every,
            cur.memory_every if keep_memory else new.memory_every,
        )
        if self.current == cur:
            return
        self.apply(self.current)
        log.info(
            "Schedule(mtbf=%gs): saving every %s steps to disk%s (a step %.3fs, a disk save "
            "blocks %.3fs and is durable in %.2fs%s, restart %.1fs)",
            self.mtbf,
            self.current.disk_every,
            "" if self.current.memory_every is None
            else f", every {self.current.memory_every} to memory",
            m.step_seconds or 0.0,
            m.disk_cost or 0.0,
            m.disk_durable or 0.0,
            "" if m.memory_cost is None else f", a memory save blocks {m.memory_cost:.3f}s",
            m.restart,
        )  # fmt: skip

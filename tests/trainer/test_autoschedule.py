"""``Schedule(mtbf=)``'s decisions (trainer/autoschedule.py) and the meter they read
(trainer/ledger.py), with clocks of the test's own: no timed asserts."""

from __future__ import annotations

import logging
import math

from hypothesis import given
from hypothesis import strategies as st

from asyncckpt.storage.goodput import Ledger, RunRecord, write_ledger
from asyncckpt.trainer import autoschedule as A
from asyncckpt.trainer.ledger import GoodputMeter

FALLBACK = A.Intervals(50, 5)


def measured(step=0.1, memory=0.01, disk=0.07, durable=2.0, restart=0.0) -> A.Measured:
    return A.Measured(step, memory, disk, durable, restart)


def test_young_daly_and_nvidias_refinement():
    # No restart, a small cost: sqrt(2 Ts Tf) (Young), within Ts^2's share.
    assert abs(A.work_between_saves(0.1, 1800.0) - math.sqrt(2 * 0.1 * 1800)) < 1e-3
    # Tc - Ts = sqrt(2 (Tf + Tr) Ts + Ts^2)
    assert A.work_between_saves(2.0, 100.0, 10.0) == math.sqrt(2 * 110 * 2 + 4)


def test_the_intervals_in_steps():
    got = A.choose(1800.0, measured(), FALLBACK)
    assert got == A.Intervals(
        round(math.sqrt(2 * 1800 * 0.07 + 0.07**2) / 0.1),
        round(math.sqrt(2 * 1800 * 0.01 + 0.01**2) / 0.1),
    )
    # No memory tier scheduled by the user: none chosen.
    assert A.choose(1800.0, measured(), A.Intervals(50, None)).memory_every is None


def test_no_memory_saves_where_fewer_than_two_fit_between_disk_saves(caplog):
    # A memory save blocking 0.05 s against a disk save's 0.07 s: the formula puts them 134
    # and 159 steps apart, one memory save per disk save at most: the disk alone.
    got = A.choose(1800.0, measured(memory=0.05), FALLBACK)
    assert got == A.Intervals(159, None)
    # Where the disk write is long, the disk interval grows and memory saves fit again.
    got = A.choose(1800.0, measured(memory=0.05, durable=30.0), FALLBACK)
    assert got == A.Intervals(300, 134)
    # The engine's side: memory saves stop, then start again when the costs move apart.
    f = Fake(measured(memory=0.05))
    auto = A.AutoSchedule(1800.0, FALLBACK, lambda: f.m, f.applied.append)
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        for _ in range(A.RETUNE_EVERY):
            auto.saved()
    assert f.applied[-1] == A.Intervals(159, None)
    assert "to memory" not in caplog.records[-1].getMessage()
    f.m = measured()
    for _ in range(A.RETUNE_EVERY):
        auto.saved()
    assert f.applied[-1] == A.Intervals(159, 60)


def test_no_choice_until_measured():
    assert A.choose(60.0, measured(step=None), FALLBACK) is None
    assert A.choose(60.0, measured(disk=None), FALLBACK) is None
    assert A.choose(60.0, measured(memory=None), FALLBACK) is None
    assert A.choose(60.0, measured(memory=None), A.Intervals(50, None)) is not None


def test_the_disk_interval_is_never_shorter_than_the_write():
    # Young says every ~4 steps (a tiny cost, failures every minute); the write takes 30.
    got = A.choose(60.0, measured(disk=0.01, durable=3.0), FALLBACK)
    assert got is not None and got.disk_every == 30


seconds = st.floats(min_value=1e-3, max_value=50.0)


@given(
    step=st.floats(min_value=1e-3, max_value=10.0),
    memory=seconds,
    disk=seconds,
    durable=st.floats(min_value=0.0, max_value=600.0),
    restart=st.floats(min_value=0.0, max_value=600.0),
    mtbf=st.floats(min_value=1.0, max_value=1e6),
    factor=st.floats(min_value=1.0, max_value=100.0),
)
def test_properties(step, memory, disk, durable, restart, mtbf, factor):
    m = measured(step, memory, disk, durable, restart)
    got = A.choose(mtbf, m, FALLBACK)
    assert got is not None and got.disk_every is not None
    assert got.disk_every * step >= durable - 1e-9  # never a save before the last is written
    assert got.disk_every >= 1
    # Memory saves only where two fit between disk saves.
    assert got.memory_every is None or 1 <= got.memory_every * 2 <= got.disk_every
    longer = A.choose(mtbf * factor, m, FALLBACK)
    assert longer is not None and longer.disk_every is not None
    assert longer.disk_every >= got.disk_every  # rarer failures: never more frequent saves
    if got.memory_every is not None and longer.memory_every is not None:
        assert longer.memory_every >= got.memory_every


class Fake:
    def __init__(self, m: A.Measured) -> None:
        self.m = m
        self.applied: list[A.Intervals] = []


def test_it_keeps_the_users_intervals_until_measured_then_retunes_with_hysteresis(caplog):
    f = Fake(measured(step=None))
    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        auto = A.AutoSchedule(1800.0, FALLBACK, lambda: f.m, f.applied.append)
    assert f.applied == [FALLBACK] and not auto.chosen
    assert "until the step time and the saves' cost are measured" in caplog.text
    for _ in range(A.RETUNE_EVERY):
        auto.saved()
    assert f.applied == [FALLBACK]  # nothing measured: the user's still
    f.m = measured()
    for _ in range(A.RETUNE_EVERY):
        auto.saved()
    first = A.choose(1800.0, f.m, FALLBACK)
    assert auto.chosen and f.applied[-1] == first == auto.current
    assert "saving every" in caplog.records[-1].getMessage()
    # A 10% move of the cost is within the hysteresis: no change, no log line.
    f.m = measured(disk=0.07 * 1.1, memory=0.01 * 1.1)
    n = len(caplog.records)
    for _ in range(A.RETUNE_EVERY):
        auto.saved()
    assert len(f.applied) == 2 and len(caplog.records) == n
    # Four times the cost: about twice the interval.
    f.m = measured(disk=0.28, memory=0.2)
    for _ in range(A.RETUNE_EVERY):
        auto.saved()
    assert len(f.applied) == 3 and f.applied[-1] == A.choose(1800.0, f.m, FALLBACK)


def test_mtbf_alone_measures_from_a_first_guess():
    f = Fake(measured())
    auto = A.AutoSchedule(60.0, A.Intervals(None, None), lambda: f.m, f.applied.append)
    assert f.applied == [A.Intervals(A.FIRST_DISK_EVERY, None)]
    assert auto.current.disk_every == A.FIRST_DISK_EVERY


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_the_meter_measures_the_step_time_without_the_saves_and_loads(tmp_path):
    clock, loads = Clock(), [0.0]
    meter = GoodputMeter(
        tmp_path, "r1", writes=True, load_seconds=lambda: loads[0], clock=clock, wall=clock
    )
    for step in range(1, 11):
        clock.t += 0.1  # the step's compute
        meter.seen(step)
        if step % 5 == 0:
            clock.t += 0.5  # the save held the loop this long
            meter.saved(step, "disk", 0.5)
    clock.t += 2.0  # a load in the middle: left out too
    loads[0] = 2.0
    clock.t += 0.1
    meter.seen(11)
    run = meter.snapshot()
    assert run.step_seconds is not None and abs(run.step_seconds - 0.1) < 1e-9
    assert run.save_blocking_seconds == 1.0 and run.saves == 2
    assert run.load_seconds == 2.0 and run.highest_step == 11
    m = meter.measured()
    assert m.disk_cost == 0.5 and m.memory_cost is None and m.step_seconds == run.step_seconds


def test_the_meter_counts_a_restarts_repeated_steps_from_the_ledger(tmp_path):
    prev = RunRecord("old", 0.0, 50.0, highest_step=87, step_seconds=0.1)
    write_ledger(tmp_path, Ledger([prev]))
    clock = Clock()
    meter = GoodputMeter(tmp_path, "new", writes=True, load_seconds=lambda: 0.0, wall=clock)
    meter.resumed(50)
    run = meter.snapshot()
    assert run.wasted_steps == 37 and run.resumed_step == 50
    assert run.step_seconds == 0.1  # the previous run's, until this one measures its own
    assert abs(run.wasted_seconds - 3.7) < 1e-9
    _, total = meter.totals()
    assert total.runs == 2 and total.wasted_steps == 37


def test_the_engine_takes_memory_saves_up_again_after_the_disk_alone():
    """The engine's apply sets the memory tier's interval back once the choice has memory
    saves again (it once skipped a tier whose interval was None, for good)."""
    from types import SimpleNamespace

    from asyncckpt import Schedule
    from asyncckpt.trainer.ledger import auto_schedule

    meter = SimpleNamespace(m=measured(memory=0.05))
    meter.measured = lambda: meter.m
    disk, memory = SimpleNamespace(every_steps=None), SimpleNamespace(every_steps=None)
    options = Schedule(every_steps=50, memory_every_steps=5, mtbf=1800.0)
    auto = auto_schedule(options, meter, disk, memory)
    assert (disk.every_steps, memory.every_steps) == (50, 5)
    for _ in range(A.RETUNE_EVERY):
        auto.saved()
    assert (disk.every_steps, memory.every_steps) == (159, None)
    meter.m = measured()
    for _ in range(A.RETUNE_EVERY):
        auto.saved()
    assert (disk.every_steps, memory.every_steps) == (159, 60)

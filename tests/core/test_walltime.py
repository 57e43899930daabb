"""OverlapClock: the wall time of spans several threads are in at once, counted once."""

from __future__ import annotations

import threading

import pytest

from asyncckpt.core.walltime import OverlapClock
from asyncckpt.formats import differential
from asyncckpt.formats.differential import Linker


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _two_threads_inside_together(clock: _Clock, enter_span) -> None:
    """Two threads enter a span, the clock moves 1 s while both are inside, both leave."""
    inside = threading.Barrier(2, timeout=30)
    moved = threading.Barrier(2, timeout=30)

    def run(first: bool) -> None:
        with enter_span():
            inside.wait()
            if first:
                clock.now += 1.0
            moved.wait()

    threads = [threading.Thread(target=run, args=(i == 0,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def test_overlapping_spans_count_once_and_separate_spans_add_up() -> None:
    clock = _Clock()
    wall = OverlapClock(clock)
    _two_threads_inside_together(clock, wall.span)
    assert wall.seconds == pytest.approx(1.0)  # not 2.0: the threads were inside together
    with wall.span():
        clock.now += 0.5
        assert wall.seconds == pytest.approx(1.5)  # an open span counts so far
    clock.now += 10.0  # outside any span: not counted
    assert wall.seconds == pytest.approx(1.5)
    wall.reset()
    assert wall.seconds == 0.0


def test_reset_while_a_span_is_open_counts_it_from_the_reset() -> None:
    clock = _Clock()
    wall = OverlapClock(clock)
    with wall.span():
        clock.now += 3.0
        wall.reset()
        clock.now += 1.0
    assert wall.seconds == pytest.approx(1.0)


def test_a_linker_reports_the_wall_time_of_files_fingerprinted_by_threads_together(
    tmp_path, monkeypatch
) -> None:
    """io_threads > 1: several writer threads fingerprint their files at once; the save's
    fingerprint_seconds is how long that took, not the sum of the threads' times."""
    clock = _Clock()
    linker = Linker(location=tmp_path, prefix="__0_", previous=None, seed="s")
    linker._hashing = OverlapClock(clock)
    hashing = threading.Barrier(2, timeout=30)
    moved = threading.Barrier(2, timeout=30)
    first = threading.Lock()

    class SlowFingerprint(differential.FileFingerprint):
        def add(self, describe, data, known=None):  # both threads hash while the clock moves
            hashing.wait()
            if first.acquire(blocking=False):
                clock.now += 1.0
            moved.wait()
            super().add(describe, data, known)

    monkeypatch.setattr(differential, "FileFingerprint", SlowFingerprint)
    digests: list[str] = []
    threads = [
        threading.Thread(
            target=lambda i=i: digests.append(
                linker.timed_fingerprint([(f"item{i}", memoryview(b"abc"), None)])
            )
        )
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(digests) == 2 and digests[0] != digests[1]
    assert linker.fingerprint_seconds == pytest.approx(1.0)  # the threads' sum would be 2.0

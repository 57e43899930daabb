"""A hot resume that needs nothing of the user: ``load_latest`` settles a step it took from a
surviving worker's memory before that worker committed it (it waits for the commit, and reads
the disk instead, saying so, when the commit failed or recorded other bytes), and engines that
save to memory have their worker keep what it wrote for a new engine by default, where the
node has room for it.

Each trainer is a subprocess (its death is a real SIGKILL; the worker outlives it): the
trainer script of test_hot_resume.py, with the memory tier's options varied.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import test_hot_resume as H
from statecmp import assert_same
from test_hot_resume import blank, run_trainer, slow_commit, state_at, steps

from asyncckpt import MemoryTier, SyncCheckpointEngine, verify
from asyncckpt.errors import StagingMemoryError
from asyncckpt.memory import hot_serve


def test_a_failed_commit_of_a_step_taken_from_memory_is_read_again_by_load_latest(tmp_path, caplog):
    """Step 3 was taken from memory while its worker committed it, and that commit failed:
    the state loaded was on no disk, and ``start()`` raised ``UncommittedResume`` for the
    user's code to catch and load again. ``load_latest`` now waits for that commit and reads
    the newest committed step from disk itself, saying so; the engine then starts."""
    root, engine, target = slow_commit(tmp_path, before_rename="eio")
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    assert engine.load_latest(target) == 1
    report = engine.last_load_report
    assert report.source == "disk"
    assert "its commit failed" in report.source_reason
    assert_same(target, state_at(1))  # the whole target: the disk's step 1, bit for bit
    assert "reading the newest committed step from disk" in caplog.text
    with engine:  # nothing left to check: no protocol around the start
        assert engine.latest_step() == 1
    assert steps(root) == [1]


def _default_memory_tier(monkeypatch, options: str = "") -> None:
    """The trainer of test_hot_resume.py with ``MemoryTier(<options>)``: no hold_seconds."""
    script = H.TRAINER.replace(
        "memory=MemoryTier(hold_seconds=hold)", f"memory=MemoryTier({options})"
    )
    assert script != H.TRAINER
    monkeypatch.setattr(H, "TRAINER", script)


def test_hot_resume_is_on_by_default_for_memory_saves(tmp_path, monkeypatch):
    """Off by default before (``hold_seconds=0``): the worker exited once it had written the
    memory step, and a new engine read it back from disk."""
    _default_memory_tier(monkeypatch)
    run_trainer(tmp_path, "memory", hold=0)
    with SyncCheckpointEngine(tmp_path / "r", keep=None) as engine:
        target = blank()
        assert engine.load_latest(target) == 3
        report = engine.last_load_report
    assert report.source == "memory", report.source_reason
    assert_same(target, state_at(3))
    assert verify(tmp_path / "r").ok and steps(tmp_path / "r") == [1, 3]


def test_hold_seconds_zero_still_turns_it_off(tmp_path, monkeypatch):
    _default_memory_tier(monkeypatch, "hold_seconds=0")
    run_trainer(tmp_path, "memory", hold=0)
    with SyncCheckpointEngine(tmp_path / "r", keep=None) as engine:
        target = blank()
        assert engine.load_latest(target) == 3
        assert engine.last_load_report.source == "disk"
    assert_same(target, state_at(3))


def test_the_default_hold_needs_room_on_the_node(monkeypatch, caplog):
    """By default a worker whose trainer died keeps the memory it wrote from only where the
    node has room for a new trainer's staging beside it; else it says why and exits."""
    arena = SimpleNamespace(nbytes=3 << 30)
    config = SimpleNamespace(hot_hold_s=hot_serve.DEFAULT_HOLD_S, hot_hold_auto=True, rank=0)
    worker = SimpleNamespace(config=config, arenas={0: arena}, trainer_gone=True)
    asked: list[int] = []

    def no_room(nbytes: int) -> None:
        asked.append(nbytes)
        raise StagingMemoryError("only 1.00 GiB is available")

    monkeypatch.setattr(hot_serve, "check_memory", no_room)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    serve = hot_serve.HotServe(worker)  # type: ignore[arg-type]
    assert serve.hold_seconds() == 0
    assert asked == [3 << 30]
    assert "only 1.00 GiB is available" in caplog.text and "from disk" in caplog.text
    monkeypatch.setattr(hot_serve, "check_memory", lambda nbytes: None)
    assert hot_serve.HotServe(worker).hold_seconds() == hot_serve.DEFAULT_HOLD_S  # type: ignore[arg-type]
    config.hot_hold_auto = False  # asked for (hold_seconds=): held whatever the room
    monkeypatch.setattr(hot_serve, "check_memory", no_room)
    assert hot_serve.HotServe(worker).hold_seconds() == hot_serve.DEFAULT_HOLD_S  # type: ignore[arg-type]


def test_memory_tier_hold_seconds_defaults_to_automatic():
    assert MemoryTier().hold_seconds is None
    assert MemoryTier(hold_seconds=0).hold_seconds == 0
    with pytest.raises(ValueError, match="hold_seconds"):
        MemoryTier(hold_seconds=-1)

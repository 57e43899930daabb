"""A restart does not wait at ``start()`` for the worker its killed trainer left finishing the
saves that trainer staged (one rank, a local root): that wait was seconds before the first
step, for writes the new run never asked for. A load that must read what that worker commits
waits for it; a step taken from its memory before it was written stands at once and its
commit is checked in the background; the new engine's worker follows the earlier one on the
root's lock and cleans the root's leftovers before its first write, never the earlier
worker's temporaries while it writes them.

Each trainer is a subprocess killed with SIGKILL (test_hot_resume.py's trainer); its worker
takes SLOW_COMMIT_S to commit step 3.
"""

from __future__ import annotations

import logging
import time

from statecmp import assert_same
from test_hot_resume import SLOW_COMMIT_S, blank, run_trainer, slow_commit, state_at, steps

from asyncckpt import SyncCheckpointEngine, verify
from asyncckpt.core import layout as L
from asyncckpt.storage.local import LocalStore
from asyncckpt.trainer.earlier_worker import holds_root

#: Longer than anything here takes, short of a hang.
WAIT_S = 180


def said(caplog, text: str) -> None:
    """Wait until the log says ``text``: the background check of a step taken from memory."""
    deadline = time.monotonic() + WAIT_S
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in caplog.text


def test_the_start_does_not_wait_and_a_step_taken_from_memory_is_checked_after(tmp_path, caplog):
    root, engine, target = slow_commit(tmp_path)
    caplog.set_level(logging.INFO, logger="asyncckpt")
    with engine:
        # Started while the earlier worker still writes step 3 (it takes SLOW_COMMIT_S):
        # before, the start waited for it.
        assert holds_root(root, 0) and steps(root) == [1]
        assert engine.load_latest(target) == 3
        report = engine.last_load_report
        assert report.source == "memory", report.source_reason
        assert "checked in the background" in report.source_reason
        assert steps(root) == [1]  # loaded before the commit, not after it
        assert_same(target, state_at(3))
        # A look at the root through the engine shows what the earlier worker commits.
        assert engine.latest_step() == 3
        assert [c.step for c in engine.list_checkpoints()] == [1, 3]
        said(caplog, "step 3, loaded before it was written, is committed")
        assert steps(root) == [1, 3]  # the earlier worker's temporary was not cleaned away
        engine.save(4, state_at(4)).committed_sync(WAIT_S)
    assert verify(root).ok and steps(root) == [1, 3, 4]
    assert LocalStore(root).leftovers() == []


def test_a_failed_commit_of_the_step_taken_is_said_and_training_goes_on(tmp_path, caplog):
    root, engine, target = slow_commit(tmp_path, before_rename="eio")
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with engine:
        assert engine.load_latest(target) == 3
        assert_same(target, state_at(3))  # the bytes the worker staged, checked
        said(caplog, "its commit failed")
        assert "until this engine's next save commits" in caplog.text
        assert steps(root) == [1]
        engine.save(4, state_at(4)).committed_sync(WAIT_S)  # the next save: on disk again
    assert steps(root) == [1, 4]
    with SyncCheckpointEngine(root, keep=None) as again:
        fresh = blank()
        assert again.load_latest(fresh) == 4
    assert_same(fresh, state_at(4))


def test_a_load_from_disk_inside_the_engine_waits_for_what_the_earlier_worker_commits(tmp_path):
    """No memory offered (``hold_seconds=0``): the step the earlier worker is committing is
    the one loaded, never the older one on disk at the start."""
    run_trainer(tmp_path, "memory", hold=0, later={"before_metadata": f"delay:{SLOW_COMMIT_S}"})
    root = tmp_path / "r"
    with SyncCheckpointEngine(root, keep=None) as engine:
        assert steps(root) == [1]  # started: the earlier worker is still committing step 3
        target = blank()
        assert engine.load_latest(target) == 3
        assert engine.last_load_report.source == "disk"
        assert_same(target, state_at(3))


def test_the_new_worker_cleans_the_leftovers_after_the_earlier_one_and_keeps_trainer_notes(
    tmp_path,
):
    run_trainer(tmp_path, "memory", hold=0, later={"before_metadata": f"delay:{SLOW_COMMIT_S}"})
    root = tmp_path / "r"
    crashed = root / L.tmp_name_of("global_step_7", "feedbeef")  # an older crash's
    crashed.mkdir()
    (crashed / "shard").write_bytes(b"x")
    note = root / (L.TMP_PREFIX + ".asyncckpt-goodput.json-0123")  # a trainer's, being renamed
    note.write_bytes(b"{}")
    with SyncCheckpointEngine(root, keep=None) as engine:
        assert crashed.exists()  # the start cleaned nothing: the earlier worker still writes
        engine.save(4, state_at(4)).committed_sync(WAIT_S)  # after the new worker's start
        assert not crashed.exists() and note.exists()
    assert steps(root) == [1, 3, 4]

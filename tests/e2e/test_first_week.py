"""What a new user meets first (issue 25): worker failures told in one line, waits shown where
a person waits, warnings pointing at the user's own line, and the engine's start-up cost."""

from __future__ import annotations

import logging
import time
import traceback

import pytest
import torch

from asyncckpt import SyncCheckpointEngine, faults
from asyncckpt.errors import SaveFailed


def test_a_worker_failure_is_one_info_line_and_the_traceback_is_kept_not_printed(tmp_path, caplog):
    faults.inject("before_rename", "raise")
    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        handle = eng.save(1, {"w": torch.ones(4)})
        with pytest.raises(SaveFailed) as info:
            handle.committed_sync(60)
    err = info.value
    # The user receives the failure as this exception: by default nothing else is printed
    # (issue 32: one channel); at INFO, one line says when it happened.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    lines = [r for r in caplog.records if r.levelno == logging.INFO and "failed" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0].getMessage(), lines
    assert "fault injected at before_rename" in lines[0].getMessage()
    # The worker's traceback: on the chained cause and at debug level ...
    tb = err.__cause__.worker_traceback
    assert "Traceback" in tb and "worker/loop.py" in tb and "before_rename" in tb
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(tb in m for m in debug), debug
    # ... but not in what Python prints for the exception left uncaught.
    printed = "".join(traceback.format_exception(err))
    assert "worker/loop.py" not in printed, printed
    assert "worker_traceback" in printed  # where to find it is said


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_fresh_async_run_is_one_log_warning_not_a_python_warning(
    tmp_path, anyio_backend, caplog
):
    import warnings

    from asyncckpt import CheckpointEngine

    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    engine = CheckpointEngine(tmp_path / "never-made")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert await engine.load_latest({"w": torch.zeros(2)}) is None
    assert not [str(w.message) for w in caught if "does not exist" in str(w.message)]
    said = [r for r in caplog.records if "does not exist" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said


def test_a_fresh_sync_run_is_one_log_warning_not_a_python_warning(tmp_path, caplog):
    import warnings

    caplog.set_level(logging.DEBUG, logger="asyncckpt")
    engine = SyncCheckpointEngine(tmp_path / "never-made")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.load_latest({"w": torch.zeros(2)}) is None
    assert not [str(w.message) for w in caught if "does not exist" in str(w.message)]
    said = [r for r in caplog.records if "does not exist" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said


def test_the_read_bar_of_a_large_load_has_a_total_and_completes(tmp_path, monkeypatch):
    import sys

    from asyncckpt.formats import loadcheck

    bars = []

    class Recorded(loadcheck.Progress):
        def __enter__(self):
            bars.append(self)
            return super().__enter__()

    monkeypatch.setattr(loadcheck, "Progress", Recorded)
    monkeypatch.setattr(loadcheck, "PROGRESS_MIN_BYTES", 0)  # "large": any size here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    state = {"w": torch.randn(1 << 20), "b": torch.randn(1000)}
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(1, state).committed_sync(60)
        assert eng.load_latest({"w": torch.zeros(1 << 20), "b": torch.zeros(1000)}) == 1
    (bar,) = bars
    tasks = {t.description.split()[0]: t for t in bar._bar.tasks}
    read = tasks["read"]
    assert read.total is not None and read.total >= state["w"].nbytes, read.total
    assert read.completed == read.total


def _terminal(monkeypatch):
    """What the drain bar draws, as on a terminal."""
    import io

    from rich.console import Console

    from asyncckpt.core import progress

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    monkeypatch.setattr(progress, "_stderr_console", lambda: console)
    monkeypatch.setattr(progress, "DRAIN_BAR_AFTER_S", 0.0)
    return out


def test_close_shows_a_bar_on_a_terminal_while_it_waits_for_a_save(tmp_path, monkeypatch):
    out = _terminal(monkeypatch)
    faults.inject("mid_shard_write", "delay", seconds=1.5)  # a big save's write, made slow
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(7, {"w": torch.ones(1 << 16)})
    assert [c.step for c in eng.list_checkpoints()] == [7]
    text = out.getvalue()
    assert "waiting for step 7 to commit" in text, text


def test_close_stays_quiet_off_a_terminal(tmp_path, monkeypatch, capfd):
    from asyncckpt.core import progress

    monkeypatch.setattr(progress, "DRAIN_BAR_AFTER_S", 0.0)
    faults.inject("mid_shard_write", "delay", seconds=1.0)
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(7, {"w": torch.ones(1 << 16)})
    assert "to commit" not in capfd.readouterr().err


def test_start_returns_before_the_worker_is_ready_and_the_first_save_waits_for_it(
    tmp_path, monkeypatch
):
    import threading

    from asyncckpt.core import messages as M
    from asyncckpt.trainer.supervisor import WorkerSupervisor

    release = threading.Event()
    original = WorkerSupervisor._on_event

    def held(self, msg):  # the worker's Ready reaches the engine only once the test says so
        if isinstance(msg, M.Ready):
            release.wait(120)
        original(self, msg)

    monkeypatch.setattr(WorkerSupervisor, "_on_event", held)
    eng = SyncCheckpointEngine(tmp_path / "r")
    started = threading.Thread(target=eng.__enter__, daemon=True)
    started.start()
    started.join(60)
    try:
        assert not started.is_alive(), "start() waited for the worker's Ready"
        assert not eng.worker_ready
        handles = []
        saving = threading.Thread(
            target=lambda: handles.append(eng.save(1, {"w": torch.ones(8)})), daemon=True
        )
        saving.start()
        saving.join(0.5)
        assert not handles  # staged, and waiting for the worker before it is sent
    finally:
        release.set()
    saving.join(120)
    handles[0].committed_sync(60)
    eng.close()
    assert [c.step for c in eng.list_checkpoints()] == [1]


def _drop_first_ready(monkeypatch):
    """The engine never hears the first worker's Ready (it stays "starting"); returns the event
    set when that Ready was dropped."""
    import threading

    from asyncckpt.core import messages as M
    from asyncckpt.trainer.supervisor import WorkerSupervisor

    first_ready = threading.Event()
    original = WorkerSupervisor._on_event

    def drop_first_ready(self, msg):
        if isinstance(msg, M.Ready) and not first_ready.is_set():
            first_ready.set()
            return
        original(self, msg)

    monkeypatch.setattr(WorkerSupervisor, "_on_event", drop_first_ready)
    return first_ready


def test_a_worker_killed_while_it_starts_is_replaced(tmp_path, monkeypatch):
    """start() no longer waits for the worker, so the OOM killer (or a crash test) can kill
    it before it is ready: that is a death like any other, and a new worker takes over (the
    torture run's trainer died of 'failed to start (signal 9)' before)."""
    import os
    import signal

    first_ready = _drop_first_ready(monkeypatch)
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        assert first_ready.wait(120)
        first = eng.worker_pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while eng.worker_restarts == 0:  # the death seen; a new worker starting
            assert time.monotonic() < deadline, "the killed worker was never replaced"
            time.sleep(0.05)
        eng.save(1, {"w": torch.ones(8)}).committed_sync(120)
        assert eng.worker_pid != first and eng.worker_restarts == 1
    assert [c.step for c in eng.list_checkpoints()] == [1]


def test_a_save_failed_while_it_waited_for_the_worker_is_not_sent_to_the_next_one(
    tmp_path, monkeypatch
):
    """save() staged, then waited for a starting worker that was killed: its handle fails
    ("nothing was committed"), so the replacement must not be handed that job; before, it
    was, and committed the step that the handle called lost."""
    import os
    import signal
    import threading

    from asyncckpt import WorkerDied

    first_ready = _drop_first_ready(monkeypatch)
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        assert first_ready.wait(120)
        first = eng.worker_pid
        # Killed while save(1) waits for it (the save is staged and entered as in flight).
        killer = threading.Timer(0.5, os.kill, (first, signal.SIGKILL))
        killer.start()
        handle = eng.save(1, {"w": torch.ones(8)})
        killer.join()
        with pytest.raises(WorkerDied, match="nothing was committed"):
            handle.committed_sync(60)
        eng.save(2, {"w": torch.ones(8)}).committed_sync(120)
        assert eng.worker_pid != first
    assert [c.step for c in eng.list_checkpoints()] == [2]

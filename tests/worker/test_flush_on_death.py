"""A save whose ``save()`` returned is committed even if the trainer dies the next instant
(invariant 12): SIGKILL (the scheduler, the OOM killer) and ``abort()`` (a CUDA error, NCCL's
watchdog) run no exit handler, so the worker finishes what was staged on its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from statecmp import assert_same

from asyncckpt import SyncCheckpointEngine, verify

TRAINER = """
import os, signal, sys, torch
from asyncckpt import SyncCheckpointEngine, ThrottleConfig, faults
root, how, write_timeout = sys.argv[1], sys.argv[2], float(sys.argv[3]) or None
throttle = ThrottleConfig.background(write_timeout=write_timeout)
engine = SyncCheckpointEngine(root, keep=None, throttle=throttle)
engine.__enter__()  # never left: the trainer dies inside
state = {"w": torch.full((1 << 22,), 1.0), "b": torch.arange(10)}
engine.save(1, state).committed_sync()
# The worker starts writing step 2 only after the trainer is gone.
faults.inject("before_shard_write", sys.argv[4])
state["w"].fill_(2.0)
engine.save(2, state)  # returned: staged
state["w"].fill_(3.0)  # the loop goes on mutating its state
print(engine.worker_pid, flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
else:
    os.abort()
"""


def run_trainer(tmp_path, how: str, fault: str, write_timeout: float = 0) -> int:
    """Run the trainer until it dies; returns its worker's pid."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    # Files, not pipes: the orphaned worker inherits the trainer's output, and a pipe would
    # make this wait for the worker too.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "r"), how, str(write_timeout), fault],
            stdout=out,
            stderr=err,
            timeout=300,
        )
    want = -signal.SIGKILL if how == "kill" else -signal.SIGABRT
    assert proc.returncode == want, (tmp_path / "err").read_text()
    return int((tmp_path / "out").read_text().split()[-1])


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pid: int, timeout: float) -> float:
    start = time.monotonic()
    while not gone(pid):
        assert time.monotonic() - start < timeout, f"worker {pid} still alive after {timeout}s"
        time.sleep(0.1)
    return time.monotonic() - start


def expected(step: int) -> dict:
    return {"w": torch.full((1 << 22,), float(step)), "b": torch.arange(10)}


@pytest.mark.parametrize("how", ["kill", "abort"])
def test_a_returned_save_is_committed_after_the_trainer_dies(tmp_path, how):
    worker = run_trainer(tmp_path, how, "delay:1.0")
    root = tmp_path / "r"
    if how == "abort":
        wait_gone(worker, 120)  # the worker finishes, then exits on its own
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # A new engine started at once waits for the finishing worker, then resumes its step.
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {"w": torch.zeros(1 << 22), "b": torch.zeros(10, dtype=torch.int64)}
        assert engine.load_latest(target) == 2
    assert_same(target, expected(2))
    assert gone(worker)
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 2], report
    assert report.leftovers == []


def test_a_worker_whose_trainer_died_never_lingers(tmp_path):
    """A write that hangs after the trainer died ends at write_timeout; nothing is committed
    from it, and the older checkpoint stays the newest."""
    worker = run_trainer(tmp_path, "kill", "hang", write_timeout=2)
    wait_gone(worker, 60)
    with SyncCheckpointEngine(tmp_path / "r", keep=None) as engine:
        target = {"w": torch.zeros(1 << 22), "b": torch.zeros(10, dtype=torch.int64)}
        assert engine.load_latest(target) == 1
    assert_same(target, expected(1))
    assert not os.path.exists(tmp_path / "r" / "global_step_2")


@pytest.mark.integration
def test_a_new_engine_waits_for_a_long_orphaned_save(tmp_path, caplog):
    """The orphan's write outlasts the 30 s an engine used to wait for a worker lock: the new
    engine says what it waits for, waits, and resumes the step the orphan committed."""
    import logging

    worker = run_trainer(tmp_path, "kill", "delay:35")
    assert not gone(worker)  # still writing step 2
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        with SyncCheckpointEngine(tmp_path / "r", keep=None) as engine:
            target = {"w": torch.zeros(1 << 22), "b": torch.zeros(10, dtype=torch.int64)}
            assert engine.load_latest(target) == 2
    assert_same(target, expected(2))
    assert gone(worker)
    assert any("finishing the saves" in r.getMessage() for r in caplog.records)

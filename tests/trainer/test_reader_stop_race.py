"""The supervisor's reader thread settling a dead worker while the engine stops: stop() must
not close the process object under it (a ValueError on the reader thread, seen once in CI)."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt.testing import parts


def test_stopping_while_the_reader_settles_a_dead_worker(tmp_path, monkeypatch):
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    engine = SyncCheckpointEngine(tmp_path, keep=None)
    engine.__enter__()
    engine.save(1, {"w": torch.ones(4)}).committed_sync(60)
    jobs = parts(engine).jobs
    settle = jobs.settle_dead_worker
    settling = threading.Event()

    def slow_settle(*args, **kwargs):
        settling.set()
        time.sleep(1.0)  # stop() runs meanwhile
        return settle(*args, **kwargs)

    monkeypatch.setattr(jobs, "settle_dead_worker", slow_settle)
    os.kill(engine.worker_pid, signal.SIGKILL)
    assert settling.wait(30)
    engine.close()
    time.sleep(1.5)  # the reader's last steps, had stop() not waited for it
    assert errors == [], errors

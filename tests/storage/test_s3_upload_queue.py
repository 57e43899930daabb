"""Object storage: an upload never holds a save (moto's S3 server on loopback).

The worker commits each step locally, queues its upload and goes on with the next save; only
when ``max_queued_uploads`` committed steps wait does it wait for room (said in the log). A
step waiting to upload is never pruned locally, and nothing is lost if the worker dies with
uploads queued: the next save publishes them. The first upload is held by a ``hang`` fault (it
never finishes until the worker is killed), so nothing here depends on how fast anything runs.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from asyncckpt import KeepLast, ObjectStore, SyncCheckpointEngine, faults
from asyncckpt.core import layout as L
from asyncckpt.errors import SaveFailed
from asyncckpt.storage import RemoteTier
from asyncckpt.storage.fsspec_store import FsspecStore

pytest_plugins = ("s3server",)


def state(step: int) -> dict:
    return {"model": {"w": torch.full((64, 32), float(step))}, "step_seen": step}


def remote_steps(s3) -> list[int]:
    return [c.step for c in FsspecStore(s3.url, s3.options).committed("global_step")]


def saves_in_thread(eng, steps) -> tuple[threading.Thread, dict]:
    handles: dict = {}

    def run() -> None:
        for s in steps:
            handles[s] = eng.save(s, state(s))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, handles


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_back_to_back_saves_do_not_wait_for_the_previous_upload(s3, tmp_path):
    root = tmp_path / "local"
    tier = RemoteTier(s3.url, storage_options=s3.options)  # max_queued_uploads=2
    with SyncCheckpointEngine(root, remote=tier, keep=KeepLast(1)) as eng:
        eng.save(1, state(1)).committed_sync(60)
        faults.inject("mid_upload", "hang")  # step 2's upload never ends
        h2 = eng.save(2, state(2))
        faults.clear()
        # Step 2's upload is blocked: saves 3 and 4 still return, and are committed locally.
        t, handles = saves_in_thread(eng, [3, 4])
        t.join(60)
        assert not t.is_alive(), "a save waited for the previous step's upload"
        wait_for(lambda: (root / L.dir_name("global_step", 4)).is_dir(), "step 4's commit")
        assert remote_steps(s3) == [1]  # 2 is still uploading
        assert not h2.done() and not handles[3].done()  # their handles wait for the store
        # Step 3's prune (KeepLast(1)) ran before step 4 was written: the steps waiting to
        # upload stay on the local disk.
        assert {2, 3} <= {c.step for c in L.scan(root, "global_step")}
        # The worker dies with uploads queued: nothing is lost, the next save publishes all.
        os.kill(eng.worker_pid, signal.SIGKILL)
        for h in (h2, handles[3], handles[4]):
            with pytest.raises(SaveFailed, match="committed locally"):
                h.committed_sync(60)
        eng.save(5, state(5)).committed_sync(60)
        assert remote_steps(s3) == [1, 2, 3, 4, 5]
        eng.save(6, state(6)).committed_sync(60)  # its prune: the uploaded ones go
    assert [c.step for c in L.scan(root, "global_step")] == [6]


def test_the_queue_bound_applies_and_the_wait_is_logged(s3, tmp_path, capfd):
    root = tmp_path / "local"
    tier = RemoteTier(s3.url, storage_options=s3.options, max_queued_uploads=1)
    with SyncCheckpointEngine(root, remote=tier) as eng:
        eng.save(1, state(1)).committed_sync(60)
        faults.inject("mid_upload", "hang")
        h2 = eng.save(2, state(2))
        faults.clear()
        t, handles = saves_in_thread(eng, [3, 4])
        # Step 3 is committed locally, then the worker waits for room (one step is queued):
        # it says so, and step 4 is not written while it waits.
        wait_for(lambda: "wait to upload" in capfd.readouterr().err, "the log line")
        assert (root / L.dir_name("global_step", 3)).is_dir()
        t.join(60)  # save 4 took the slot step 3 freed ...
        assert not t.is_alive()
        assert not (root / L.dir_name("global_step", 4)).exists()  # ... and waits behind it
        assert remote_steps(s3) == [1]
        os.kill(eng.worker_pid, signal.SIGKILL)
        for h in (h2, handles[3]):
            with pytest.raises(SaveFailed, match="committed locally"):
                h.committed_sync(60)
        with pytest.raises(SaveFailed, match="nothing was committed"):
            handles[4].committed_sync(60)
        eng.save(5, state(5)).committed_sync(60)
    assert remote_steps(s3) == [1, 2, 3, 5]


def test_the_bound_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match="max_queued_uploads must be an int >= 1"):
        RemoteTier("s3://bucket/run", max_queued_uploads=0)
    with pytest.raises(ValueError, match="max_queued_uploads must be an int >= 1"):
        ObjectStore(max_queued_uploads=1.5)  # type: ignore[arg-type]

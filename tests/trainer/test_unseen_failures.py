"""A failed save nobody saw fails the run (issue 32 item 1, invariant 14).

Leaving an engine's block normally, ``close()`` and ``aclose()`` raise the first save failure
no caller saw on its handle, from ``wait()`` or from a later save; the process exits non-zero.
A block already left by the user's exception keeps that exception and logs the failure.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from asyncckpt import CheckpointEngine, SyncCheckpointEngine, faults
from asyncckpt.core import layout as L
from asyncckpt.errors import SaveFailed


@pytest.fixture(autouse=True)
def _disarm():
    yield
    faults.clear()


def _state(v: float) -> dict:
    return {"w": torch.full((64,), v)}


def test_leaving_the_block_raises_a_failed_last_save(tmp_path):
    with pytest.raises(SaveFailed, match=r"step 2 failed: .*No space left"):
        with SyncCheckpointEngine(tmp_path, keep=None) as engine:
            engine.save(1, _state(1)).committed_sync(60)
            faults.inject("mid_shard_write", "enospc")
            engine.save(2, _state(2))  # the handle is dropped: nobody looks at it
    assert L.read_tracker(tmp_path) == 1  # the failure was real: step 1 is the latest


def test_close_raises_it_and_only_once(tmp_path):
    engine = SyncCheckpointEngine(tmp_path, keep=None)
    engine.__enter__()
    faults.inject("before_rename", "raise")
    engine.save(1, _state(1))
    with pytest.raises(SaveFailed, match="step 1 failed"):
        engine.close()
    engine.close()  # stopped already; the failure was delivered: nothing more to say


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_leaving_the_async_block_and_aclose_raise_it(tmp_path, anyio_backend):
    with pytest.raises(SaveFailed, match="step 3 failed"):
        async with CheckpointEngine(tmp_path / "a", keep=None) as engine:
            faults.inject("before_rename", "eio")
            await engine.save(3, _state(3))
    engine = CheckpointEngine(tmp_path / "b", keep=None)
    await engine.start()
    faults.inject("before_rename", "eio")
    await engine.save(4, _state(4))
    with pytest.raises(SaveFailed, match="step 4 failed"):
        await engine.aclose()


def test_a_failure_seen_on_its_handle_is_not_raised_again(tmp_path):
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        faults.inject("before_rename", "raise")
        handle = engine.save(1, _state(1))
        with pytest.raises(SaveFailed):
            handle.committed_sync(60)
    # and one raised by wait() neither
    with SyncCheckpointEngine(tmp_path / "w", keep=None) as engine:
        faults.inject("before_rename", "raise")
        engine.save(1, _state(1))
        with pytest.raises(SaveFailed):
            engine.wait()


def test_the_first_unseen_failure_is_raised_and_later_ones_are_named(tmp_path):
    from asyncckpt.stats import SaveStats
    from asyncckpt.testing import parts
    from asyncckpt.trainer.jobs import SaveHandle

    with pytest.raises(SaveFailed, match="step 7 failed") as info:
        with SyncCheckpointEngine(tmp_path, keep=None) as engine:
            jobs = parts(engine).jobs
            for step in (7, 8):  # two saves that failed before reaching the worker
                jobs.fail_unsent(
                    SaveHandle(step, SaveStats(step)), SaveFailed(f"step {step} failed")
                )
    assert any("step 8 failed" in note for note in info.value.__notes__)


def test_a_block_left_by_an_exception_keeps_it_and_logs_the_failure(tmp_path, caplog):
    from asyncckpt.testing import parts

    caplog.set_level(logging.INFO, logger="asyncckpt")
    with pytest.raises(KeyError, match="users own"):
        with SyncCheckpointEngine(tmp_path, keep=None) as engine:
            faults.inject("before_rename", "raise")
            engine.save(5, _state(5))
            parts(engine).drain()  # failed in the background, unseen
            raise KeyError("users own")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("step 5 failed" in m and "left by KeyError" in m for m in errors), errors


_SCRIPT = """
import asyncio, sys, torch
from asyncckpt import CheckpointEngine, SyncCheckpointEngine, faults

root, mode = sys.argv[1], sys.argv[2]
state = {"w": torch.ones(16)}
if mode == "sync":
    with SyncCheckpointEngine(root, keep=None) as engine:
        engine.save(1, state).committed_sync(60)
        faults.inject("mid_shard_write", "enospc")
        engine.save(2, state)
else:
    async def main():
        async with CheckpointEngine(root, keep=None) as engine:
            await (await engine.save(1, state)).committed()
            faults.inject("mid_shard_write", "enospc")
            await engine.save(2, state)
    asyncio.run(main())
print("EXITED NORMALLY")
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_process_exits_non_zero(tmp_path, mode):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "root"), mode],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert out.returncode != 0, out.stdout + out.stderr
    assert "EXITED NORMALLY" not in out.stdout
    assert "SaveFailed" in out.stderr and "step 2 failed" in out.stderr, out.stderr
    assert L.read_tracker(tmp_path / "root") == 1

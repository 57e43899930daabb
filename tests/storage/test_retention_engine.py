"""Retention wired into the engine: pruning strictly after the commit (issue 3)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from asyncckpt import (
    CheckpointEngine,
    KeepBest,
    KeepLast,
    Retention,
    SaveFailed,
    SyncCheckpointEngine,
    faults,
)
from asyncckpt.core import layout as L

pytestmark = pytest.mark.anyio


def steps_on_disk(root) -> list[int]:
    return sorted(
        s for n in os.listdir(root) if (s := L.parse_dir_name("global_step", n)) is not None
    )


async def test_keep_last_1_keeps_the_old_checkpoint_until_the_new_one_commits(tmp_path):
    async with CheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        await (await engine.save(1, {"w": torch.full((4,), 1.0)})).committed()
        faults.inject("before_rename", "delay:1.5")  # a deliberately slow commit
        handle = await engine.save(2, {"w": torch.full((4,), 2.0)})
        deadline = time.monotonic() + 10
        while not any(n.startswith(L.TMP_PREFIX + "global_step_2") for n in os.listdir(tmp_path)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # Mid-commit: the old checkpoint is on disk, named by the tracker, and loadable.
        assert steps_on_disk(tmp_path) == [1] and L.read_tracker(tmp_path) == 1
        probe = {"w": torch.zeros(4)}
        assert await CheckpointEngine(tmp_path).load(probe, step=1) == 1
        assert probe["w"][0] == 1.0
        await handle.committed()
        await engine.wait()
        deadline = time.monotonic() + 10
        while steps_on_disk(tmp_path) != [2]:  # pruning runs in the background after commit
            assert time.monotonic() < deadline, steps_on_disk(tmp_path)
            time.sleep(0.02)
    assert L.read_tracker(tmp_path) == 2
    assert not [n for n in os.listdir(tmp_path) if L.is_leftover(n)]


async def test_a_failed_save_prunes_nothing(tmp_path):
    async with CheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        await (await engine.save(1, {"w": torch.ones(4)})).committed()
        for point in ("mid_shard_write", "before_rename"):
            faults.inject(point, "enospc")
            handle = await engine.save(2, {"w": torch.ones(4)})
            with pytest.raises(SaveFailed):
                await handle.committed()
            assert steps_on_disk(tmp_path) == [1] and L.read_tracker(tmp_path) == 1
        assert not [n for n in os.listdir(tmp_path) if L.is_leftover(n)]


def test_fifty_saves_with_keep_last_3_or_best_1_leave_exactly_the_expected_steps(tmp_path):
    losses = {s: abs(((s * 37) % 50) - 21) / 10 for s in range(1, 51)}  # best: step with min
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(3) | KeepBest(1, "loss")) as engine:
        for s in range(1, 51):
            engine.save(s, {"w": torch.full((8,), float(s))}, metrics={"loss": losses[s]})
        engine.wait()
        best = min(losses, key=lambda s: (losses[s], -s))
        expected = sorted({48, 49, 50, best})
        deadline = time.monotonic() + 20
        while steps_on_disk(tmp_path) != expected:
            assert time.monotonic() < deadline, (steps_on_disk(tmp_path), expected)
            time.sleep(0.05)
        usage = engine.disk_usage()
    assert [c.step for c in engine.list_checkpoints()] == expected
    assert usage["checkpoints"] == 4 and usage["committed_bytes"] > 0 and usage["free_bytes"] > 0


async def test_protect_and_resumed_from_are_never_pruned(tmp_path):
    async with CheckpointEngine(tmp_path) as engine:
        for s in (1, 2, 3):
            await engine.save(s, {"w": torch.full((2,), float(s))})
    engine = CheckpointEngine(tmp_path, keep=KeepLast(1))
    t = {"w": torch.zeros(2)}
    assert await engine.load(t, step=2) == 2  # this run resumes from 2
    engine.protect(1)
    async with engine:
        await (await engine.save(10, t)).committed()
        await engine.wait()
        time.sleep(0.5)
        # 3 is neither newest, protected nor resumed-from; 2 is resumed-from until 10 commits:
        # that commit releases it, so after it only 1 (protected) and 10 (newest) stay.
        assert steps_on_disk(tmp_path) == [1, 10]


def test_protect_reaches_a_save_already_handed_to_the_worker(tmp_path):
    """A save's prune kept the steps pinned when the save was handed over: ``protect(10)``
    while save 20 was being written returned, and that save's prune deleted step 10. Now
    the pin reaches the worker before ``protect`` returns."""
    state = {"w": torch.arange(100.0)}
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        engine.save(10, state).committed_sync(60)
        faults.inject("before_rename", "delay", seconds=2.0)
        try:
            handle = engine.save(20, state)  # in flight: held 2 s before its commit
            engine.protect(10)
            handle.committed_sync(60)
        finally:
            faults.clear()
        engine.wait()
        assert steps_on_disk(tmp_path) == [10, 20]
        engine.save(30, state).committed_sync(60)  # later saves keep it too
        deadline = time.monotonic() + 30  # (the prune follows the commit)
        while steps_on_disk(tmp_path) != [10, 30] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert steps_on_disk(tmp_path) == [10, 30]


def test_a_step_being_loaded_is_not_pruned_under_the_load(tmp_path, monkeypatch):
    """Rolling back to step 10 while save 20 commits with ``KeepLast(1)``: that save's prune
    deleted step 10 half-way through its read (``Vanished``; invariant 3: never one being
    loaded). A load now pins its step in the worker while it reads. (A large checkpoint's
    read is a sleep before the read here.)"""
    from asyncckpt.trainer import restore

    read = restore.Restorer.load_dir.__wrapped__  # (the read itself, below the pin)

    def slow_read(self, *args, **kwargs):
        time.sleep(3.0)
        return read(self, *args, **kwargs)

    state = {"w": torch.arange(100.0)}
    with SyncCheckpointEngine(tmp_path, keep=KeepLast(1)) as engine:
        engine.save(10, state).committed_sync(60)
        faults.inject("before_rename", "delay", seconds=1.0)
        try:
            handle = engine.save(20, {"w": torch.arange(100.0) + 1})  # commits in ~1 s
            monkeypatch.setattr(restore.Restorer, "load_dir", restore._kept_while_read(slow_read))
            target = {"w": torch.zeros(100)}
            assert engine.load(target, step=10) == 10
            assert torch.equal(target["w"], state["w"])
            handle.committed_sync(60)
        finally:
            faults.clear()
            monkeypatch.undo()
        engine.save(30, state).committed_sync(60)  # the pin went with the load
        deadline = time.monotonic() + 30
        while steps_on_disk(tmp_path) != [30] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert steps_on_disk(tmp_path) == [30]


@pytest.mark.parametrize("n, kept", [(1, [30, 1000]), (2, [20, 30, 1000])])
def test_allow_older_steps_never_prunes_the_step_it_just_committed(tmp_path, n, kept):
    """Issue 28 item 4: a stale higher step (an older run's 1000) made every new save of an
    allow_older_steps run with KeepLast be deleted by its own prune."""
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1000, {"w": torch.full((4,), 1000.0)})
        engine.wait()
    with SyncCheckpointEngine(
        tmp_path, keep=KeepLast(n), retention=Retention(allow_older_steps=True)
    ) as engine:
        for step in (10, 20, 30):
            engine.save(step, {"w": torch.full((4,), float(step))})
            engine.wait()
    # Closed: every prune has run. The run keeps its own n newest; the stale higher step
    # (which the tracker names) is left alone and takes none of KeepLast's places.
    assert steps_on_disk(tmp_path) == kept
    assert L.read_tracker(tmp_path) == 1000
    probe = {"w": torch.zeros(4)}
    with SyncCheckpointEngine(tmp_path) as engine:
        assert engine.load(probe, step=30) == 30
    assert probe["w"][0] == 30.0

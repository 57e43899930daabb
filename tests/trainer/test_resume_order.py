"""A resume that reads before it starts the engine (the README's order: ``load_latest`` and then
``async with engine``) resumes the step an orphaned worker is still committing, as a resume
after the start does: the read waits for that worker first (invariant 12: a returned save is
committed even if the trainer died; a read that does not wait resumes an older step)."""

from __future__ import annotations

import anyio
import torch
from statecmp import assert_same
from test_flush_on_death import expected, gone, run_trainer

from asyncckpt import CheckpointEngine, SyncCheckpointEngine


def blank() -> dict:
    return {"w": torch.zeros(1 << 22), "b": torch.zeros(10, dtype=torch.int64)}


def test_load_latest_before_start_waits_for_the_orphaned_worker(tmp_path):
    worker = run_trainer(tmp_path, "kill", "delay:4.0")  # step 2 committed after the death
    assert not gone(worker)
    engine = SyncCheckpointEngine(tmp_path / "r", keep=None)
    target = blank()
    assert engine.load_latest(target) == 2  # not 1: the orphan's commit was waited for
    assert_same(target, expected(2))
    with engine:  # and the run goes on from there
        engine.save(3, target).committed_sync()
    assert engine.latest_step() == 3


def test_a_rank_with_no_orphan_of_its_own_waits_for_the_others(tmp_path):
    """A one-rank run dies with step 2 committing; it comes back on two ranks. Rank 0 waited
    for its rank's orphaned worker and loaded step 2; rank 1 had no orphan of its own and
    loaded step 1 at once: a mix of steps. Every rank now waits for every orphan at work."""
    from asyncckpt import Distributed

    worker = run_trainer(tmp_path, "kill", "delay:4.0")  # step 2 committed after the death
    assert not gone(worker)
    engine = SyncCheckpointEngine(
        tmp_path / "r", keep=None, distributed=Distributed(rank=1, world_size=2)
    )
    target = blank()
    assert engine.load_latest(target) == 2
    assert_same(target, expected(2))


def test_async_load_latest_before_start_waits_too(tmp_path):
    worker = run_trainer(tmp_path, "kill", "delay:4.0")
    assert not gone(worker)

    async def main() -> int | None:
        engine = CheckpointEngine(tmp_path / "r", keep=None)
        target = blank()
        step = await engine.load_latest(target)
        assert_same(target, expected(2))
        return step

    assert anyio.run(main) == 2


def test_load_by_step_before_start_waits_for_the_orphaned_worker(tmp_path):
    worker = run_trainer(tmp_path, "kill", "delay:4.0")
    assert not gone(worker)
    engine = SyncCheckpointEngine(tmp_path / "r", keep=None)
    target = blank()
    assert engine.load(target, step=2) == 2  # committing when asked: waited for, not missing
    assert_same(target, expected(2))


def test_a_reader_does_not_wait_for_a_live_engines_worker(tmp_path):
    """wait_for_orphaned_workers (a reader of a root it does not write, e.g. Lightning's
    ckpt_path="last") waits for orphans only: a live engine's worker runs for days."""
    import threading

    from asyncckpt.trainer.supervisor import wait_for_orphaned_workers

    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, blank()).committed_sync()
        reader = threading.Thread(target=wait_for_orphaned_workers, args=(tmp_path,))
        reader.start()
        reader.join(60)  # before: waited out the orphan deadline, then raised RootLocked
        assert not reader.is_alive()

"""Two copies of the state serve both tiers (issue 35, item 1): with the memory tier on, a disk
save is staged into one of the memory tier's two slots, held as the newest memory checkpoint
and written from there; no slot of its own is allocated. A slot being written is not staged
into again before its write is done; a trainer killed with such a save in flight leaves both
that save and the newer memory save behind it, bit for bit."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import torch
from statecmp import assert_same
from test_flush_on_death import wait_gone
from test_memory_tier import N, load, manifest, state_at

from asyncckpt import MemoryTier, Schedule, SyncCheckpointEngine, faults, verify
from asyncckpt.staging import arenas as staging
from asyncckpt.testing import parts


def advance(state: dict, step: int) -> None:
    new = state_at(step)
    for k in state:
        state[k].copy_(new[k])


def slot_bytes(engine: SyncCheckpointEngine) -> int:
    """Staging memory allocated by the engine: every slot's arenas."""
    return sum(s.nbytes for s in parts(engine).saver.slots)


def test_disk_and_memory_saves_share_two_slots(tmp_path):
    """Before: a disk save staged into a slot of its own beside the memory tier's two (3x)."""
    state = state_at(1)
    nbytes = sum(staging.plan_arenas(state)[1])
    schedule = Schedule(every_steps=2, memory_every_steps=1)
    with SyncCheckpointEngine(tmp_path, keep=None, schedule=schedule) as engine:
        for step in (1, 2, 3, 4, 5, 6):
            advance(state, step)
            tier = engine.due(step)
            h = engine.save(step, state, tier=tier)
            if tier == "disk":
                h.committed_sync(120)
        assert slot_bytes(engine) == 2 * nbytes
        assert (engine.stats.disk_saves_shared, engine.stats.disk_saves_unshared) == (3, 0)
    report = verify(tmp_path)
    assert report.ok and [c.step for c in report.checkpoints] == [2, 4, 6], report
    assert "tier" not in manifest(tmp_path, 6)  # a disk save, as ever
    step, target = load(tmp_path)
    assert step == 6
    assert_same(target, state_at(6))


def test_prepare_allocates_the_memory_tiers_slots_only(tmp_path):
    """Before: prepare() allocated the disk save's slot, beside the two of the memory tier."""
    state = state_at(1)
    nbytes = sum(staging.plan_arenas(state)[1])
    schedule = Schedule(every_steps=10, memory_every_steps=2)
    with SyncCheckpointEngine(tmp_path, keep=None, schedule=schedule) as engine:
        engine.prepare(state)
        assert slot_bytes(engine) == 2 * nbytes
        engine.save(2, state, tier="memory")
        engine.save(10, state).committed_sync(120)
        assert slot_bytes(engine) == 2 * nbytes  # nothing re-laid out or added


def test_a_slot_being_written_is_not_staged_into_before_the_write_is_done(tmp_path):
    """Disk step 2 is written slowly from slot B. Memory step 3 goes into slot A (the worker
    let go of step 1 for step 2); memory step 4 finds A held and B still being written: it is
    skipped (issue 53: before, it waited for the write; test_memory_skip.py holds the write),
    never staged into B: step 2 on disk is step 2's state, not step 4's bytes. Memory step 5,
    after the write, goes into B."""
    state = state_at(1)
    schedule = Schedule(every_steps=2, memory_every_steps=1)
    with SyncCheckpointEngine(
        tmp_path, keep=None, schedule=schedule, memory=MemoryTier(persist_on_close=True)
    ) as engine:
        engine.save(1, state, tier="memory")
        advance(state, 2)
        faults.inject("mid_shard_write", "delay", seconds=0.5)  # every piece written
        disk = engine.save(2, state)
        faults.clear()
        advance(state, 3)
        engine.save(3, state, tier="memory")
        advance(state, 4)
        engine.save(4, state, tier="memory")  # skipped (or into B, if its write is done)
        disk.committed_sync(120)
        advance(state, 5)
        assert not engine.save(5, state, tier="memory").skipped
        assert engine.stats.disk_saves_shared == 1
    report = verify(tmp_path)
    assert report.ok and [c.step for c in report.checkpoints] == [2, 5], report
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        target = {"w": torch.zeros(N), "b": torch.zeros(10, dtype=torch.int64)}
        assert engine.load(target, step=2) == 2
        assert_same(target, state_at(2))
    step, target = load(tmp_path)  # close wrote the memory save held: step 5, whole
    assert step == 5
    assert_same(target, state_at(5))


def test_an_overlapped_disk_save_falls_back_to_a_slot_of_its_own_and_says_so(tmp_path, caplog):
    state = state_at(1)
    schedule = Schedule(every_steps=2, memory_every_steps=1)
    caplog.set_level(logging.INFO, logger="asyncckpt")
    with SyncCheckpointEngine(tmp_path, keep=None, schedule=schedule) as engine:
        engine.save(1, state, tier="memory")
        for step in (2, 4):
            advance(state, step)
            engine.save(step, state, overlap=True).committed_sync(120)
        assert (engine.stats.disk_saves_shared, engine.stats.disk_saves_unshared) == (0, 2)
    said = [r for r in caplog.records if "not the memory tier's" in r.getMessage()]
    assert len(said) == 1 and "overlapped" in said[0].getMessage()  # once per reason
    step, target = load(tmp_path)
    assert step == 4
    assert_same(target, state_at(4))


TRAINER = """
import json, os, signal, sys
from asyncckpt import Schedule, SyncCheckpointEngine, faults
sys.path.insert(0, sys.argv[2])
from test_memory_tier import state_at
from test_memory_shared import advance
engine = SyncCheckpointEngine(
    sys.argv[1], keep=None, schedule=Schedule(every_steps=2, memory_every_steps=1)
)
engine.__enter__()  # never left: the trainer dies inside
state = state_at(1)
engine.save(1, state, tier="memory")
advance(state, 2)
faults.inject("mid_shard_write", "delay", seconds=0.3)
engine.save(2, state)  # returned: staged, being written from a memory slot
faults.clear()
advance(state, 3)
engine.save(3, state, tier="memory")  # held beside the slot being written
advance(state, 4)  # the loop goes on mutating its state
print(json.dumps({"worker": engine.worker_pid}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_trainer_killed_with_a_shared_disk_save_in_flight_leaves_both_saves(tmp_path):
    """Invariant 12: the disk save whose save() returned is committed, then the newer memory
    save the worker holds is written too, each bit for bit."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "r"), str(Path(__file__).parents[1])],
            stdout=out,
            stderr=err,
            timeout=300,
        )
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "err").read_text()
    wait_gone(json.loads((tmp_path / "out").read_text())["worker"], 120)
    root = tmp_path / "r"
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [2, 3], report
    assert manifest(root, 3)["persisted_because"] == "trainer died"
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {"w": torch.zeros(N), "b": torch.zeros(10, dtype=torch.int64)}
        assert engine.load(target, step=2) == 2
        assert_same(target, state_at(2))
    step, target = load(root)
    assert step == 3
    assert_same(target, state_at(3))


def test_a_budget_below_the_state_with_the_memory_tier_on_is_said_once(tmp_path, caplog):
    """Disk saves are written from the memory tier's whole-state slots: a staging budget
    below the state bounds nothing then. Its docs said such a state was refused; it was
    staged whole without a word. Now the first save says so (a warning, once)."""
    from asyncckpt import Staging

    state = {"a": torch.randn(1 << 20)}  # 4 MiB
    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        with SyncCheckpointEngine(
            tmp_path,
            staging=Staging(max_host_bytes=1 << 20),
            schedule=Schedule(memory_every_steps=100),
        ) as engine:
            for step in (1, 2):
                engine.save(step, state).committed_sync()
    said = [r for r in caplog.records if "does not bound them" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]

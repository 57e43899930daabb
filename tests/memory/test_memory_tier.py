"""The memory tier: ``save(step, state, tier="memory")`` copies and writes nothing; the worker
keeps the newest complete memory checkpoint and writes it, committed like any save, when the
trainer dies (SIGKILL), on SIGTERM, and at close only if asked
(``MemoryTier(persist_on_close=True)``).
Never a torn one, never one older than what is on disk."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from statecmp import assert_same
from test_flush_on_death import wait_gone

from asyncckpt import MemoryTier, Schedule, StagingMemoryError, SyncCheckpointEngine, faults, verify
from asyncckpt.cli import main
from asyncckpt.core import layout as L
from asyncckpt.staging import arenas as staging
from asyncckpt.testing import parts

N = 1 << 20  # "w": 4 MiB, copied by the copy pool before the mid_stage point; "b": small

TRAINER = """
import json, os, signal, sys, time, torch
from asyncckpt import MemoryTier, SyncCheckpointEngine, faults
root, scenario = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
from test_memory_tier import state_at
engine = SyncCheckpointEngine(
    root, keep=None, memory=MemoryTier(persist_on_close=scenario == "close_option")
)
engine.__enter__()
state = state_at(1)
if scenario == "first_disk":  # the first save sends the slot's arenas: killed at once
    engine.save(1, state)
    print(json.dumps({"worker": engine.worker_pid}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
engine.save(1, state).committed_sync()
print(json.dumps({"worker": engine.worker_pid}), flush=True)

def advance(step):
    new = state_at(step)
    for k in state:
        state[k].copy_(new[k])

def memory_save(step):
    advance(step)
    engine.save(step, state, tier="memory")
    print(json.dumps({"held": step}), flush=True)  # save() returned

if scenario == "kill":
    for step in (2, 3, 4):
        memory_save(step)
    advance(5)  # the loop goes on mutating its state
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario == "kill_mid_stage":
    memory_save(2)
    memory_save(3)
    faults.inject("mid_stage", "kill")  # the trainer dies half-way through copying step 4
    memory_save(4)
elif scenario.startswith("worker_dies:"):
    memory_save(2)
    # Travels with the memory save: the worker dies at this point while it writes step 3.
    faults.inject(scenario.split(":", 1)[1], "kill")
    memory_save(3)
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario == "older_than_disk":
    memory_save(2)
    advance(3)
    engine.save(3, state).committed_sync()
    os.kill(os.getpid(), signal.SIGKILL)
elif scenario == "sigterm":
    memory_save(2)
    memory_save(3)
    os.kill(os.getpid(), signal.SIGTERM)  # the handler writes step 3, drains, and dies of it
    time.sleep(60)
elif scenario in ("close", "close_option"):
    memory_save(2)
    engine.close()
    print(json.dumps({"closed": True}), flush=True)
"""


def state_at(step: int) -> dict:
    """The state at ``step``: every tensor a function of the step alone."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(N, generator=g), "b": torch.arange(10) * step}


def run_trainer(tmp_path: Path, scenario: str) -> tuple[int, list[dict]]:
    """Run the trainer until it ends; returns its exit code and what it printed."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    # Files, not pipes: the orphaned worker inherits the trainer's output.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run(
            [
                sys.executable,
                str(script),
                str(tmp_path / "r"),
                scenario,
                str(Path(__file__).parents[1]),
            ],
            stdout=out,
            stderr=err,
            timeout=300,
        )
    lines = [json.loads(x) for x in (tmp_path / "out").read_text().splitlines() if x.strip()]
    return proc.returncode, lines


def finish(tmp_path: Path, lines: list[dict]) -> Path:
    """Wait for the trainer's worker to have exited (it writes, then exits by itself)."""
    wait_gone(lines[0]["worker"], 120)
    return tmp_path / "r"


def load(root: Path) -> tuple[int | None, dict]:
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {"w": torch.zeros(N), "b": torch.zeros(10, dtype=torch.int64)}
        return engine.load_latest(target), target


def manifest(root: Path, step: int) -> dict:
    return json.loads((root / f"global_step_{step}" / "asyncckpt_manifest.json").read_text())


def test_a_memory_save_is_written_when_the_trainer_is_killed(tmp_path, capsys):
    code, lines = run_trainer(tmp_path, "kill")
    assert code == -signal.SIGKILL, (tmp_path / "err").read_text()
    assert [x["held"] for x in lines if "held" in x] == [2, 3, 4]
    root = finish(tmp_path, lines)
    assert L.read_tracker(root) == 4
    step, target = load(root)
    assert step == 4
    assert_same(target, state_at(4))
    m = manifest(root, 4)
    assert (m["tier"], m["persisted_because"]) == ("memory", "trainer died")
    assert "tier" not in manifest(root, 1)
    report = verify(root)
    # Only the newest memory checkpoint is written: 2 and 3 never touched the disk.
    assert report.ok and [c.step for c in report.checkpoints] == [1, 4], report
    assert report.leftovers == []
    # `ls` and `stats` say which tier each came from.
    for cmd in ("ls", "stats"):
        assert main([cmd, str(root), "--json"]) == 0
        listed = {c["step"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
        assert (listed[4]["tier"], listed[4]["persisted_because"]) == ("memory", "trainer died")
        assert (listed[1]["tier"], listed[1]["persisted_because"]) == ("disk", None)
        assert main([cmd, str(root)]) == 0
        assert "4 (memory: trainer died)" in capsys.readouterr().out


def test_the_first_save_is_committed_when_the_trainer_is_killed_at_once(tmp_path):
    """The worker maps a new arena by fetching its descriptor from the trainer: before, a
    trainer killed right after the first save returned left the worker unable to receive it
    (it exited, and nothing was committed). save() now returns once the arena is mapped."""
    code, lines = run_trainer(tmp_path, "first_disk")
    assert code == -signal.SIGKILL, (tmp_path / "err").read_text()
    root = finish(tmp_path, lines)
    step, target = load(root)
    assert step == 1
    assert_same(target, state_at(1))


def test_a_trainer_killed_while_it_stages_leaves_the_previous_memory_save(tmp_path):
    """Killed half-way through copying step 4 into the other slot: step 3, whole, is written."""
    code, lines = run_trainer(tmp_path, "kill_mid_stage")
    assert code == -signal.SIGKILL, (tmp_path / "err").read_text()
    assert [x["held"] for x in lines if "held" in x] == [2, 3]
    root = finish(tmp_path, lines)
    step, target = load(root)
    assert step == 3
    assert_same(target, state_at(3))
    assert not (root / "global_step_4").exists()


@pytest.mark.parametrize("point", ["mid_shard_write", "before_rename", "before_tracker"])
def test_a_worker_killed_while_it_writes_a_memory_save_leaves_older_ones_intact(tmp_path, point):
    code, lines = run_trainer(tmp_path, f"worker_dies:{point}")
    assert code == -signal.SIGKILL, (tmp_path / "err").read_text()
    root = finish(tmp_path, lines)
    step, target = load(root)  # the start cleans up what the dead worker left
    report = verify(root)
    assert report.ok and report.leftovers == [], report
    if point == "before_tracker":  # renamed into place: committed, complete and verified
        assert step == 3 and [c.step for c in report.checkpoints] == [1, 3]
        assert_same(target, state_at(3))
    else:
        assert step == 1 and [c.step for c in report.checkpoints] == [1]
        assert_same(target, state_at(1))


def test_a_memory_save_older_than_the_newest_commit_is_not_written(tmp_path):
    code, lines = run_trainer(tmp_path, "older_than_disk")
    assert code == -signal.SIGKILL, (tmp_path / "err").read_text()
    root = finish(tmp_path, lines)
    step, target = load(root)
    assert step == 3
    assert_same(target, state_at(3))
    assert not (root / "global_step_2").exists()


def test_sigterm_writes_the_memory_save(tmp_path):
    code, lines = run_trainer(tmp_path, "sigterm")
    assert code == -signal.SIGTERM, (tmp_path / "err").read_text()
    root = finish(tmp_path, lines)
    step, target = load(root)
    assert step == 3
    assert_same(target, state_at(3))
    m = manifest(root, 3)
    assert (m["tier"], m["persisted_because"]) == ("memory", "preemption")


@pytest.mark.parametrize("option", [False, True])
def test_close_writes_the_memory_save_only_if_asked(tmp_path, option):
    code, lines = run_trainer(tmp_path, "close_option" if option else "close")
    assert code == 0, (tmp_path / "err").read_text()
    assert lines[-1] == {"closed": True}
    root = finish(tmp_path, lines)
    step, target = load(root)
    assert step == (2 if option else 1)
    assert_same(target, state_at(step))
    if option:
        assert manifest(root, 2)["persisted_because"] == "close"


# ------------------------------------------------------------------ in this process


def test_due_says_which_tier(tmp_path):
    engine = SyncCheckpointEngine(
        tmp_path, schedule=Schedule(every_steps=100, memory_every_steps=10)
    )
    due = {s: engine.due(s) for s in range(0, 201)}
    assert {s for s, t in due.items() if t == "disk"} == {100, 200}
    assert {s for s, t in due.items() if t == "memory"} == set(range(10, 201, 10)) - {100, 200}
    assert SyncCheckpointEngine(tmp_path / "x").due(10) is None  # no memory tier asked for


def test_bad_tier_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="memory_every_steps"):
        Schedule(memory_every_steps=0)
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        state = state_at(1)
        with pytest.raises(ValueError, match="tier must be"):
            engine.save(1, state, tier="ram")
        with pytest.raises(ValueError, match="overlap=True is for disk"):
            engine.save(1, state, tier="memory", overlap=True)
        engine.save(2, state, tier="memory")
        with pytest.raises(Exception, match="steps must increase"):
            engine.save(2, state, tier="memory")
    assert not list(tmp_path.glob("global_step_*"))  # close() wrote nothing


def test_the_memory_tier_checks_for_twice_the_state_before_allocating(tmp_path, monkeypatch):
    state = state_at(1)
    nbytes = sum(staging.plan_arenas(state)[1])
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, state).committed_sync()  # one slot fits

        class Mem:  # room for 1.5x the state, not 2x
            available = staging.MEMORY_HEADROOM + int(1.5 * nbytes)

        monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
        with pytest.raises(StagingMemoryError, match="memory tier keeps 2 copies"):
            engine.save(2, state, tier="memory")
        assert parts(engine).saver.memory.slots == []  # nothing allocated


def test_memory_saves_go_on_while_the_worker_writes_and_after_it_died(tmp_path):
    """A Hold is read by its own thread: memory saves do not wait for a disk write in
    progress (before: one message loop, blocked until the write ended). A worker that died
    holds nothing; the memory tier's slots are free again for its replacement."""
    state = state_at(1)
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        faults.inject("before_shard_write", "hang")
        disk = engine.save(1, state)
        for step in (2, 3, 4, 5):  # the two slots take turns: each needs the other released
            engine.save(step, state, tier="memory")
        assert not disk.done()
        os.kill(engine.worker_pid, signal.SIGKILL)
        with pytest.raises(Exception, match="died"):
            disk.committed_sync(60)
        parts(engine).jobs.take_pending_error()
        for step in (6, 7, 8):
            engine.save(step, state, tier="memory")
    assert not list(tmp_path.glob("global_step_*"))


def test_a_torn_memory_save_fails_and_the_previous_one_stays_held(tmp_path, monkeypatch):
    """Invariant 13 for the memory tier: a tensor written in place while a memory save copies
    fails it (nothing is handed to the worker), and the previous one is still what is held."""
    from test_overlap import Gate, mutate_from_a_thread

    from asyncckpt import SaveFailed, StateModifiedWhileStaging

    state = state_at(1)
    with SyncCheckpointEngine(
        tmp_path, keep=None, memory=MemoryTier(persist_on_close=True)
    ) as engine:
        engine.save(2, state, tier="memory")
        Gate(monkeypatch, during=mutate_from_a_thread(state["w"]))
        h = engine.save(3, state, tier="memory")
        assert isinstance(h.exception(), SaveFailed)
        assert isinstance(h.exception().__cause__, StateModifiedWhileStaging)
        assert parts(engine).saver.memory.held.step == 2
        monkeypatch.undo()
        with pytest.raises(SaveFailed, match="an earlier save failed"):
            engine.save(4, state, tier="memory")
    # Closing with MemoryTier(persist_on_close=True) writes the one held: step 2, whole.
    step, target = load(tmp_path)
    assert step == 2
    assert_same(target, state_at(1))


@pytest.mark.anyio
async def test_the_async_engine_takes_the_tier_too(tmp_path):
    from asyncckpt import CheckpointEngine

    engine = CheckpointEngine(
        tmp_path,
        keep=None,
        schedule=Schedule(memory_every_steps=2),
        memory=MemoryTier(persist_on_close=True),
    )
    async with engine:
        for step in range(1, 6):
            tier = engine.due(step)
            if tier:
                h = await engine.save(step, state_at(step), tier=tier)
                assert h.done()  # a memory save's handle completes at once
        assert not list(tmp_path.glob("global_step_*"))  # nothing written yet
    step, target = load(tmp_path)
    assert step == 4
    assert_same(target, state_at(4))


def _eventually(check, limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_worker_killed_while_it_holds_a_memory_save_says_which_step_is_lost(tmp_path, caplog):
    """The handle of a memory save succeeded long ago: when its worker dies, the step must be
    named (a WARNING) and counted in engine.stats until the new worker holds a newer one."""
    from asyncckpt.stats import EngineStats

    state = state_at(1)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, state).committed_sync()
        engine.save(2, state, tier="memory")
        engine.save(3, state, tier="memory")
        assert engine.stats == EngineStats(memory_saves_lost=0, memory_unprotected_step=None)
        os.kill(engine.worker_pid, signal.SIGKILL)
        _eventually(lambda: engine.stats.memory_saves_lost == 1)
        assert engine.stats.memory_unprotected_step == 3
        _eventually(lambda: any("step 3: it is lost" in r.getMessage() for r in caplog.records))
        (line,) = [r for r in caplog.records if "memory save of step 3" in r.getMessage()]
        assert line.levelno == logging.WARNING and line.name == "asyncckpt"
        engine.save(4, state, tier="memory")  # held by the replacement: the hole is closed
        assert engine.stats == EngineStats(memory_saves_lost=1, memory_unprotected_step=None)


def test_a_lost_memory_save_older_than_disk_is_no_hole(tmp_path, caplog):
    state = state_at(1)
    caplog.set_level(logging.WARNING, logger="asyncckpt")
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(2, state, tier="memory")
        engine.save(3, state).committed_sync()  # on disk, newer than the memory save
        os.kill(engine.worker_pid, signal.SIGKILL)
        _eventually(lambda: engine.worker_restarts == 1 and engine.worker_ready)
        assert engine.stats.memory_saves_lost == 0
        assert engine.stats.memory_unprotected_step is None
    assert not [r for r in caplog.records if "memory save of step" in r.getMessage()]

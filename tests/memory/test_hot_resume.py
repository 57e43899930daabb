"""A hot resume (issue 34 item 1): a trainer is SIGKILLed; its worker, with
``MemoryTier(hold_seconds=)``, commits what it was writing and then offers that step from its
shared memory; a new engine on the same root and rank loads it from there, checked against the
manifest, bit for bit. Anything else (no surviving worker, another step, bytes that do not
match) reads the disk, and ``last_load_report`` says which path was taken and why.

Each trainer is a subprocess (its death is a real SIGKILL; the worker outlives it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from statecmp import assert_same
from test_flush_on_death import wait_gone

from asyncckpt import (
    MemoryTier,
    StateMismatch,
    SyncCheckpointEngine,
    faults,
    verify,
)
from asyncckpt.memory.hot_resume import NO_WORKER

N = 1 << 20  # "w": 4 MiB; "b": a small tensor; "meta": an object

TRAINER = """
import json, os, signal, sys
from asyncckpt import MemoryTier, SyncCheckpointEngine, faults
root, scenario, hold = sys.argv[1], sys.argv[2], float(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from test_hot_resume import state_at
engine = SyncCheckpointEngine(root, keep=None, memory=MemoryTier(hold_seconds=hold))
engine.__enter__()  # never left: the trainer dies inside
state = state_at(1)
engine.save(1, state).committed_sync()
for point, action in json.loads(sys.argv[5]).items():  # for the saves after step 1
    faults.inject(point, action)
print(json.dumps({"worker": engine.worker_pid}), flush=True)

def advance(step):
    new = state_at(step)
    for k in ("w", "b"):
        state[k].copy_(new[k])
    state["meta"] = new["meta"]

if scenario == "memory":
    for step in (2, 3):
        advance(step)
        engine.save(step, state, tier="memory")  # returned: held by the worker
elif scenario == "disk":
    advance(2)
    engine.save(2, state)  # returned (staged): the worker commits it after the death
advance(9)  # the loop goes on mutating its state
os.kill(os.getpid(), signal.SIGKILL)
"""


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(N, generator=g),
        "b": torch.arange(10) * step,
        "meta": {"step": step, "lr": 0.1 * step},
    }


def blank() -> dict:
    return {"w": torch.zeros(N), "b": torch.zeros(10, dtype=torch.int64), "meta": {}}


def run_trainer(
    tmp_path: Path, scenario: str, hold: float, env: dict | None = None, later: dict | None = None
) -> int:
    """Run the trainer until its SIGKILL; returns its worker's pid. ``later``: fault points
    armed after step 1 committed (point -> action)."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    here = str(Path(__file__).parents[1])
    # Files, not pipes: the orphaned worker inherits the trainer's output.
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        proc = subprocess.run(
            [
                sys.executable,
                str(script),
                str(tmp_path / "r"),
                scenario,
                str(hold),
                here,
                json.dumps(later or {}),
            ],
            stdout=out,
            stderr=err,
            timeout=300,
            env={**os.environ, **(env or {})},
        )
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "err").read_text()
    return json.loads((tmp_path / "out").read_text().splitlines()[0])["worker"]


def load(root: Path, target: dict | None = None) -> tuple[int | None, dict, object]:
    target = blank() if target is None else target
    with SyncCheckpointEngine(root, keep=None) as engine:
        step = engine.load_latest(target)
        return step, target, engine.last_load_report


def test_hot_resume_after_a_memory_save(tmp_path):
    worker = run_trainer(tmp_path, "memory", hold=120)
    step, target, report = load(tmp_path / "r")
    assert step == 3
    assert report.source == "memory", report.source_reason
    assert_same(target, state_at(3))
    # Taken: the worker that held it is gone (its memory freed), long before hold_seconds.
    wait_gone(worker, 30)
    assert verify(tmp_path / "r").ok  # and the step it persisted is on disk, whole


#: A restarted trainer, alone in its process: what it imported is its own.
RESUMER = """
import json, sys
import torch
from asyncckpt import SyncCheckpointEngine
target = {"w": torch.zeros(int(sys.argv[2])), "b": torch.zeros(10, dtype=torch.int64), "meta": {}}
with SyncCheckpointEngine(sys.argv[1], keep=None) as engine:
    step = engine.load_latest(target)
    dcp = "torch.distributed.checkpoint" in sys.modules
    print(json.dumps({"step": step, "source": engine.last_load_report.source, "dcp": dcp}))
"""


def test_a_restart_that_resumes_from_memory_never_imports_dcp(tmp_path):
    """``torch.distributed.checkpoint`` takes about a second to import (DTensor's op tables),
    a third of a small trainer's way back. Only the worker writes DCP and a resume from memory
    reads no file, so the restarted trainer must not wait for it (it did: asyncckpt imported
    it with itself)."""
    run_trainer(tmp_path, "memory", hold=120)
    out = subprocess.run(
        [sys.executable, "-c", RESUMER, str(tmp_path / "r"), str(N)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"step": 3, "source": "memory", "dcp": False}, (got, out.stderr[-3000:])


#: The worker's commit of the step it persists after the death waits this long (a fault).
SLOW_COMMIT_S = 20


def steps(root: Path) -> list[int]:
    return [c.step for c in verify(root).checkpoints]


def slow_commit(tmp_path: Path, **later: str) -> tuple[Path, SyncCheckpointEngine, dict]:
    """The trainer, whose worker takes SLOW_COMMIT_S to commit step 3 (before its metadata)
    with the faults ``later`` armed too; the root, a new engine (not started) and a blank
    target."""
    run_trainer(
        tmp_path, "memory", hold=120, later={"before_metadata": f"delay:{SLOW_COMMIT_S}", **later}
    )
    root = tmp_path / "r"
    return root, SyncCheckpointEngine(root, keep=None), blank()


def shards_of_step_3(root: Path) -> list[str]:
    """The shard files under ``root`` but those of step 1 (committed first)."""
    (first,) = [c.path for c in verify(root).checkpoints if c.step == 1]
    return [str(p) for p in root.rglob("*.distcp") if first not in p.parents]


def test_hot_resume_takes_the_step_while_it_is_committed(tmp_path):
    # The worker offers step 3 before writing it, and then takes SLOW_COMMIT_S to commit it:
    # a new engine loads it meanwhile, checked against the checksums offered, and load_latest
    # returns once it found it committed with those checksums (start() waited for it anyway).
    root, engine, target = slow_commit(tmp_path)
    step = engine.load_latest(target)  # before start()
    report = engine.last_load_report
    assert (step, report.source) == (3, "memory"), report.source_reason
    assert "before it was written" in report.source_reason
    assert steps(root) == [1, 3]  # returned once step 3's commit, checked, was over
    assert_same(target, state_at(3))
    with engine:
        assert engine.latest_step() == 3
    assert verify(root).ok and steps(root) == [1, 3]


def test_a_run_of_another_size_waits_for_the_step_a_worker_offers_while_committing(tmp_path):
    """A one-rank run dies with step 3 committing; it comes back on two ranks. Its worker's
    early offer (no vote: one rank's part) is not taken by several ranks, and the load went
    on to step 1 while step 3 still committed. It now waits for that commit."""
    from asyncckpt import Distributed

    run_trainer(tmp_path, "memory", hold=120, later={"before_metadata": f"delay:{SLOW_COMMIT_S}"})
    root = tmp_path / "r"
    engine = SyncCheckpointEngine(root, keep=None, distributed=Distributed(rank=0, world_size=2))
    target = blank()
    assert engine.load_latest(target) == 3, engine.last_load_report
    assert_same(target, state_at(3))


def test_hot_resume_reads_no_file(tmp_path, monkeypatch):
    # The worker offers step 3 before it writes a byte of it (here: and then waits
    # SLOW_COMMIT_S before writing): the new engine needs no file of it.
    from asyncckpt.memory import hot_resume

    root, engine, target = slow_commit(tmp_path, before_shard_write=f"delay:{SLOW_COMMIT_S}")
    real, written = hot_resume.load_offered, []

    def load_offered(*args, **kwargs):
        report = real(*args, **kwargs)
        written.append(shards_of_step_3(root))  # when the memory went into the target
        return report

    monkeypatch.setattr(hot_resume, "load_offered", load_offered)
    assert engine.load_latest(target) == 3
    assert engine.last_load_report.source == "memory", engine.last_load_report.source_reason
    assert written == [[]]  # loaded before any was written
    assert_same(target, state_at(3))
    with engine:
        assert engine.latest_step() == 3
    assert verify(root).ok and steps(root) == [1, 3]
    (third,) = [c.path for c in verify(root).checkpoints if c.step == 3]
    manifest = json.loads((third / "asyncckpt_manifest.json").read_text())
    assert set(manifest["offered"]) == {"w", "b"}  # the checksums the new engine checked


def test_memory_that_changed_after_it_was_offered_is_neither_loaded_nor_committed(tmp_path):
    # A bit flipped in the arena after the worker checksummed it for the offer: the new
    # engine's check catches it and waits for the commit, which the worker refuses (its
    # memory, and so the files written from it, no longer hold the bytes offered); the load
    # then reads step 1 from the disk, never a step 3 that differs from what was staged.
    # (the write waits too, so that the new engine asks before the worker's own check
    # withdraws the offer: without it, which comes first was a race)
    root, engine, target = slow_commit(
        tmp_path, before_hot_serve="corrupt", before_shard_write=f"delay:{SLOW_COMMIT_S}"
    )
    assert engine.load_latest(target) == 1
    report = engine.last_load_report
    assert report.source == "disk"
    assert "taken before it was written" in report.source_reason
    assert "did not match the checksums offered" in report.source_reason
    assert_same(target, state_at(1))
    with engine:  # nothing pending: the step came from the disk
        pass
    assert verify(root).ok and steps(root) == [1]
    assert "the staged memory changed after it was offered" in (tmp_path / "err").read_text()


def test_hot_resume_after_a_disk_save(tmp_path):
    worker = run_trainer(tmp_path, "disk", hold=120)
    step, target, report = load(tmp_path / "r")
    assert (step, report.source) == (2, "memory"), report.source_reason
    assert_same(target, state_at(2))
    wait_gone(worker, 30)


def test_no_surviving_worker_reads_the_disk(tmp_path):
    worker = run_trainer(tmp_path, "memory", hold=0)
    wait_gone(worker, 60)  # hold_seconds=0: it exits once step 3 is written
    step, target, report = load(tmp_path / "r")
    assert (step, report.source, report.source_reason) == (3, "disk", NO_WORKER)
    assert_same(target, state_at(3))


def test_a_worker_holding_another_step_is_not_used(tmp_path):
    run_trainer(tmp_path, "memory", hold=120)
    root = tmp_path / "r"
    # Another engine commits step 7 first (it waits for the orphan's writes, not its offer).
    with SyncCheckpointEngine(root, keep=None) as other:
        other.save(7, state_at(7)).committed_sync()
    step, target, report = load(root)
    assert (step, report.source) == (7, "disk")
    assert "holds step 3" in report.source_reason and "newest committed is 7" in (
        report.source_reason
    )
    assert_same(target, state_at(7))


def test_memory_that_does_not_match_the_manifest_is_not_used(tmp_path):
    # A staged disk save (committed before it is offered): the worker flips a bit of the
    # largest tensor in its arena before it offers the step.
    run_trainer(tmp_path, "disk", hold=120, env={faults.ENV_VAR: "before_hot_serve=corrupt"})
    step, target, report = load(tmp_path / "r")
    assert (step, report.source) == (2, "disk")
    assert "did not match the manifest" in report.source_reason
    assert_same(target, state_at(2))  # the disk's bytes, bit for bit
    # The checkpoint on disk is sound: not set aside as damaged.
    result = verify(tmp_path / "r")
    assert result.ok and [c.step for c in result.checkpoints] == [1, 2]


def test_a_target_that_does_not_fit_changes_nothing_on_the_hot_path(tmp_path):
    run_trainer(tmp_path, "memory", hold=120)
    target = blank()
    target["w"] = torch.zeros(N + 1)
    with pytest.raises(StateMismatch):
        load(tmp_path / "r", target)
    assert not target["w"].any() and not target["b"].any() and target["meta"] == {}


def test_hold_seconds_is_checked():
    assert MemoryTier(hold_seconds=30).hold_seconds == 30
    for bad in (-1, "30", True, float("nan")):
        with pytest.raises(ValueError, match="hold_seconds"):
            MemoryTier(hold_seconds=bad)


def test_corrupt_is_only_for_a_point_that_holds_bytes():
    with pytest.raises(ValueError, match="corrupt"):
        faults.inject("before_rename", "corrupt")
    faults.inject("before_hot_serve", "corrupt")
    faults.clear()


def offered(state: dict) -> tuple[object, dict]:
    """An offer made before writing, as a worker makes it (hot_serve.offer_staged), of
    ``state``, and its memory: the tensors' bytes by DCP key (a copy, writable here)."""
    from asyncckpt.core.tree import flatten_state
    from asyncckpt.memory.hot_serve import Offer, tensor_crcs
    from asyncckpt.staging.arenas import serialize_objects

    flat = flatten_state(state)
    memory = {k: memoryview(bytearray(t.numpy().tobytes())) for k, t in flat.tensors.items()}
    crcs = tensor_crcs(memory)
    offer = Offer(3, 0, (), {}, (), os.getpid())
    offer.staged = {k: (t.dtype, tuple(t.shape), crcs[k]) for k, t in flat.tensors.items()}
    offer.objects, offer.paths = serialize_objects(flat.objects), flat.paths
    return offer, memory


def test_a_load_from_the_offer_alone_is_bit_for_bit():
    from asyncckpt.memory.hot_load import load_offered

    offer, memory = offered(state_at(3))
    target = blank()
    load_offered(target, offer, memory, strict=True)
    assert_same(target, state_at(3))


def test_memory_that_fails_its_checksum_while_copied_leaves_no_half_load_behind(tmp_path):
    from asyncckpt.memory.hot_load import HotSpoiled, load_offered

    offer, memory = offered(state_at(3))
    memory["w"][12345] ^= 0x10  # after the checksums were offered
    target = blank()
    with pytest.raises(HotSpoiled, match=r"did not match the checksums offered: \['w'\]"):
        load_offered(target, offer, memory, strict=True)
    assert target["meta"] == {}  # the objects go in only once every tensor matched
    # load_latest with nothing on disk to restore the whole target from: an error, never a
    # target left half-written by a load that returns.
    from asyncckpt import NoValidCheckpoint
    from asyncckpt.trainer.restore import Restorer

    restorer = Restorer(
        tmp_path, "global_step", "dcp", None, verify_on_load=True, legacy=None, rank=0,
        world_size=1, remote=None, on_loaded=lambda step: None,
    )  # fmt: skip
    restorer.hot.spoiled, restorer.hot.reason = True, "a bit flipped"  # (as load_committing)
    with pytest.raises(NoValidCheckpoint, match="the memory offered: a bit flipped"):
        restorer._load_latest(target, strict=True)


def test_after_a_withdrawn_offer_the_committed_step_is_offered_from_memory(tmp_path):
    # The staged memory of step 3 changed after it was offered and nobody took it: the
    # worker withdraws step 3 and offers committed step 1 instead. That offer used to fail
    # ("cannot offer step 1 ...: Address already in use": the withdrawn offer's socket still
    # listened), and a new engine read step 1 from the disk.
    root, engine, target = slow_commit(tmp_path, before_hot_serve="corrupt")
    err = tmp_path / "err"
    deadline = time.monotonic() + 120
    while "offer step 1" not in err.read_text() and "offering step 1" not in err.read_text():
        assert time.monotonic() < deadline, err.read_text()
        time.sleep(0.1)
    assert "cannot offer step 1" not in err.read_text()
    assert engine.load_latest(target) == 1
    assert engine.last_load_report.source == "memory", engine.last_load_report.source_reason
    assert_same(target, state_at(1))
    with engine:
        pass
    assert verify(root).ok and steps(root) == [1]


def test_an_offer_from_a_run_of_another_size_is_never_taken_from_memory(tmp_path, monkeypatch):
    """A two-rank run's rank 0 offers its part of step 3, still committing, to a one-rank
    run: that memory is one rank's part. It was loaded as the whole step (and start() then
    failed the resume as uncommitted). Now the load waits for that commit and reads the disk."""
    from types import SimpleNamespace

    from asyncckpt.memory import hot_resume as hot

    offer, _ = offered(state_at(3))
    offer.world_size = 2
    waited = []
    resume = hot.HotResume(tmp_path, 0, 1, wait_for_worker=lambda root, rank: waited.append(rank))
    resume.source = SimpleNamespace(offer=offer, step=3)

    def loaded(*a, **k):
        raise AssertionError("taken from memory")

    monkeypatch.setattr(resume, "load_committing", loaded)
    assert resume.before_commit(None, blank(), True, lambda: [SimpleNamespace(step=1)]) is None
    assert waited == [0]  # for the commit of step 3 (newer than 1), then the disk
    assert "2 rank(s)" in resume._refusal(3)


def test_on_node_local_roots_an_offer_never_outruns_the_agreed_step(tmp_path, monkeypatch):
    """On node-local roots every rank loads the step the ranks agreed on (local_load.py). An
    offer made before the write (staged, voted) skipped that agreement: a rank agreed on step
    1 took step 2 from memory. Workers there never make such an offer (worker.py), but the
    load itself relied on that; now it never asks. A committed offer of another step is
    refused as before. The agreement is a stand-in answering step 1; the root holds 1 and 2."""
    from types import SimpleNamespace

    from asyncckpt.cluster.local_recovery import LoadChoice
    from asyncckpt.formats.loadcheck import LoadReport
    from asyncckpt.memory import hot_resume as hot
    from asyncckpt.memory.hot_serve import Offer
    from asyncckpt.trainer.local_load import Agreed
    from asyncckpt.trainer.restore import Restorer

    root = tmp_path / "root"
    with SyncCheckpointEngine(root, keep=None) as engine:
        for step in (1, 2):
            engine.save(step, {"w": torch.full((4,), float(step))}).committed_sync(60)

    class AgreedOnStep1:
        def choose(self, steps):
            return Agreed(LoadChoice(1, {}, True, "step 2 is not on every node"), "disk", "")

    def load_with(offer: Offer) -> tuple[int | None, dict]:
        source = SimpleNamespace(offer=offer, step=offer.step, tensors={}, close=lambda: None)
        monkeypatch.setattr(hot, "ask", lambda root, rank, at_work=None: (source, ""))
        restorer = Restorer(
            root, "global_step", "dcp", None, verify_on_load=True, legacy=None, rank=0,
            world_size=2, remote=None, on_loaded=lambda step: None,
        )  # fmt: skip
        restorer.agreement = AgreedOnStep1()
        restorer.hot.together = True
        target = {"w": torch.zeros(4)}
        return restorer.load_latest(target), target

    # What a node-local worker offers: step 2 committed (no staged memory, no vote).
    step, target = load_with(Offer(2, 0, (), {}, (), 0, world_size=2))
    assert step == 1 and torch.equal(target["w"], torch.full((4,), 1.0))
    # A staged, voted offer of step 2 that every rank would take: still step 1, from disk.
    monkeypatch.setattr(hot, "load_offered", lambda *a, **k: LoadReport())
    monkeypatch.setattr(hot, "agree", lambda *a, **k: (True, ""))
    voted = Offer(2, 0, (), {}, (), 0, staged={}, objects={}, paths={}, vote=object(), world_size=2)
    step, target = load_with(voted)
    assert step == 1 and torch.equal(target["w"], torch.full((4,), 1.0))

"""Torn states (invariant 13) and overlapped saves (issue 27).

The staging copy is held at the ``mid_stage`` fault point by a gate the test controls, so a
write "during staging" is one, whatever the machine's speed: no timed assertions.
"""

from __future__ import annotations

import threading

import pytest
import torch
from statecmp import assert_same

from asyncckpt import (
    CheckpointEngine,
    SaveFailed,
    StateModifiedWhileStaging,
    SyncCheckpointEngine,
    faults,
)
from asyncckpt.testing import parts

pytestmark = pytest.mark.anyio
both_backends = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])


class Gate:
    """Holds the staging copy at ``mid_stage`` until ``open()`` (or runs ``during`` there)."""

    def __init__(self, monkeypatch, during=None) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        self.during = during
        real = faults.point

        def point(name: str) -> None:
            if name == "mid_stage":
                self.reached.set()
                if self.during is not None:
                    self.during()
                else:
                    assert self.opened.wait(30), "the test never opened the gate"
            real(name)

        monkeypatch.setattr(faults, "point", point)

    def open(self) -> None:
        self.opened.set()


def mutate_from_a_thread(tensor: torch.Tensor):
    """A ``during`` for Gate: another thread writes in place while staging is held."""

    def during() -> None:
        t = threading.Thread(target=lambda: tensor.add_(1.0))
        t.start()
        t.join()

    return during


def fresh_state() -> dict:
    return {"model": {"w": torch.arange(8.0), "b": torch.zeros(3)}, "step": 0}


def blank(state: dict) -> dict:
    return {"model": {k: torch.full_like(v, -1) for k, v in state["model"].items()}, "step": None}


def committed_steps(root) -> list[int]:
    return sorted(int(p.name.split("_")[-1]) for p in root.glob("global_step_*"))


# ------------------------------------------------------------------ torn states, blocking save
def test_a_write_from_another_thread_during_staging_fails_the_save_sync(tmp_path, monkeypatch):
    state = fresh_state()
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state).committed_sync()
        before = {k: v.clone() for k, v in state["model"].items()}
        Gate(monkeypatch, during=mutate_from_a_thread(state["model"]["w"]))
        handle = engine.save(2, state)
        with pytest.raises(SaveFailed, match="changed while it was staged") as info:
            handle.committed_sync()
        cause = info.value.__cause__
        assert isinstance(cause, StateModifiedWhileStaging)
        assert cause.keys == ["model.w"]
        monkeypatch.undo()
        # Observed on its handle: the next save goes ahead.
        engine.save(3, state).committed_sync()
    assert committed_steps(tmp_path) == [1, 3]  # nothing of step 2, not even a temporary
    assert not list(tmp_path.glob("*.tmp*"))
    target = blank(state)
    with SyncCheckpointEngine(tmp_path) as engine:
        assert engine.load(target, step=1) == 1
    assert_same(target["model"], before)


@both_backends
async def test_a_write_from_another_thread_during_staging_fails_the_save_async(
    tmp_path, monkeypatch, anyio_backend
):
    state = fresh_state()
    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(1, state)).committed()
        Gate(monkeypatch, during=mutate_from_a_thread(state["model"]["b"]))
        handle = await engine.save(2, state)
        with pytest.raises(SaveFailed) as info:
            await handle.committed()
        assert info.value.__cause__.keys == ["model.b"]
    assert committed_steps(tmp_path) == [1]


def test_an_unobserved_torn_save_is_raised_by_the_next_save(tmp_path, monkeypatch):
    state = fresh_state()
    with SyncCheckpointEngine(tmp_path) as engine:
        Gate(monkeypatch, during=mutate_from_a_thread(state["model"]["w"]))
        engine.save(1, state)  # handle dropped
        monkeypatch.undo()
        with pytest.raises(SaveFailed, match="an earlier save failed"):
            engine.save(2, state)
    assert committed_steps(tmp_path) == []


def test_version_counters_see_no_grad_and_detached_writes_not_data():
    # What the check can see, as the README documents it.
    w = torch.nn.Parameter(torch.zeros(3))
    seen = w.detach()
    v = seen._version
    with torch.no_grad():
        w.add_(1)
    assert seen._version > v
    v = seen._version
    w.detach().mul_(2)
    assert seen._version > v
    v = seen._version
    w.data.add_(1)  # .data has its own counter: invisible
    w.detach().numpy()[0] = 5  # so is a write through numpy
    assert seen._version == v


# ------------------------------------------------------------------ overlapped saves
@both_backends
async def test_overlapped_save_returns_before_the_copy_and_saves_the_values_of_the_call(
    tmp_path, monkeypatch, anyio_backend
):
    state = fresh_state()
    want = {k: v.clone() for k, v in state["model"].items()}
    gate = Gate(monkeypatch)
    async with CheckpointEngine(tmp_path) as engine:
        handle = await engine.save(1, state, overlap=True)
        assert gate.reached.wait(30)
        assert not handle.is_staged() and not handle.done()
        gate.open()
        await handle.staged()
        state["model"]["w"].add_(100)  # safe now
        stats = await handle.committed()
    assert stats.overlapped and stats.stage_seconds > 0
    target = blank(state)
    assert await CheckpointEngine(tmp_path).load_latest(target) == 1
    assert_same(target["model"], want)


def test_overlapped_save_sync_facade(tmp_path, monkeypatch):
    state = fresh_state()
    want = {k: v.clone() for k, v in state["model"].items()}
    gate = Gate(monkeypatch)
    with SyncCheckpointEngine(tmp_path) as engine:
        handle = engine.save(1, state, overlap=True)
        assert gate.reached.wait(30)
        assert not handle.is_staged()
        gate.open()
        handle.staged_sync()
        state["model"]["w"].zero_()
        handle.committed_sync()
        monkeypatch.undo()
        # The next save, overlapped too, waits for nothing left: one copy at a time.
        h2 = engine.save(2, state, overlap=True)
        h2.staged_sync()
        h2.committed_sync()
    target = blank(state)
    with SyncCheckpointEngine(tmp_path) as engine:
        assert engine.load(target, step=1) == 1
        assert_same(target["model"], want)
        assert engine.load(target, step=2) == 2
        assert_same(target["model"], state["model"])


def test_close_waits_for_an_overlapped_save_still_copying(tmp_path, monkeypatch):
    state = fresh_state()
    gate = Gate(monkeypatch)
    with SyncCheckpointEngine(tmp_path) as engine:
        handle = engine.save(1, state, overlap=True)
        assert gate.reached.wait(30)
        threading.Timer(0.2, gate.open).start()
    # The close drained it: staged, sent, committed.
    assert handle.done() and handle.exception() is None
    assert committed_steps(tmp_path) == [1]


@both_backends
async def test_a_state_mutated_during_overlapped_staging_fails_loudly_older_intact(
    tmp_path, monkeypatch, anyio_backend
):
    state = fresh_state()
    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(1, state, overlap=True)).committed()
        older = {k: v.clone() for k, v in state["model"].items()}
        gate = Gate(monkeypatch)
        handle = await engine.save(2, state, overlap=True)
        assert gate.reached.wait(30)
        state["model"]["w"].add_(1)  # the loop did not wait for the copy
        gate.open()
        await handle.staged()
        with pytest.raises(SaveFailed, match="changed while it was staged") as info:
            await handle.committed()
        assert info.value.__cause__.keys == ["model.w"]
    assert committed_steps(tmp_path) == [1]
    target = blank(state)
    assert await CheckpointEngine(tmp_path).load_latest(target) == 1
    assert_same(target["model"], older)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_the_optimizer_hook_makes_step_wait_for_the_copy(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer()
    gate = Gate(monkeypatch)
    # Runs before the engine's hook (registration order): the copy resumes only once
    # step() has been called, so without the engine's hook step() would write during it.
    opt.register_step_pre_hook(lambda *_: gate.open())
    with SyncCheckpointEngine(tmp_path) as engine:
        hook = engine.stage_before_step(opt)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        handle = engine.save(1, {"model": model, "optim": opt}, overlap=True)
        assert gate.reached.wait(30)
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()  # overlaps the copy
        opt.step()
        assert handle.is_staged()
        handle.committed_sync()
        hook.remove()
    assert not torch.equal(model[0].weight, want["0.weight"])  # the step did run
    model2, opt2 = _model_and_optimizer()
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.load({"model": model2, "optim": opt2}, step=1)
    assert_same(model2.state_dict(), want)


def test_stage_before_step_refuses_what_is_not_an_optimizer(tmp_path):
    engine = SyncCheckpointEngine(tmp_path)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        engine.stage_before_step(torch.nn.Linear(2, 2))


def test_overlap_must_be_a_bool(tmp_path):
    with SyncCheckpointEngine(tmp_path) as engine:
        with pytest.raises(TypeError, match="overlap must be True or False"):
            engine.save(1, fresh_state(), overlap="yes")
        # Refused before a staging slot was taken: the only slot is still free.
        assert parts(engine).jobs.free_slots() == [0]


def test_batchnorm_forward_during_overlapped_staging_fails_the_save(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).train()
    gate = Gate(monkeypatch)
    with SyncCheckpointEngine(tmp_path) as engine:
        handle = engine.save(1, {"model": model}, overlap=True)
        assert gate.reached.wait(30)
        model(torch.randn(8, 4))  # updates the running statistics in place
        gate.open()
        with pytest.raises(SaveFailed) as info:
            handle.committed_sync()
    # The kernel writes running_mean / running_var without bumping their counters; the
    # forward pass's num_batches_tracked += 1 does, and fails the save (README: torn states).
    assert info.value.__cause__.keys == ["model.1.num_batches_tracked"]
    assert committed_steps(tmp_path) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_save_on_cuda_copies_what_the_callers_stream_queued(tmp_path):
    # The copy runs on another thread, whose current stream is not the caller's: it must wait
    # for the work queued on the caller's stream before save() (staging.ready_events).
    side = torch.cuda.Stream()
    w = torch.zeros(1 << 22, device="cuda")
    with SyncCheckpointEngine(tmp_path) as engine, torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # keep the stream busy, so the fill below is late
        w.fill_(3.0)
        handle = engine.save(1, {"w": w}, overlap=True)
        handle.staged_sync()
        handle.committed_sync()
    target = {"w": torch.empty(1 << 22)}
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.load(target, step=1)
    assert torch.equal(target["w"], torch.full((1 << 22,), 3.0))


def test_overlap_benchmark_runs_quick(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "overlap.json"
    r = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "overlap.py"), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["failed_overlapped_saves"] == 0
    assert set(rep["ratios"]) >= {"overlap_stall_vs_copy", "fwd_bwd_slowdown_overlap"}


# ------------------------------------------------------------------ writes no counter sees
def _big_and_small() -> dict:
    """A large tensor (copied by the copy pool, before ``mid_stage``) and a small one (copied
    after it, with the rest of the small ones)."""
    return {"model": {"big": torch.zeros(512, 1024), "small": torch.zeros(16)}, "step": 0}


@pytest.mark.parametrize(
    "write",
    [
        lambda t: t.data.add_(1.0),  # .data: its own counter
        lambda t: t.detach().numpy().__iadd__(1.0),  # a NumPy view: no counter
        lambda t: t.data.copy_(torch.ones_like(t)),  # an RL weight sync's .data.copy_()
    ],
    ids=["data", "numpy", "data_copy"],
)
def test_an_overlapped_save_fails_on_a_write_no_counter_sees(tmp_path, monkeypatch, write):
    """The loop writes a tensor the copy already read, where no version counter moves, while
    the rest is still copied: the checkpoint would hold that tensor from before the write and
    the others from after. The counters cannot see it; the compare of the bytes after the copy
    does (bytecheck.py): the save fails naming it, nothing is committed."""
    state = _big_and_small()
    big = state["model"]["big"]
    armed: list[bool] = []
    Gate(monkeypatch, during=lambda: armed and write(big))
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state, overlap=True).committed_sync(60)
        armed.append(True)  # the second save's copy sees the write
        handle = engine.save(2, state, overlap=True)
        with pytest.raises(SaveFailed) as info:
            handle.committed_sync(60)
    torn = info.value.__cause__
    assert isinstance(torn, StateModifiedWhileStaging), info.value
    assert torn.unseen == torn.keys == ["model.big"], torn.unseen
    assert "no version counter moved (a write through .data or NumPy)" in str(torn)
    assert committed_steps(tmp_path) == [1]


def test_an_overlapped_save_commits_the_state_at_the_end_of_its_copy(tmp_path, monkeypatch):
    """A write through ``.data`` to a tensor not yet copied (the small one, copied after
    ``mid_stage``) is in the checkpoint, with the other tensors as they were: one instant, the
    end of the copy; and the compare's time is reported."""
    state = _big_and_small()
    small = state["model"]["small"]
    Gate(monkeypatch, during=lambda: small.data.fill_(7.0))
    with SyncCheckpointEngine(tmp_path) as engine:
        stats = engine.save(1, state, overlap=True).committed_sync(60)
        target = _big_and_small()
        target["model"] = {k: torch.full_like(v, -1) for k, v in target["model"].items()}
        assert engine.load_latest(target) == 1
    assert stats.copy_check_seconds > 0
    assert torch.equal(target["model"]["small"], torch.full((16,), 7.0))
    assert torch.equal(target["model"]["big"], torch.zeros(512, 1024))


def test_a_blocking_save_compares_no_bytes(tmp_path):
    """The caller's thread is inside ``save`` for a blocking save: no compare, no cost."""
    with SyncCheckpointEngine(tmp_path) as engine:
        stats = engine.save(1, _big_and_small()).committed_sync(60)
    assert stats.copy_check_seconds == 0

"""Torn states the version counter does not see (issue 32 item 2, invariant 13): a storage freed,
resized or replaced under a staged tensor (FSDP frees parameters with
``untyped_storage().resize_(0)`` between steps). The save fails with
``StateModifiedWhileStaging`` and commits nothing; before, it committed zeros or garbage, crashed
in torch's copy, or failed with a raw torch/NumPy error.

The copy is held where it starts (or at ``mid_stage``) by a gate the test controls: no timing.
Each save of step 2 stages a state that no earlier save read: a CPU tensor of 1 MiB or more is
copied through a NumPy view, and torch marks a storage viewed by NumPy not resizable.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from statecmp import assert_same
from test_overlap import Gate, blank, committed_steps

from asyncckpt import (
    CheckpointEngine,
    MemoryTier,
    SaveFailed,
    StateModifiedWhileStaging,
    SyncCheckpointEngine,
)
from asyncckpt.core import layout
from asyncckpt.staging.arenas import StagingSlot
from asyncckpt.trainer.saving import Saver

pytestmark = pytest.mark.anyio
both_backends = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])

CHANGES = {
    "freed": lambda t: t.untyped_storage().resize_(0),
    "set_": lambda t: t.set_(torch.zeros(t.numel() + 3)),  # another storage, another size
    "grown": lambda t: t.untyped_storage().resize_(2 * t.untyped_storage().nbytes()),
    "shrunk": lambda t: t.untyped_storage().resize_(t.untyped_storage().nbytes() // 2),
}
#: What a blocking save can meet from another thread and still copy safely: a storage freed or
#: shrunk under it is read through a dangling pointer or past its end (a crash, at random),
#: which no check can make safe (README: torn states).
SWAPPED = ["set_", "grown"]


def state_of() -> dict:
    # "w" is copied with the small tensors (one foreach copy), "big" through NumPy (>= 1 MiB).
    return {"model": {"w": torch.arange(8.0), "big": torch.arange(float(1 << 18))}, "step": 0}


class CopyGate:
    """Holds the staging copy before it reads any tensor until ``open()`` (or runs ``during``
    there, on the copying thread)."""

    def __init__(self, monkeypatch, during=None) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        real = StagingSlot.copy_in

        def copy_in(slot, *args, **kwargs):
            self.reached.set()
            if during is not None:
                during()
            else:
                assert self.opened.wait(30), "the test never opened the gate"
            return real(slot, *args, **kwargs)

        monkeypatch.setattr(StagingSlot, "copy_in", copy_in)

    def open(self) -> None:
        self.opened.set()


def from_a_thread(change, tensor):
    def during() -> None:
        t = threading.Thread(target=change, args=(tensor,))
        t.start()
        t.join()

    return during


def assert_torn(err: BaseException, key: str) -> None:
    assert isinstance(err, SaveFailed), repr(err)
    assert "changed while it was staged" in str(err)
    cause = err.__cause__
    assert isinstance(cause, StateModifiedWhileStaging), repr(cause)
    assert cause.keys == [key] and cause.storage == [key]
    assert "storage was freed, resized or replaced" in str(cause)


def assert_only_step_1(root, want) -> None:
    """Nothing of step 2 on disk, the tracker on step 1, which loads back bit for bit."""
    assert committed_steps(root) == [1]
    assert not list(root.glob("*.tmp*"))
    assert layout.read_tracker(root) == 1
    target = blank(want)
    with SyncCheckpointEngine(root) as engine:
        assert engine.load_latest(target) == 1
    assert_same(target["model"], want["model"])


# ------------------------------------------------------------------ overlapped saves
def overlapped_save_2_changed_while_held(
    tmp_path: Path, make_gate: Any, change: str, key: str, staged_first: bool = False
) -> SaveFailed:
    """Step 1 committed; step 2 saved with ``overlap=True`` and held at ``make_gate()`` while
    ``change`` is done to ``model.<key>`` (the loop did not wait for the copy); step 2's
    failure (``staged_first``: its ``staged`` returned before)."""
    state = state_of()
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state_of()).committed_sync()
        gate = make_gate()
        handle = engine.save(2, state, overlap=True)
        assert gate.reached.wait(30)
        CHANGES[change](state["model"][key])
        gate.open()
        if staged_first:
            handle.staged_sync()
        with pytest.raises(SaveFailed) as info:
            handle.committed_sync()
    return info.value


@pytest.mark.parametrize("key", ["w", "big"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_overlapped_save_whose_storage_changes_before_staged_fails_sync(
    tmp_path, monkeypatch, change, key
):
    gate = functools.partial(CopyGate, monkeypatch)
    failed = overlapped_save_2_changed_while_held(tmp_path, gate, change, key, staged_first=True)
    assert_torn(failed, f"model.{key}")
    assert_only_step_1(tmp_path, state_of())


@both_backends
@pytest.mark.parametrize("change", list(CHANGES))
async def test_overlapped_save_whose_storage_changes_fails_through_wait_async(
    tmp_path, monkeypatch, change, anyio_backend
):
    state = state_of()
    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(1, state_of())).committed()
        gate = CopyGate(monkeypatch)
        handle = await engine.save(2, state, overlap=True)
        assert gate.reached.wait(30)
        CHANGES[change](state["model"]["w"])
        gate.open()
        await handle.staged()
        with pytest.raises(SaveFailed) as info:
            await engine.wait()  # the handle was never looked at: wait() raises it
        assert_torn(info.value, "model.w")
    assert_only_step_1(tmp_path, state_of())


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_storage_changed_mid_copy_fails_the_overlapped_save(tmp_path, monkeypatch, change):
    # Held at mid_stage: the large tensor is being copied, the small ones not read yet.
    failed = overlapped_save_2_changed_while_held(tmp_path, lambda: Gate(monkeypatch), change, "w")
    assert_torn(failed, "model.w")
    assert_only_step_1(tmp_path, state_of())


# ------------------------------------------------------------------ blocking saves
@pytest.mark.parametrize("key", ["w", "big"])
@pytest.mark.parametrize("change", SWAPPED)
def test_a_storage_changed_by_another_thread_fails_a_blocking_save(
    tmp_path, monkeypatch, change, key
):
    state = state_of()
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state_of()).committed_sync()
        CopyGate(monkeypatch, during=from_a_thread(CHANGES[change], state["model"][key]))
        handle = engine.save(2, state)
        assert_torn(handle.exception(), f"model.{key}")
        monkeypatch.undo()
        with pytest.raises(SaveFailed, match="an earlier save failed"):
            engine.save(3, state_of())  # never observed: the next save raises it
    assert_only_step_1(tmp_path, state_of())


@both_backends
async def test_a_storage_freed_while_save_waits_for_a_slot_fails_it(
    tmp_path, monkeypatch, anyio_backend
):
    """The async facade waits for a staging slot in a thread: the loop's other tasks run
    meanwhile, and one frees a storage of the state being saved."""
    state = state_of()
    waiting, freed = threading.Event(), threading.Event()
    real = Saver.take_slot

    def take_slot(saver, pending, block=True):
        if not block:
            return False  # every slot busy: save() waits
        waiting.set()
        assert freed.wait(30)
        return real(saver, pending, block)

    async def other_task() -> None:
        await anyio.to_thread.run_sync(waiting.wait)
        CHANGES["freed"](state["model"]["w"])
        freed.set()

    async with CheckpointEngine(tmp_path) as engine:
        await (await engine.save(1, state_of())).committed()
        monkeypatch.setattr(Saver, "take_slot", take_slot)
        async with anyio.create_task_group() as tg:
            tg.start_soon(other_task)
            handle = await engine.save(2, state)
        with pytest.raises(SaveFailed) as info:
            await handle.committed()
        assert_torn(info.value, "model.w")
    assert_only_step_1(tmp_path, state_of())


# ------------------------------------------------------------------ the memory tier
@pytest.mark.parametrize("change", SWAPPED)
def test_a_storage_changed_during_a_memory_save_fails_it_and_the_held_one_stays(
    tmp_path, monkeypatch, change
):
    state = state_of()
    with SyncCheckpointEngine(
        tmp_path, keep=None, memory=MemoryTier(persist_on_close=True)
    ) as engine:
        engine.save(1, state_of(), tier="memory")
        CopyGate(monkeypatch, during=from_a_thread(CHANGES[change], state["model"]["w"]))
        handle = engine.save(2, state, tier="memory")
        assert_torn(handle.exception(), "model.w")
        monkeypatch.undo()
        from asyncckpt.testing import parts

        assert parts(engine).saver.memory.held.step == 1
        with pytest.raises(SaveFailed, match="an earlier save failed"):
            engine.save(3, state_of(), tier="memory")
    # Closing with MemoryTier(persist_on_close=True) writes the one held: step 1, whole.
    assert_only_step_1(tmp_path, state_of())


def test_the_error_names_in_place_writes_and_moved_storages_apart():
    err = StateModifiedWhileStaging(["a", "b"], storage=["b"])
    assert err.keys == ["a", "b"] and err.storage == ["b"]
    assert str(err) == (
        "1 tensor(s) modified in place while being staged: a; 1 tensor(s) whose storage was "
        "freed, resized or replaced while being staged: b"
    )
    assert str(StateModifiedWhileStaging(["a"])) == (
        "1 tensor(s) modified in place while being staged: a"
    )

"""Differential saves, the trainer's half (issue 37 items 1 and 3; invariant 15): a large tensor
whose bytes the staging slot already holds is not copied again. A wrong "unchanged" is silent
corruption, so every mutation path the torn-state tests know is made between saves, in slots
that alternate, and what was staged (the slot's own bytes) or committed (read back with a plain
``dcp.load``) is compared bit for bit with the state at the ``save`` call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from statecmp import assert_same

import asyncckpt.staging.unchanged as unchanged
from asyncckpt import MemoryTier, Staging, SyncCheckpointEngine
from asyncckpt.core import layout
from asyncckpt.staging.arenas import Marks, StagingSlot
from asyncckpt.staging.unchanged import CopySkipper, device_fingerprint, stage_checked

BIG = (256, 1024)  # 1 MiB of float32: a large tensor (staging.SMALL_TENSOR_BYTES), skippable
MiB = 1 << 20


def state_of() -> dict:
    g = torch.Generator().manual_seed(0)
    model = {k: torch.randn(BIG, generator=g) for k in ("a", "b", "c", "d")}
    model["small"] = torch.arange(16.0)
    return {"model": model, "step": 1}


def flip_one_bit(t: torch.Tensor) -> None:
    t.view(torch.int32)[5, 5] ^= 1  # the smallest change there is


def optimizer_step(t: torch.Tensor) -> None:
    p = torch.nn.Parameter(t.detach())  # shares t's storage, as a model's parameter does
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=0.5).step()


#: Every way the torn-state tests know to change a tensor's bytes (tests/storage/test_torn_storage.py,
#: tests/formats/test_differential.py), with the ones version counters miss (``.data`` writes, NumPy
#: views, weight syncs by ``.data.copy_``) and a storage swapped for one of the same size.
MUTATIONS = {
    "in_place_op": lambda t: t.mul_(2),
    "one_bit": flip_one_bit,
    "one_bit_through_data": lambda t: flip_one_bit(t.data),
    "data_write": lambda t: t.data.__setitem__((0, 0), 42.0),
    "data_copy_": lambda t: t.data.copy_(torch.full(BIG, 3.0)),
    "numpy_view": lambda t: t.numpy().__setitem__((7, 7), -1.0),
    "set_same_size": lambda t: t.set_(torch.full(BIG, 5.0)),
    "set_other_size": lambda t: t.set_(torch.full((BIG[0] * 2, BIG[1]), 5.0)),
    "resize_": lambda t: t.resize_(BIG[0] // 2, BIG[1]).fill_(0.5),
    "optimizer_step": optimizer_step,
}


def snapshot(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    return state.detach().clone() if isinstance(state, torch.Tensor) else state


def plain_load(directory: Path, want: dict) -> dict:
    target = {
        "model": {k: torch.empty_like(v) for k, v in want["model"].items()},
        "step": 0,
    }
    dcp.load(target, checkpoint_id=str(directory), no_dist=True)
    return target


def step_dir(root: Path, step: int) -> Path:
    return root / layout.dir_name("global_step", step)


# ------------------------------------------------------------------ the slots themselves


class Stager:
    """Slots staged in turn, as ``max_in_flight`` or the memory tier alternate them; every
    stage checks that the slot's views hold the tensors' bytes, bit for bit."""

    def __init__(self, tensors: dict[str, torch.Tensor], slots: int = 2) -> None:
        self.tensors = tensors
        self.slots = [StagingSlot(i) for i in range(slots)]
        self.skipper = CopySkipper(True)
        self.turn = 0

    def stage(self) -> unchanged.SkipPlan:
        slot = self.slots[self.turn % len(self.slots)]
        self.turn += 1
        slot.ensure(self.tensors, False)
        torn, plan = stage_checked(
            self.skipper, slot, self.tensors, Marks.of(self.tensors), False, False
        )
        assert torn is None
        for view, t in zip(slot.views, self.tensors.values(), strict=True):
            assert_same(view, t)
        return plan


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_a_tensor_changed_and_changed_back_is_staged_right_in_every_slot(slots):
    # x, y, x, x, y, y, ...: with slots that alternate, the slot staged now may hold either
    # value; a skip decided from anything but this slot's own bytes stages the other one.
    a = torch.zeros(BIG)
    tensors = {"a": a, "frozen": torch.ones(BIG)}
    stager = Stager(tensors, slots)
    values = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0] + [0.0] * (slots + 1)
    skipped = []
    for v in values:
        a.data.fill_(v)  # a weight sync: no version counter moves
        skipped.append(stager.stage().skipped_bytes)
    assert max(skipped) == 2 * MiB  # the skip path ran (both tensors held by that slot)
    assert skipped[-1] == 2 * MiB


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_every_mutation_path_is_copied_into_each_alternating_slot(mutation):
    g = torch.Generator().manual_seed(1)
    tensors = {k: torch.randn(BIG, generator=g) for k in ("a", "b")}
    stager = Stager(tensors, 2)
    for _ in range(4):  # both slots hold everything: every large tensor skipped
        plan = stager.stage()
    assert plan.skipped_bytes == 2 * MiB
    MUTATIONS[mutation](tensors["a"])  # then the slot that stages next must take it
    plan = stager.stage()
    assert "a" not in {list(tensors)[i] for i in plan.skip}
    stager.stage()  # and the other slot too
    stager.stage()


def test_a_source_that_races_the_copy_is_recorded_as_the_slot_holds_it(monkeypatch):
    # The record is the fingerprint of the slot's bytes after the copy, not of the source
    # before it: a .data write between the fingerprint and the copy (no counter, no torn
    # check sees it) must not leave the slot claiming bytes it does not hold.
    a = torch.zeros(BIG)
    stager = Stager({"a": a}, 1)
    stager.stage()
    real = unchanged.copy_checked
    race = {"on": True}

    def copy_racing(slot, tensors, *args, **kwargs):
        if race["on"]:
            a.data.fill_(2.0)  # y, written after the plan fingerprinted z
        return real(slot, tensors, *args, **kwargs)

    a.data.fill_(1.0)  # z
    monkeypatch.setattr(unchanged, "copy_checked", copy_racing)
    slot = stager.slots[0]
    torn, _ = stage_checked(
        stager.skipper, slot, stager.tensors, Marks.of(stager.tensors), False, False
    )
    assert torn is None
    race["on"] = False
    a.data.fill_(1.0)  # back to z: the slot holds y, so z must be copied
    stager.stage()


def test_a_torn_copy_records_nothing_for_what_it_copied(monkeypatch):
    tensors = {"a": torch.zeros(BIG), "b": torch.ones(BIG)}
    stager = Stager(tensors, 1)
    stager.stage()
    stager.stage()
    tensors["a"].data.fill_(3.0)  # copied at the next stage; b skipped
    real = unchanged.copy_checked

    def copy_then_write(slot, ts, *args, **kwargs):
        out = real(slot, ts, *args, **kwargs)
        tensors["a"].add_(1)  # in place while staged: the save is torn
        return out

    monkeypatch.setattr(unchanged, "copy_checked", copy_then_write)
    slot = stager.slots[0]
    torn, plan = stage_checked(stager.skipper, slot, tensors, Marks.of(tensors), False, False)
    assert torn is not None and plan.skip == frozenset({1})
    assert set(slot.held) == {1}  # a's view may hold two moments: no record of it


def test_strided_large_tensors_are_copied_and_counted():
    t = torch.randn(BIG[1], BIG[0]).t()  # 1 MiB, not contiguous
    stager = Stager({"t": t}, 1)
    for _ in range(3):
        plan = stager.stage()
        assert plan.skip == frozenset() and plan.fallbacks == 1


def test_differential_off_skips_nothing():
    tensors = {"a": torch.zeros(BIG)}
    slot = StagingSlot(0)
    skipper = CopySkipper(False)
    for _ in range(3):
        slot.ensure(tensors, False)
        torn, plan = stage_checked(skipper, slot, tensors, Marks.of(tensors), False, False)
        assert torn is None and plan.skip == frozenset() and plan.fingerprint_seconds == 0
    assert slot.held == {}


# ------------------------------------- a device fingerprint must cost less than the copy

GiB = 1 << 30


@pytest.mark.parametrize(
    ("fp", "copy", "pays"),
    [
        ((8 * GiB, 0.21), (8 * GiB, 0.16), False),  # an H200: measured in the GPU suite
        ((8 * GiB, 0.21), (8 * GiB, 0.40), True),  # a slower link: the fingerprint wins
        ((8 * GiB, 0.20), (8 * GiB, 0.20), True),  # a tie keeps it (skips spare the write too)
        ((1 * MiB, 0.5), (8 * GiB, 0.16), None),  # too little fingerprinted to tell
        ((8 * GiB, 0.21), (1 * MiB, 0.5), None),  # too little copied to tell
        ((8 * GiB, 0.0), (8 * GiB, 0.16), None),
    ],
)
def test_fingerprint_pays_compares_bytes_per_second(fp, copy, pays):
    assert unchanged.fingerprint_pays(*fp, *copy) is pays


def test_a_device_fingerprint_slower_than_the_copy_is_turned_off_and_said(caplog):
    """The weighing after a save's copy: slower per byte than the copy turns GPU fingerprints
    off for the engine's life (with a warning naming both rates) and the save's GPU records are
    dropped (the slot claims nothing from them); faster, or too little to tell, keeps them."""
    skipper = CopySkipper(True)
    fast = unchanged.SkipPlan(device_bytes=8 * GiB, device_seconds=0.1, cuda_record={0: b"x"})
    skipper.weigh(fast, 8 * GiB, 0.16)
    small = unchanged.SkipPlan(device_bytes=MiB, device_seconds=9.0, cuda_record={0: b"x"})
    skipper.weigh(small, 8 * GiB, 0.16)
    assert skipper.on_device and fast.cuda_record and small.cuda_record
    assert caplog.records == []
    slow = unchanged.SkipPlan(device_bytes=8 * GiB, device_seconds=0.21, cuda_record={0: b"x"})
    with caplog.at_level("WARNING", logger="asyncckpt.staging.unchanged"):
        skipper.weigh(slow, 8 * GiB, 0.16)
    assert not skipper.on_device and slow.cuda_record == {}
    (record,) = caplog.records
    assert "40.9 GB/s" in record.getMessage() and "53.7 GB/s" in record.getMessage()
    skipper.weigh(slow, 8 * GiB, 0.16)  # said once
    assert len(caplog.records) == 1


# ------------------------------------------------------------------ the device fingerprint


@pytest.mark.parametrize("nbytes", [4, 7, 64, 1001])
def test_device_fingerprint_changes_with_every_byte(nbytes):
    g = torch.Generator().manual_seed(nbytes)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    base = device_fingerprint(t)
    assert torch.equal(device_fingerprint(t.clone()), base)
    for i in range(nbytes):
        for bit in (1, 128):
            u = t.clone()
            u[i] ^= bit
            assert not torch.equal(device_fingerprint(u), base), (i, bit)


def test_device_fingerprint_sees_words_moved_and_is_the_same_in_pieces(monkeypatch):
    t = torch.arange(4096, dtype=torch.int32)
    base = device_fingerprint(t)
    swapped = t.clone()
    swapped[[3, 9]] = swapped[[9, 3]]
    assert not torch.equal(device_fingerprint(swapped), base)
    assert not torch.equal(device_fingerprint(t.flip(0).contiguous()), base)
    monkeypatch.setattr(unchanged, "_CHUNK_WORDS", 100)
    assert torch.equal(device_fingerprint(t), base)
    assert torch.equal(device_fingerprint(t.view(torch.float32)), base)  # bytes, not values


# ------------------------------------------------------------------ through the engine


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_every_mutation_loads_bit_for_bit_after_skipped_copies(tmp_path, mutation):
    state = state_of()
    want, stats = {}, {}
    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        for step in range(1, 7):
            if step == 4:
                MUTATIONS[mutation](state["model"]["a"])
            want[step] = snapshot(state)
            stats[step] = engine.save(step, state).committed_sync()
    for step in range(1, 7):
        assert_same(plain_load(step_dir(tmp_path, step), want[step]), want[step])
    assert stats[3].copy_skipped_bytes == 4 * MiB  # nothing changed: nothing copied
    resized = mutation in ("resize_", "set_other_size")  # a new layout: new slots, all copied
    assert stats[4].copy_skipped_bytes == (0 if resized else 3 * MiB), stats[4]
    large = [t.nbytes for t in state["model"].values() if t.nbytes >= MiB]
    # Nothing changed since step 4; a tensor whose counter moved is copied without a
    # fingerprint once more (step 5, the pre-filter), then skipped too.
    assert stats[6].copy_skipped_bytes == sum(large)


def test_overlapped_saves_skip_too_and_load_bit_for_bit(tmp_path):
    state = state_of()
    want, stats = {}, {}
    with SyncCheckpointEngine(tmp_path, keep=None, staging=Staging(max_in_flight=2)) as engine:
        for step in range(1, 7):
            state["model"]["a"].data.add_(1)  # a trained tensor (no counter: a .data write)
            if step == 4:
                state["model"]["b"].numpy()[0, 0] = 9.0
            want[step] = snapshot(state)
            handle = engine.save(step, state, overlap=True)
            handle.staged_sync()
            stats[step] = handle
        stats = {s: h.committed_sync() for s, h in stats.items()}
    for step in want:
        assert_same(plain_load(step_dir(tmp_path, step), want[step]), want[step])
    assert all(stats[s].overlapped for s in stats)
    assert max(stats[s].copy_skipped_bytes for s in stats) == 3 * MiB


def test_memory_saves_skip_in_their_two_slots_and_what_they_hold_is_exact(tmp_path):
    # Memory saves alternate between two slots; disk saves between them are staged into the
    # same slots (memory_tier.shares). Every disk save is read back; the newest memory save
    # is written at close (persist_on_close) and read back too.
    state = state_of()
    want, stats = {}, {}
    memory = MemoryTier(persist_on_close=True)
    with SyncCheckpointEngine(tmp_path, keep=None, memory=memory) as engine:
        for step in range(1, 12):
            if step in (5, 8):
                state["model"]["c"].data.copy_(torch.full(BIG, float(step)))
            if step == 7:
                state["model"]["c"].data.copy_(torch.full(BIG, 5.0))  # back to step 5's
            want[step] = snapshot(state)
            if step % 2:
                stats[step] = engine.save(step, state, tier="memory").stats
            else:
                stats[step] = engine.save(step, state).committed_sync()
    for step in [*range(2, 11, 2), 11]:
        assert_same(plain_load(step_dir(tmp_path, step), want[step]), want[step])
    assert max(s.copy_skipped_bytes for s in stats.values()) == 4 * MiB
    assert stats[11].copy_skipped_bytes > 0  # a memory save, fewer bytes copied


def test_differential_off_copies_everything(tmp_path):
    state = state_of()
    with SyncCheckpointEngine(tmp_path, keep=None, staging=Staging(differential=False)) as e:
        for step in range(1, 4):
            stats = e.save(step, state).committed_sync()
            assert stats.copy_skipped_bytes == 0 and stats.copy_fingerprint_seconds == 0
            assert stats.files_linked == 0
    assert_same(plain_load(step_dir(tmp_path, 3), state), state)


#: A storage swapped while an overlapped save waited (tests/storage/test_torn_storage.py). Freeing or
#: shrinking one that a save has staged before is refused by torch (the NumPy view of the copy
#: made it not resizable), so only a swap can reach a save that would fingerprint it.
STORAGE_CHANGES = {
    "set_bigger": lambda t: t.set_(torch.zeros(t.numel() + 3)),
    "set_same_size": lambda t: t.set_(torch.zeros(t.numel())),
}


@pytest.mark.parametrize("change", list(STORAGE_CHANGES))
def test_a_storage_moved_before_the_fingerprint_is_never_read_and_fails_as_torn(
    tmp_path, monkeypatch, change
):
    # The slot holds "big" (step 1), so step 2 would fingerprint its source before the copy:
    # a storage freed meanwhile must not be read there (the copy's pointer check reports it).
    import threading

    from asyncckpt.errors import SaveFailed

    state = {"model": {"big": torch.arange(float(1 << 18))}, "step": 0}
    reached, opened = threading.Event(), threading.Event()
    real = CopySkipper.plan

    def gated_plan(self, *args, **kwargs):
        reached.set()
        assert opened.wait(30)
        return real(self, *args, **kwargs)

    with SyncCheckpointEngine(tmp_path, keep=None) as engine:
        engine.save(1, state).committed_sync()
        monkeypatch.setattr(CopySkipper, "plan", gated_plan)
        handle = engine.save(2, state, overlap=True)
        assert reached.wait(30)
        STORAGE_CHANGES[change](state["model"]["big"])
        opened.set()
        with pytest.raises(SaveFailed, match="changed while it was staged"):
            handle.committed_sync()

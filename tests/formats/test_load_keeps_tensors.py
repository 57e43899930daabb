"""A load in place leaves the caller's tensors as they were but for their values: resizable.

torch marks a storage exported to NumPy (``Tensor.numpy()``) non-resizable for good. A load
that read the checkpoint's bytes into the caller's tensors through such an array (the DCP
reader's direct read and its small records, the hot resume's checked copy) left them so:
``t.resize_(2 * n)`` and ``t.untyped_storage().resize_(0)`` (how FSDP-style code frees a
storage) raised "Trying to resize storage that is not resizable" in the user's own code,
steps later. Plain ``dcp.load`` leaves them resizable; so must every load here: from disk
(DCP, megatron's torch_dist), by either engine, and from a surviving worker's memory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from test_caller_tensors import bits, make_state, tensors_of
from test_hot_resume import blank, run_trainer, state_at

from asyncckpt import CheckpointEngine, SyncCheckpointEngine
from asyncckpt.formats.records import tensor_bytes


def zeros_like_state(state: Any) -> Any:
    """The same layout (dtypes, shapes and strides), every value zero: the load's target."""
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)  # (keeps a transposed tensor's strides)
    return state


def assert_loaded_and_resizable(target: dict, expected: dict) -> None:
    """Each target tensor holds the checkpoint's values, then resizes as the user's code does."""
    got, want = tensors_of(target), tensors_of(expected)
    assert set(got) == set(want)
    for k, t in got.items():
        assert t.dtype == want[k].dtype and t.shape == want[k].shape, k
        assert torch.equal(bits(t), bits(want[k])), k
    fixed = [k for k, t in got.items() if not t.untyped_storage().resizable()]
    assert fixed == [], "the load made these storages non-resizable"
    for k, t in got.items():
        n = t.numel()
        t.resize_(2 * n)
        assert t.numel() == 2 * n, k
        t.untyped_storage().resize_(0)
        assert t.untyped_storage().nbytes() == 0, k


def sync_load(root: Path, layout: str, target: dict) -> tuple[int | None, str]:
    with SyncCheckpointEngine(root, keep=None, layout=layout) as engine:
        step = engine.load_latest(target)
        return step, engine.last_load_report.source


def async_load(root: Path, layout: str, target: dict) -> tuple[int | None, str]:
    async def go() -> tuple[int | None, str]:
        async with CheckpointEngine(root, keep=None, layout=layout) as engine:
            step = await engine.load_latest(target)
            return step, engine.last_load_report.source

    return asyncio.run(go())


@pytest.mark.parametrize("load", [sync_load, async_load], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["global_step", "megatron"], ids=["dcp", "megatron_torch_dist"])
def test_a_load_from_disk_leaves_the_targets_resizable(tmp_path, layout, load):
    # Large tensors (read straight into the target), small ones (records recognised whole,
    # then copied in), a transposed one (read into a tensor of ours, then copied).
    state = make_state()
    with SyncCheckpointEngine(tmp_path / "r", keep=None, layout=layout) as engine:
        engine.save(1, state).committed_sync(120)
    target = zeros_like_state(state)
    assert all(t.untyped_storage().resizable() for t in tensors_of(target).values())
    step, source = load(tmp_path / "r", layout, target)
    assert (step, source) == (1, "disk")
    assert_loaded_and_resizable(target, state)


@pytest.mark.parametrize("scenario, step", [("memory", 3), ("disk", 2)])
def test_a_hot_resume_leaves_the_targets_resizable(tmp_path, scenario, step):
    # The trainer dies; its worker (MemoryTier(hold_seconds=)) offers the step from memory.
    run_trainer(tmp_path, scenario, hold=120)
    target = blank()
    got, source = sync_load(tmp_path / "r", "global_step", target)
    assert (got, source) == (step, "memory")
    expected = state_at(step)
    assert target["meta"] == expected["meta"]
    assert_loaded_and_resizable(target, expected)


def test_tensor_bytes_writes_into_the_tensor_and_leaves_it_resizable():
    # What the DCP reader reads a record into: the tensor's own bytes, not a copy of them.
    t = torch.zeros(4, dtype=torch.int32)
    view = tensor_bytes(t)
    view[:] = torch.arange(4, dtype=torch.int32).view(torch.uint8).numpy().tobytes()
    assert t.tolist() == [0, 1, 2, 3]
    del view
    assert t.untyped_storage().resizable()
    t.resize_(8)
    assert t.numel() == 8
    # Bytes that are not the tensor's values in order are refused (a write would be lost).
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        tensor_bytes(torch.zeros(3, 4).t())

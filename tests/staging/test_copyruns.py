"""The small tensors' copy plan: runs of one dtype and shape stacked into their arena block,
byte for byte, and never a block resized under the arena."""

from __future__ import annotations

import pytest
import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt.staging import arenas as staging
from asyncckpt.staging.copyruns import MIN_RUN
from asyncckpt.testing import parts


def mixed_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Runs (equal shapes back to back: 16 floats are 64 bytes, one arena alignment) between
    tensors that break them: other shapes, dtypes, a non-contiguous one, a conjugate view."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i in range(MIN_RUN + 3):
        out[f"run_a{i}"] = torch.randn(16, generator=g)
    out["odd"] = torch.randn(5, generator=g)  # 20 bytes: padded, ends the run
    for i in range(MIN_RUN):
        out[f"run_b{i}"] = torch.randn(4, 8, generator=g).t()  # non-contiguous sources
    for i in range(MIN_RUN):
        out[f"run_c{i}"] = torch.randn(8, generator=g, dtype=torch.complex64).conj()
    for i in range(MIN_RUN):
        out[f"run_h{i}"] = torch.randn(32, generator=g).bfloat16()
    for i in range(MIN_RUN - 1):  # too short a run: copied one by one
        out[f"short{i}"] = torch.randn(16, generator=g)
    out["int"] = torch.randint(0, 9, (16,), generator=g)
    return out


def test_runs_are_stacked_byte_for_byte_save_after_save() -> None:
    tensors = mixed_state()
    slot = staging.StagingSlot(0)
    slot.ensure(tensors, pin=False)
    plan = slot.small_plan
    assert plan.stacked == (MIN_RUN + 3) + 3 * MIN_RUN  # a, b, c, h; short and int are not
    for step in range(2):
        for t in tensors.values():
            if t.dtype.is_floating_point:
                t.add_(step + 1)
        slot.copy_in(tensors)
        for view, (name, t) in zip(slot.views, tensors.items(), strict=True):
            assert view.dtype == t.dtype and view.shape == t.shape, name
            assert torch.equal(view, t.resolve_conj()), name
    slot.release()


def test_a_run_source_of_another_shape_fails_the_copy_and_leaves_the_arena_intact() -> None:
    # ``stack(out=)`` resizes a block its sources do not fit; a block is a view of shared
    # memory, which cannot be resized (torch crashed the process here before the check).
    tensors = {f"w{i}": torch.randn(16) for i in range(MIN_RUN)}
    slot = staging.StagingSlot(0)
    slot.ensure(tensors, pin=False)
    nbytes = slot.arenas[0].untyped_storage().nbytes()
    for t in tensors.values():  # every source of the run swapped, the way `.data =` does
        t.data = torch.randn(32)
    with pytest.raises(RuntimeError, match="changed dtype or shape"):
        slot.copy_in(tensors)
    ((_, _, block, row),) = slot.small_plan.runs
    assert block.shape == (MIN_RUN, *row) and slot.arenas[0].untyped_storage().nbytes() == nbytes
    slot.release()


def test_parameters_in_runs_save_and_load_bit_for_bit(tmp_path) -> None:
    # Parameters require grad: ``stack(out=)`` refuses them outside no_grad.
    layers = torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(MIN_RUN * 2))
    state = {"model": layers, "extra": mixed_state(1)}
    with SyncCheckpointEngine(tmp_path) as engine:
        engine.save(1, state)
        engine.wait()
        assert parts(engine).saver.slots[0].small_plan.stacked > MIN_RUN * 2
    target = {
        "model": torch.nn.ModuleList(torch.nn.LayerNorm(16) for _ in range(MIN_RUN * 2)),
        "extra": {k: torch.zeros_like(v.resolve_conj()) for k, v in state["extra"].items()},
    }
    for p in target["model"].parameters():
        torch.nn.init.zeros_(p)
    with SyncCheckpointEngine(tmp_path) as engine:
        assert engine.load(target, step=1) == 1
    for a, b in zip(
        layers.state_dict().values(), target["model"].state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)
    for k, v in state["extra"].items():
        assert torch.equal(v.resolve_conj(), target["extra"][k]), k

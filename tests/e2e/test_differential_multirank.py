"""Differential saves on two ranks (issue 37): each rank links the files of its own shards that
did not change, and a change on one rank's shard is written by that rank while the other
links. After the older steps are pruned the newest loads bit for bit with a plain ``dcp.load``
(no asyncckpt), and ``verify`` is ok."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_multirank import run_ranks

from asyncckpt import verify
from asyncckpt.core import layout as L

pytestmark = pytest.mark.integration  # several ranks: `-m integration`

WORLD = 2
REF_ROWS = 1024  # x 512 float32 = 2 MiB: each rank's shard (1 MiB) is a file of its own


def full_ref() -> torch.Tensor:
    return torch.randn(REF_ROWS, 512, generator=torch.Generator().manual_seed(7))


def policy(step: int) -> torch.Tensor:
    return torch.full((64, 64), float(step))


def save_three_steps(rank: int, world: int, root: str) -> list[dict]:
    """Steps 1, 2 (only the replicated policy changed), 3 (also rank 1's reference shard,
    through ``.data``: a write version counters miss). Each step's save statistics."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from asyncckpt import Distributed, KeepLast, SyncCheckpointEngine

    mesh = init_device_mesh("cpu", (world,))
    local = full_ref().chunk(world)[rank].clone()
    ref = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    state = {"ref": {"w": ref}, "policy": {"w": policy(1)}}
    out = []
    with SyncCheckpointEngine(
        root, keep=KeepLast(1), distributed=Distributed(timeout=60)
    ) as engine:
        for step in (1, 2, 3):
            state["policy"]["w"].copy_(policy(step))
            if step == 3 and rank == 1:
                local.data[0, 0] = -1.0
            stats = engine.save(step, state).committed_sync(timeout=120)
            out.append(
                {"linked": stats.files_linked, "skipped": stats.bytes_skipped,
                 "written": stats.bytes_written}
            )  # fmt: skip
    return out


def test_each_rank_links_its_unchanged_shards_and_writes_its_changed_one(tmp_path: Path):
    root = tmp_path / "ckpt"
    out = run_ranks(save_three_steps, WORLD, tmp_path, str(root))
    shard = full_ref().chunk(WORLD)[0].numel() * 4
    # The statistics are the step's, over both ranks: every rank reports the same.
    assert out[0] == out[1], out
    first, second, third = out[0]
    assert first["linked"] == 0 and first["written"] >= 2 * shard, first
    # step 2: each rank's reference shard is a link to its step-1 file
    assert second["linked"] >= 2 and second["skipped"] >= 2 * shard, second
    assert second["written"] < shard, second
    # step 3: rank 1 changed one element of its shard: written; rank 0's still linked
    assert third["linked"] >= 1 and shard <= third["skipped"] < 2 * shard, third
    assert third["written"] >= shard, third

    assert [c.step for c in L.scan(root, "global_step")] == [3]  # 1 and 2 pruned
    step3 = root / L.dir_name("global_step", 3)
    report = verify(step3)
    assert report.ok, report
    want = full_ref()
    want[REF_ROWS // WORLD, 0] = -1.0  # rank 1's first row
    target = {"ref": {"w": torch.zeros_like(want)}, "policy": {"w": torch.zeros(64, 64)}}
    dcp.load(target, checkpoint_id=str(step3), no_dist=True)
    assert torch.equal(target["ref"]["w"], want)
    assert torch.equal(target["policy"]["w"], policy(3))


def save_with_two_kept(rank: int, world: int, root: str) -> list[int]:
    """Steps 1-4 with KeepLast(2), only the replicated policy changing: files linked per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from asyncckpt import Distributed, KeepLast, SyncCheckpointEngine

    mesh = init_device_mesh("cpu", (world,))
    ref = DTensor.from_local(full_ref().chunk(world)[rank].clone(), mesh, [Shard(0)])
    state = {"ref": {"w": ref}, "policy": {"w": policy(1)}}
    linked = []
    with SyncCheckpointEngine(
        root, keep=KeepLast(2), distributed=Distributed(timeout=60)
    ) as engine:
        for step in (1, 2, 3, 4):
            state["policy"]["w"].copy_(policy(step))
            linked.append(engine.save(step, state).committed_sync(timeout=120).files_linked)
    return linked


def test_with_two_steps_kept_no_rank_links_a_file_both_hold(tmp_path: Path):
    """Every rank compares the identities of its own files (DCP's ``__<rank>_`` names): with
    KeepLast(2), steps 3 and 4 each link both ranks' reference shards (from the step their
    prune removes), and the two steps kept share no file, so one damaged shard leaves one whole."""
    import os

    root = tmp_path / "ckpt"
    out = run_ranks(save_with_two_kept, WORLD, tmp_path, str(root))
    assert out[0] == out[1], out
    assert out[0][1] == 0 and out[0][2] >= 2 and out[0][3] >= 2, out  # step 2: written
    assert [c.step for c in L.scan(root, "global_step")] == [3, 4]
    held = [
        {os.stat(p).st_ino for p in (root / L.dir_name("global_step", s)).glob("*.distcp")}
        for s in (3, 4)
    ]
    assert held[0] and held[1] and held[0].isdisjoint(held[1]), held
    for step in (3, 4):
        assert verify(root / L.dir_name("global_step", step)).ok

"""Multi-rank saves under torch.distributed (gloo, one machine): 2 and 4 ranks.

Every rank is a spawned process with its own engine and worker; the ranks init gloo over a
FileStore in tmp_path. What is checked: each rank writes only its own shards, the commit
happens once (rank 0) after every rank's shards are durable, the tracker follows, a failure on
one rank commits nothing anywhere, and loading works at the same and a different world size.
"""

from __future__ import annotations

import os
import queue
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from asyncckpt import Distributed
from asyncckpt.core import layout as L

pytestmark = pytest.mark.integration  # real frameworks / several ranks: `-m integration`

JOIN_TIMEOUT = 240.0
ROWS = 8  # rows of the sharded tensor; divisible by 1, 2 and 4 ranks


# ------------------------------------------------------------------------------ harness


def _entry(
    fn: Any, rank: int, world: int, store_path: str, args: tuple, results: Any, backend: str
) -> None:
    import torch.distributed as dist

    try:
        if backend == "nccl":  # one GPU per rank, chosen before the group binds one
            torch.cuda.set_device(rank % torch.cuda.device_count())
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        out = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report it to the test
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Any, world: int, tmp_path: Path, *args: Any, backend: str = "gloo"
) -> dict[int, Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks (``backend``: gloo, or nccl in
    tests/e2e/test_cuda.py); their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tmp_path / f"store-{os.urandom(4).hex()}"
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, str(store), args, results, backend))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=JOIN_TIMEOUT)
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    except queue.Empty:
        errors.append(f"ranks {sorted(set(range(world)) - set(out))} did not finish in time")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
    assert not errors, "\n".join(errors)
    return out


# ------------------------------------------------------------------------------ states


def full_weight(step: int) -> torch.Tensor:
    return torch.arange(ROWS * 3, dtype=torch.float32).reshape(ROWS, 3) + step


def make_state(rank: int, world: int, step: int, *, sharded: bool = True) -> dict:
    """A state with a DTensor sharded over the ranks, a replicated plain tensor, and objects."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    state: dict[str, Any] = {
        "model": {"bias": torch.full((5,), float(step), dtype=torch.bfloat16)},
        "step": step,
        "extra": {"name": "run", "lrs": [0.1, 0.2]},
    }
    if sharded:
        mesh = init_device_mesh("cpu", (world,))
        local = full_weight(step).chunk(world)[rank].clone()
        state["model"]["w"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return state


def zero_like_state(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    def z(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: z(v) for k, v in x.items()}
        if isinstance(x, DTensor):
            return DTensor.from_local(
                torch.zeros_like(x.to_local()), x.device_mesh, x.placements, run_check=False
            )
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        return None if not isinstance(x, list) else []

    return z(state)


def check_loaded(state: dict, rank: int, world: int, step: int) -> None:
    w = state["model"]["w"]
    assert torch.equal(w.to_local(), full_weight(step).chunk(world)[rank]), (rank, w.to_local())
    assert torch.equal(state["model"]["bias"], torch.full((5,), float(step), dtype=torch.bfloat16))
    assert state["step"] == step and state["extra"] == {"name": "run", "lrs": [0.1, 0.2]}


# ------------------------------------------------------------------------------ rank bodies


def save_steps(rank: int, world: int, root: str, steps: list[int], fail_rank: int | None,
               fault: str | None, point: str = "mid_shard_write") -> dict:  # fmt: skip
    """Save ``steps``; on ``fail_rank``, arm ``fault`` at ``point`` for the last one; then one
    more save. Returns the outcome per step, and the tracker right after the failure."""
    from asyncckpt import KeepLast, SyncCheckpointEngine, faults
    from asyncckpt.testing import parts

    outcomes = {}
    with SyncCheckpointEngine(
        root, keep=KeepLast(2), distributed=Distributed(timeout=60)
    ) as engine:
        assert engine.world_size == world and engine.rank == rank
        for i, step in enumerate(steps):
            if fault and rank == fail_rank and i == len(steps) - 1:
                faults.inject(point, fault)
            handle = engine.save(step, make_state(rank, world, step))
            try:
                handle.committed_sync(timeout=120)
                outcomes[step] = "committed"
            except Exception as e:  # noqa: BLE001
                cause = e.__cause__
                outcomes[step] = f"failed: {e} | cause: {type(cause).__name__}: {cause}"
        faults.clear()
        parts(engine).jobs.take_pending_error()  # seen above, on the handles
        # After a failure the side group is fresh again: the next save commits everywhere.
        if fault:
            outcomes["tracker_after_failure"] = L.read_tracker(root)
            nxt = steps[-1] + 1
            engine.save(nxt, make_state(rank, world, nxt)).committed_sync(timeout=120)
            outcomes[nxt] = "committed"
    return outcomes


def load_latest_on(rank: int, world: int, root: str) -> int | None:
    from asyncckpt import SyncCheckpointEngine

    # A different world size than the writers: DCP reads this rank's shard of each DTensor.
    engine = SyncCheckpointEngine(root)
    state = zero_like_state(make_state(rank, world, 0))
    step = engine.load_latest(state)
    check_loaded(state, rank, world, step)
    return step


# ------------------------------------------------------------------------------ tests


def _assert_clean_root(root: Path, steps: list[int], tracker: int) -> None:
    assert not [n for n in os.listdir(root) if L.is_leftover(n)], os.listdir(root)
    assert [c.step for c in L.scan(root, "global_step")] == steps
    assert L.read_tracker(root) == tracker


def test_two_ranks_save_commit_tracker_and_load_at_1_and_2(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = run_ranks(save_steps, 2, tmp_path, str(root), [10, 20, 30], None, None)
    assert out == {r: {10: "committed", 20: "committed", 30: "committed"} for r in range(2)}
    _assert_clean_root(root, [20, 30], 30)  # KeepLast(2), pruned by rank 0 only
    files = set(os.listdir(root / "global_step_30"))
    # Each rank wrote its own shard file; rank 0 the metadata; one manifest covers them all.
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", L.MANIFEST} <= files
    import json

    manifest = json.loads((root / "global_step_30" / L.MANIFEST).read_text())
    assert set(manifest["files"]) == files - {L.MANIFEST}
    assert manifest["world_size"] == 2
    # Same world size.
    assert run_ranks(load_latest_on, 2, tmp_path, str(root)) == {0: 30, 1: 30}
    # World size 1, in this process, without torch.distributed: full tensors back (2 -> 1).
    from asyncckpt import SyncCheckpointEngine

    state = {"model": {"w": torch.zeros(ROWS, 3), "bias": torch.zeros(5, dtype=torch.bfloat16)}}
    assert SyncCheckpointEngine(root).load_latest(state) == 30
    assert torch.equal(state["model"]["w"], full_weight(30))
    assert state["step"] == 30
    # And the upstream loader, with no asyncckpt involved.
    import torch.distributed.checkpoint as dcp

    plain = {"model": {"w": torch.zeros(ROWS, 3)}}
    dcp.load(plain, checkpoint_id=str(root / "global_step_30"), no_dist=True)
    assert torch.equal(plain["model"]["w"], full_weight(30))


def test_four_ranks_save_then_load_on_two(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = run_ranks(save_steps, 4, tmp_path, str(root), [4], None, None)
    assert out == {r: {4: "committed"} for r in range(4)}
    _assert_clean_root(root, [4], 4)
    files = set(os.listdir(root / "global_step_4"))
    assert {f"__{r}_0.distcp" for r in range(4)} <= files
    # 4 -> 2: each of two ranks reads its half of the DTensor from the four writers' shards.
    assert run_ranks(load_latest_on, 2, tmp_path, str(root)) == {0: 4, 1: 4}


@pytest.mark.parametrize(
    "fault, point, fail_rank",
    [
        ("eio", "mid_shard_write", 1),  # a shard write fails on rank 1 only
        ("kill", "mid_shard_write", 1),  # rank 1's worker dies mid-write
        ("eio", "before_rename", 0),  # everything durable, rank 0's commit itself fails
    ],
    ids=["write-eio-rank1", "worker-killed-rank1", "commit-eio-rank0"],
)
def test_a_failure_on_one_rank_commits_nowhere(
    tmp_path: Path, fault: str, point: str, fail_rank: int
) -> None:
    root = tmp_path / "ckpt"
    out = run_ranks(save_steps, 2, tmp_path, str(root), [1, 2], fail_rank, fault, point)
    for rank in range(2):
        assert out[rank][1] == "committed" and out[rank][3] == "committed"
        assert out[rank][2].startswith("failed"), out
        # The previous checkpoint stayed the latest.
        assert out[rank]["tracker_after_failure"] == 1
    if fault == "eio":
        # Every rank's handle names the cause: the failing rank's injected EIO.
        for rank in range(2):
            assert f"rank {fail_rank}" in out[rank][2], out[rank]
            assert "Input/output error" in out[rank][2], out[rank]
    else:
        assert "died" in out[1][2]  # its own worker was killed
        assert "rank 0" in out[0][2] or "coordination" in out[0][2], out[0]
    # Step 2 never committed (on no rank), step 1 stayed the latest until step 3.
    _assert_clean_root(root, [1, 3], 3)
    assert not (root / "global_step_2").exists()


def save_and_load_rank_owned_keys(rank: int, world: int, root: str) -> dict:
    """Each rank owns its own experts (keys no other rank has), as in expert parallelism."""
    from asyncckpt import StateMismatch, SyncCheckpointEngine

    def experts(fill: float) -> dict:
        return {"model": {f"expert{rank}.w": torch.full((4,), fill + rank)}, "step": int(fill)}

    with SyncCheckpointEngine(root, distributed=Distributed(timeout=60)) as engine:
        engine.save(1, experts(1.0)).committed_sync(120)
    target = experts(0.0)
    loaded = SyncCheckpointEngine(root).load_latest(target)  # strict: the default
    # What this rank asks for and the checkpoint lacks is still a mismatch.
    typo = {"model": {f"expert{rank}.w": torch.zeros(4), "expert9.w": torch.zeros(4)}}
    try:
        SyncCheckpointEngine(root).load_latest(typo)
        missing_caught = False
    except StateMismatch as e:
        missing_caught = "expert9.w" in str(e)
    return {
        "step": loaded,
        "mine": target["model"][f"expert{rank}.w"].tolist(),
        "keys": sorted(target["model"]),  # nothing of the other rank's added to it
        "missing_caught": missing_caught,
    }


def test_rank_owned_keys_load_strictly_on_every_rank(tmp_path):
    """Before: each rank's strict load failed on the other rank's keys ("unexpected in the
    checkpoint"); found running benchmarks/scale.py under torchrun."""
    out = run_ranks(save_and_load_rank_owned_keys, 2, tmp_path, str(tmp_path / "ckpts"))
    for rank in (0, 1):
        assert out[rank] == {
            "step": 1,
            "mine": [1.0 + rank] * 4,
            "keys": [f"expert{rank}.w"],
            "missing_caught": True,
        }


def save_cached_plans_and_load(rank: int, world: int, root: str) -> dict:
    """Saves that reuse DCP's plans across ranks (the same layout), one with a new layout,
    and one after rank 0's worker (DCP's coordinator) was killed and replaced."""
    import signal
    import time

    from asyncckpt import SyncCheckpointEngine
    from asyncckpt.testing import parts

    def state(step: int, rows: int = 4) -> dict:
        own = {f"r{rank}.e{i}": torch.full((rows,), step * 10.0 + i + rank) for i in range(3)}
        return {"model": own, "step": step}

    layouts = {1: 4, 2: 4, 3: 4, 4: 6, 5: 6, 6: 6}
    with SyncCheckpointEngine(root, distributed=Distributed(timeout=60)) as engine:
        for step, rows in layouts.items():
            if step == 6 and rank == 0:  # the coordinator: it holds the cached plans
                link = parts(engine).supervisor.link
                os.kill(engine.worker_pid, signal.SIGKILL)
                deadline = time.monotonic() + 60
                while parts(engine).supervisor.link is link and time.monotonic() < deadline:
                    time.sleep(0.05)
            engine.save(step, state(step, rows)).committed_sync(120)
    loaded = {}
    for step, rows in layouts.items():
        target = state(0, rows)
        assert SyncCheckpointEngine(root).load(target, step=step) == step
        expected = state(step, rows)["model"]
        same = target["model"].keys() == expected.keys() and all(
            torch.equal(target["model"][k], v) for k, v in expected.items()
        )
        loaded[step] = same or {k: v.tolist() for k, v in target["model"].items()}
    return loaded


def test_dcp_plan_caching_across_ranks_keeps_every_checkpoint_right(tmp_path):
    """DCP's plans are reused across ranks while the layout and every rank's worker stay the
    same; a new layout and a replaced worker plan afresh. Every step loads back as saved."""
    out = run_ranks(save_cached_plans_and_load, 2, tmp_path, str(tmp_path / "ckpts"))
    for rank in (0, 1):
        assert out[rank] == {step: True for step in range(1, 7)}, out[rank]


def save_rank_own_dtype_changes(rank: int, world: int, root: str) -> dict:
    """One rank's layout changes while the other's holds (the coordinator's, then the
    other's), and a layout comes back: DCP's plan cache must follow every rank's change."""
    from torch.distributed.checkpoint import FileSystemReader

    from asyncckpt import SyncCheckpointEngine

    # step -> this rank's dtype; a change on one rank only, then a layout that comes back.
    dtypes = {
        0: {
            1: torch.float32,
            2: torch.float64,
            3: torch.float64,
            4: torch.float32,
            5: torch.float32,
        },
        1: {
            1: torch.float32,
            2: torch.float32,
            3: torch.bfloat16,
            4: torch.bfloat16,
            5: torch.float32,
        },
    }

    def state(step: int, dtype: torch.dtype) -> dict:
        return {"model": {f"r{rank}.w": (torch.arange(4) + step * 10 + rank).to(dtype)}}

    with SyncCheckpointEngine(root, keep=None, distributed=Distributed(timeout=60)) as engine:
        for step, dtype in dtypes[rank].items():
            engine.save(step, state(step, dtype)).committed_sync(120)
    out = {}
    # Every rank's keys with their object paths, as DCP's default planner merges them (a
    # cached plan's too): the dot inside "r0.w" is a key's, not a level of nesting.
    paths = {f"model.r{r}.w": ("model", f"r{r}.w") for r in (0, 1)}
    for step in dtypes[rank]:
        metadata = FileSystemReader(f"{root}/global_step_{step}").read_metadata()
        md = metadata.state_dict_metadata
        recorded = {k: str(v.properties.dtype) for k, v in md.items()}
        want = {f"model.r{r}.w": str(dtypes[r][step]) for r in (0, 1)}
        target = state(0, dtypes[rank][step])
        SyncCheckpointEngine(root).load(target, step=step)
        same = torch.equal(
            target["model"][f"r{rank}.w"], state(step, dtypes[rank][step])["model"][f"r{rank}.w"]
        )
        mapped = metadata.planner_data == paths
        out[step] = recorded == want and same and mapped or (recorded, want, same, mapped)
    return out


def test_plan_caching_follows_a_layout_change_on_one_rank(tmp_path):
    out = run_ranks(save_rank_own_dtype_changes, 2, tmp_path, str(tmp_path / "ckpts"))
    for rank in (0, 1):
        assert out[rank] == {step: True for step in range(1, 6)}, out[rank]

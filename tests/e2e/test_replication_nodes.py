"""Issue 33: a whole node lost with ``memory=MemoryTier(replicas=1)``: each memory save is held
by its own worker and by the worker of the same local rank on the next node; when a node dies
(trainers and workers SIGKILLed) and then the other trainers, the surviving workers write
their own memory saves and stand in for the dead node's ranks with the replicas they hold,
and the newest step every rank (or its replica) holds is committed whole, bit for bit.

Simulated nodes: subprocess groups with torchrun's environment (``GROUP_RANK``,
``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``) on one machine and one shared root, gloo over a
FileStore. Each trainer is its own session, so a node's death is a ``killpg`` of its trainers
(their workers are in their group).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from rank_procs import nodes_env, ranks_running
from statecmp import assert_same
from test_flush_on_death_multirank import all_ranks

from asyncckpt import SyncCheckpointEngine, verify
from asyncckpt.core import layout as L

pytestmark = pytest.mark.integration  # several ranks and nodes: `-m integration`

TRAINER = """
import os, sys, time
import torch.distributed as dist
from asyncckpt import Distributed, MemoryTier, NotReplicated, SyncCheckpointEngine, faults
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store, mode = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4], sys.argv[4], sys.argv[6]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
engine = SyncCheckpointEngine(
    root, keep=None, distributed=Distributed(timeout=40), memory=MemoryTier(replicas=1)
)
engine.__enter__()  # never left: the trainer dies inside
print(engine.worker_pid, flush=True)
engine.save(1, state(rank, 1)).committed_sync(120)
engine.save(2, state(rank, 2), tier="memory").replicated_sync(120)
dist.barrier()  # training's collectives between saves
torn = mode == "torn" and engine.node_rank == 1
if torn:  # node 1 dies while its replicas of step 3 are on the wire
    faults.inject("mid_replication", "delay:600")
handle = engine.save(3, state(rank, 3), tier="memory")  # returned: held by the worker
if not torn:
    handle.replicated_sync(120)
print("ready", flush=True)
time.sleep(3600)
"""


def _err(tmp_path: Path, r: int) -> str:
    return (tmp_path / f"rank{r}.err").read_text()


def _run(tmp_path: Path, nodes: int, per_node: int, mode: str, dead_nodes: set[int]) -> None:
    """All ranks save 1 (disk), 2 and 3 (memory); then ``dead_nodes`` die whole, then the
    other trainers. Returns once every surviving worker has exited."""
    world = nodes * per_node
    here = str(Path(__file__).parents[1])

    def args(r: int) -> list[str]:
        return [str(r), str(world), str(tmp_path / "r"), str(tmp_path / "store"), here, mode]

    env = nodes_env(world, per_node)
    with ranks_running(tmp_path, TRAINER, "rank", world, args, env, sessions=True) as ranks:
        ranks.wait_for("ready", 300)
        if mode == "torn":
            time.sleep(2.0)  # node 1's replicas of step 3 are stuck mid-transfer
        workers = {r: int(ranks.out(r).split()[0]) for r in range(world)}
        ranks.lose_nodes(dead_nodes, per_node, workers, 240)  # each writes, stands in, exits


def _check_loads(root: Path, world: int, step: int) -> None:
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {
            "model": {k: torch.zeros_like(v) for k, v in all_ranks(world, 0)["model"].items()}
        }
        assert engine.load_latest(target) == step
    assert_same(target, all_ranks(world, step))  # bit for bit, every rank's part of one step


def test_node_lost_after_replicated_memory_saves(tmp_path):
    """THE case of issue 33: 2 nodes x 2 ranks; node 1 SIGKILLed whole after memory saves 2
    and 3 returned and were replicated, then node 0's trainers: step 3 is committed."""
    _run(tmp_path, 2, 2, "replicated", {1})
    root = tmp_path / "r"
    errs = "\n".join(_err(tmp_path, r) for r in range(4))
    assert L.read_tracker(root) == 3, errs
    _check_loads(root, 4, 3)
    manifest = json.loads((root / "global_step_3" / "asyncckpt_manifest.json").read_text())
    assert (manifest["tier"], manifest["persisted_because"]) == ("memory", "trainer died")
    assert manifest["world_size"] == 4
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 3], report
    assert report.leftovers == []
    assert "stands in for it" in errs


def test_node_lost_mid_replication_keeps_the_previous_step(tmp_path):
    """Node 1 dies while its replicas of step 3 are on the wire: node 0 holds no whole copy
    of node 1's step 3, so step 2 (whole everywhere) is committed, never a torn step 3."""
    _run(tmp_path, 2, 2, "torn", {1})
    root = tmp_path / "r"
    errs = "\n".join(_err(tmp_path, r) for r in range(4))
    assert L.read_tracker(root) == 2, errs
    _check_loads(root, 4, 2)
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 2], report


def test_two_adjacent_nodes_lost_fall_back_to_disk(tmp_path):
    """3 nodes x 2 ranks, replicas=1: nodes 1 and 2 die whole. Node 1's ranks have no copy
    left (their replicas lived on node 2): nothing of the memory tier is written, the disk
    step 1 stays the latest, and the survivors say why."""
    _run(tmp_path, 3, 2, "replicated", {1, 2})
    root = tmp_path / "r"
    errs = "\n".join(_err(tmp_path, r) for r in range(6))
    assert L.read_tracker(root) == 1, errs
    _check_loads(root, 6, 1)
    assert "could not agree on a memory checkpoint" in errs
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1], report


@pytest.mark.parametrize("dead", [1, 2])
def test_one_of_three_nodes_lost(tmp_path, dead):
    """3 nodes x 2 ranks, replicas=1: one node dies whole (node 2's replicas live on node 0,
    the wrap-around), then the other trainers: step 3 is committed from the survivors' own
    saves and the replicas of the dead node's ranks, bit for bit."""
    _run(tmp_path, 3, 2, "replicated", {dead})
    root = tmp_path / "r"
    errs = "\n".join(_err(tmp_path, r) for r in range(6))
    assert L.read_tracker(root) == 3, errs
    _check_loads(root, 6, 3)
    assert errs.count("stands in for it") == 2  # one stand-in per rank of the dead node
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 3], report
    assert report.leftovers == []


def test_node_zero_lost(tmp_path):
    """Node 0 dies whole, rank 0's worker with it (it served the workers' side store): the
    survivors agree over the shared root's FileStore instead, stand in for ranks 0 and 1 with
    their replicas, and commit step 3, bit for bit (invariant 16)."""
    _run(tmp_path, 2, 2, "replicated", {0})
    root = tmp_path / "r"
    errs = "\n".join(_err(tmp_path, r) for r in (2, 3))
    assert L.read_tracker(root) == 3, errs
    _check_loads(root, 4, 3)
    assert errs.count("stands in for it") == 2, errs
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 3], report
    assert report.leftovers == []  # the recovery's FileStore is removed

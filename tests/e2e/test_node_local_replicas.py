"""Issue 33 item 5: a whole node lost on node-local roots (``Distributed(storage="local")``)
with ``memory=MemoryTier(replicas=1)``. At the trainers' death the holders of the dead node's
replicas stand in for its ranks and commit that node's directory into their own root, under
``.asyncckpt-replicas/node<n>/`` (local_recovery.replica_root); a replacement node with an
empty disk fetches it at load, and every rank loads the same step, bit for bit.

Simulated nodes as in test_replication_nodes.py (subprocess groups with torchrun's
environment, gloo), each node with a root of its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rank_procs import nodes_env, ranks_running
from statecmp import assert_same
from test_flush_on_death_multirank import state

from asyncckpt import verify
from asyncckpt.cluster.local_recovery import held_replicas, replica_root
from asyncckpt.core import layout as L

pytestmark = pytest.mark.integration  # several ranks and nodes: `-m integration`

# Both scripts: a rank of a 2 x 2 world on its node's root (argv: rank, world, base, tests dir,
# replicas, the store's name).
PREAMBLE = """
import json, sys, time
import torch, torch.distributed as dist
from asyncckpt import Distributed, MemoryTier, SyncCheckpointEngine
rank, world, base, here, replicas = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5], int(sys.argv[5])
sys.path.insert(0, here)
from test_flush_on_death_multirank import state
store = dist.FileStore(f"{base}/{sys.argv[6]}", world)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
engine = SyncCheckpointEngine(
    f"{base}/node{rank // 2}", keep=None, memory=MemoryTier(replicas=replicas),
    distributed=Distributed(timeout=60, storage="local"),
)
"""

SAVER = (
    PREAMBLE
    + """
engine.__enter__()  # never left: the trainer dies inside
print(engine.worker_pid, flush=True)
engine.save(1, state(rank, 1)).committed_sync(200)
for step in (2, 3):
    handle = engine.save(step, state(rank, step), tier="memory")  # returned: held
    if replicas:
        handle.replicated_sync(200)
    dist.barrier()
print("ready", flush=True)
time.sleep(3600)
"""
)

LOADER = (
    PREAMBLE
    + """
with engine:
    target = state(rank, 0)
    target["model"] = {k: torch.zeros_like(v) for k, v in target["model"].items()}
    step = engine.load_latest(target)
    report = engine.last_load_report
    print(json.dumps({"step": step, "source": report.source, "why": report.source_reason}), flush=True)
    dist.barrier()  # training goes on together: no rank leaves (rank 0's store) early
torch.save(target, f"{base}/loaded{rank}.pt")
"""
)

WORLD, PER_NODE = 4, 2


def _ranks(tmp_path: Path, script: str, name: str, replicas: int):
    """The 4 ranks running ``script`` as 2 nodes (each rank its own session)."""
    here = str(Path(__file__).parents[1])
    return ranks_running(
        tmp_path,
        script,
        name,
        WORLD,
        lambda r: [str(r), str(WORLD), str(tmp_path), here, str(replicas), f"store-{name}"],
        nodes_env(WORLD, PER_NODE),
        sessions=True,
    )


def _text(tmp_path: Path, name: str, r: int, kind: str = "out") -> str:
    return (tmp_path / f"{name}{r}.{kind}").read_text()


def _errs(tmp_path: Path, name: str) -> str:
    return "\n".join(_text(tmp_path, name, r, "err") for r in range(WORLD))


def _save_then_lose_node_1(tmp_path: Path, replicas: int) -> None:
    """Steps 1 (disk), 2 and 3 (memory) on every rank; node 1 dies whole (trainers and
    workers, SIGKILL), then node 0's trainers; returns once node 0's workers are gone."""
    _save_then_lose_node(tmp_path, replicas, 1)


def _save_then_lose_node(tmp_path: Path, replicas: int, node: int) -> None:
    """Steps 1 (disk), 2 and 3 (memory) on every rank; ``node`` dies whole (trainers and
    workers, SIGKILL), then the other node's trainers; returns once its workers are gone."""
    with _ranks(tmp_path, SAVER, "save", replicas) as ranks:
        ranks.wait_for("ready", 400)
        workers = {r: int(ranks.out(r).split()[0]) for r in range(WORLD)}
        ranks.lose_nodes({node}, PER_NODE, workers, 300)


def test_the_holder_commits_the_dead_nodes_replica_into_its_own_root(tmp_path):
    """(b) Node 1 dies whole, then node 0's trainers: node 0's workers commit their own
    step 3 in node 0's root and, standing in for ranks 2 and 3, node 1's directory of step 3
    under node 0's ``.asyncckpt-replicas/node1`` (manifest over every file, renamed whole)."""
    _save_then_lose_node_1(tmp_path, 1)
    node0 = tmp_path / "node0"
    errs = _errs(tmp_path, "save")
    assert L.read_tracker(node0) == 3, errs
    held = replica_root(node0, 1)
    assert held_replicas(node0, "global_step") == {1: [3]}, errs
    assert L.read_tracker(held) == 3
    report = verify(held)
    assert report.ok and [c.step for c in report.checkpoints] == [3], report
    assert report.leftovers == []
    names = {p.name for p in (held / "global_step_3").iterdir()}
    assert {"__2_0.distcp", "__3_0.distcp", ".metadata"} <= names, names
    assert errs.count("stands in for it") == 2, errs


def _restart_and_load(tmp_path: Path, replicas: int) -> list[dict]:
    """Both nodes start again (node 1 with an empty disk) and every rank loads; returns what
    each rank said (step, source, why) after checking it loaded that step bit for bit."""
    with _ranks(tmp_path, LOADER, "load", replicas) as ranks:
        ranks.wait(timeout=400)
        ranks.assert_exited(lambda r: 0)
    said = [json.loads(_text(tmp_path, "load", r).splitlines()[-1]) for r in range(WORLD)]
    for r in range(WORLD):
        loaded = torch.load(tmp_path / f"loaded{r}.pt")
        assert_same(loaded, state(r, said[r]["step"]))  # bit for bit, that step
    return said


def _lose_node_1_and_its_disk(tmp_path: Path, replicas: int) -> None:
    _save_then_lose_node_1(tmp_path, replicas)
    shutil.rmtree(tmp_path / "node1")  # the replacement node: an empty disk
    (tmp_path / "node1").mkdir()


def test_a_replacement_node_fetches_its_replica_and_every_rank_loads_step_3(tmp_path):
    """(d) THE case on node-local roots: 2 nodes x 2 ranks, memory saves 2 and 3 returned and
    replicated after disk save 1; node 1 dies whole and its disk is wiped, then node 0's
    trainers die; both nodes restart: node 1 fetches its directory of step 3 from node 0's
    replica, and every rank loads step 3 bit for bit, the report saying where from."""
    _lose_node_1_and_its_disk(tmp_path, 1)
    said = _restart_and_load(tmp_path, 1)
    errs = _errs(tmp_path, "load")
    assert [s["step"] for s in said] == [3] * WORLD, errs
    assert [s["source"] for s in said] == ["disk", "disk", "replica", "replica"], said
    assert "fetched from node 0's replica" in said[2]["why"], said
    node1 = tmp_path / "node1"
    assert L.read_tracker(node1) == 3
    report = verify(node1)
    assert report.ok and [c.step for c in report.checkpoints] == [3], report


def test_without_replicas_every_rank_loads_the_disk_step_and_says_why(tmp_path):
    """(d) The same loss with replicas=0, node 1 restarting with its disk: node 0's memory
    step 3 is not committed (node 1 never came to agree on it) and nothing holds node 1's:
    every rank loads step 1 from its own disk, bit for bit, and the report says so."""
    _save_then_lose_node_1(tmp_path, 0)
    said = _restart_and_load(tmp_path, 0)
    errs = _errs(tmp_path, "load")
    assert [s["step"] for s in said] == [1] * WORLD, errs
    assert [s["source"] for s in said] == ["disk"] * WORLD, said
    assert all("every rank loads step 1 (every rank from its own disk)" in s["why"] for s in said)


def test_without_replicas_a_replacement_node_refuses_on_every_rank(tmp_path):
    """The same loss with replicas=0 and node 1's disk wiped: ranks 2 and 3 can get no step
    at all, so no rank loads one (some starting fresh while others resume would mix steps):
    every rank refuses, saying which ranks have nothing."""
    _lose_node_1_and_its_disk(tmp_path, 0)
    with _ranks(tmp_path, LOADER, "load", 0) as ranks:
        ranks.wait(timeout=400)
        codes = [p.returncode for p in ranks.procs.values()]
    errs = _errs(tmp_path, "load")
    assert all(c != 0 for c in codes), errs
    assert errs.count("rank(s) [2, 3] have no step on their node's disk and no replica") == 4


def test_node_0_lost_on_node_local_roots_every_rank_loads_step_3(tmp_path):
    """Node 0's loss (it runs rank 0, whose worker serves the side store): after disk save 1
    and memory saves 2 and 3 returned and replicated, node 0 dies whole and its disk is
    wiped, then node 1's trainers die. Node 1's workers agree over the second store its
    local rank 0 serves (recovery_store.py), commit step 3 in node 1's root and, standing in
    for ranks 0 and 1, node 0's directory under ``.asyncckpt-replicas/node0``; both nodes
    restart and every rank loads step 3 bit for bit, node 0's ranks from the replica."""
    _save_then_lose_node(tmp_path, 1, 0)
    shutil.rmtree(tmp_path / "node0")  # the replacement node: an empty disk
    (tmp_path / "node0").mkdir()
    errs = _errs(tmp_path, "save")
    node1 = tmp_path / "node1"
    assert L.read_tracker(node1) == 3, errs
    assert held_replicas(node1, "global_step") == {0: [3]}, errs
    said = _restart_and_load(tmp_path, 1)
    errs = _errs(tmp_path, "load")
    assert [s["step"] for s in said] == [3] * WORLD, errs
    assert [s["source"] for s in said] == ["replica", "replica", "disk", "disk"], said
    assert "fetched from node 1's replica" in said[0]["why"], said
    node0 = tmp_path / "node0"
    assert L.read_tracker(node0) == 3
    report = verify(node0)
    assert report.ok and [c.step for c in report.checkpoints] == [3], report

"""Node-local storage (``Distributed(storage="local")``): each node's root is its own disk.

One step across node-local roots is committed by every node's local rank 0, each over its
node's files (node_commit.py), and is committed only when every node did. On main a save
across two node-local roots failed on every rank; before that check, rank 0 "committed" on its
root with only node 0's files in it (a checkpoint nobody could load). The check stays: a root
that lacks a rank's files (roots that really are different disks with ``storage="shared"``,
or files lost) fails the save on every rank, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rank_procs import ranks_running
from statecmp import assert_same

from asyncckpt import SyncCheckpointEngine, verify
from asyncckpt.cluster.local_recovery import (
    ReplicaServer,
    commit_fetched,
    fetch_replica,
    held_replicas,
    replica_dir,
    replica_root,
    which_step_to_load,
)
from asyncckpt.core import layout as L
from asyncckpt.storage.commit import every_rank_wrote
from asyncckpt.storage.local import LocalStore

TRAINER = """
import sys
import torch, torch.distributed as dist
from asyncckpt import Distributed, SyncCheckpointEngine
rank, base = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(base + "/store", 2), rank=rank, world_size=2)
state = {"model": {f"r{rank}.w": torch.full((1000,), float(rank))}}
with SyncCheckpointEngine(
    f"{base}/node{rank}", keep=None, distributed=Distributed(timeout=60, storage="shared")
) as engine:
    try:
        engine.save(1, state).committed_sync(120)
        print("committed", flush=True)
    except Exception as e:
        print("failed:", e, flush=True)
"""

#: Rank ``argv[1]`` of 2 nodes x 2 ranks, its node's root ``<base>/node<n>``: saves 1, 2, 3
#: (keep the last 2: each node's local rank 0 prunes its root), then a new engine loads.
LOCAL_TRAINER = """
import sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from test_flush_on_death_multirank import state
from asyncckpt import Distributed, KeepLast, SyncCheckpointEngine
rank, base = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(base + "/store", 4), rank=rank, world_size=4)
root = f"{base}/node{rank // 2}"
opts = dict(distributed=Distributed(timeout=120, storage="local"))
with SyncCheckpointEngine(root, keep=KeepLast(2), **opts) as engine:
    for step in (1, 2, 3):
        engine.save(step, state(rank, step)).committed_sync(200)
with SyncCheckpointEngine(root, keep=None, **opts) as engine:
    target = state(rank, 0)
    target["model"] = {k: torch.zeros_like(v) for k, v in target["model"].items()}
    print("loaded", engine.load_latest(target), flush=True)
torch.save(target, f"{base}/loaded{rank}.pt")
"""


def test_every_rank_wrote_names_the_missing_files(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "__1_0.distcp").write_bytes(b"x")
    # Rank 0's own names, and one renamed since (a format's temporary): no error.
    every_rank_wrote(tmp_path, [{".metadata.tmp": (1, 1)}, {"__1_0.distcp": (1, 1), "x.tmp": 0}])
    with pytest.raises(FileNotFoundError, match=r"rank 2: __2_0\.distcp.*node-local"):
        every_rank_wrote(tmp_path, [{}, {"__1_0.distcp": (1, 1)}, {"__2_0.distcp": (2, 1)}])


@pytest.mark.integration
def test_a_save_across_roots_on_other_disks_fails_instead_of_committing_a_part(tmp_path):
    """Each rank's root another disk, but said to be one root (storage="shared"): rank 0
    refuses to commit a step whose other files it lacks, on every rank."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    procs = []
    for r in (0, 1):  # two "nodes" of one rank each, each with its own root
        env = dict(os.environ, GROUP_RANK=str(r), LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(r), str(tmp_path)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outs = [p.communicate(timeout=240) for p in procs]
    said = [o for o, _ in outs]
    assert all("failed:" in s and "node-local" in s for s in said), outs
    assert L.read_tracker(tmp_path / "node0") is None  # nothing half-committed on node 0
    assert not (tmp_path / "node0" / "global_step_1").exists()


def test_only_rank_0s_own_files_go_to_every_node(tmp_path):
    from asyncckpt.cluster.node_commit import once_files

    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "__1_x.json", "sub/common.pt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(name.encode())
    results = [(None, {"__0_0.distcp": (1, 1)}, None), (None, {"__1_0.distcp": (1, 1)}, None)]
    assert once_files(tmp_path, results) == {
        ".metadata": b".metadata",
        "__0_0.distcp": b"__0_0.distcp",
        "sub/common.pt": b"sub/common.pt",
    }


def test_a_node_leader_checks_its_own_nodes_ranks(tmp_path):
    (tmp_path / "__2_0.distcp").write_bytes(b"x")
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    # Node 1's leader (rank 2): rank 3's files are lost, rank 0's (sent to it) are there.
    with pytest.raises(FileNotFoundError, match=r"rank 2's root .*rank 3: __3_0\.distcp"):
        every_rank_wrote(
            tmp_path,
            {2: {"__2_0.distcp": 1}, 3: {"__3_0.distcp": 1}, 0: {"__0_0.distcp": 1}},
            leader=2,
        )
    (tmp_path / "__3_0.distcp").write_bytes(b"x")
    every_rank_wrote(
        tmp_path, {2: {"__2_0.distcp": 1}, 3: {"__3_0.distcp": 1}, 0: {"__0_0.distcp": 1}}, 2
    )


def test_what_needs_every_ranks_files_in_one_root_is_refused_on_node_local_roots(
    tmp_path, monkeypatch
):
    from asyncckpt import CheckpointEngine, Distributed, HFExport

    for var in ("GROUP_RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    where = dict(rank=2, world_size=4, local_rank=0, node_rank=1, ranks_per_node=2)
    export = HFExport(every_steps=5, path=tmp_path / "hf")
    with pytest.raises(ValueError, match=r"export= is not supported with .*several nodes"):
        CheckpointEngine(tmp_path, distributed=Distributed(**where, storage="local"), export=export)
    # One root every node writes, or node-local roots on one node: the export is made.
    CheckpointEngine(tmp_path, distributed=Distributed(**where), export=export)
    one_node = dict(where, rank=0, node_rank=0, ranks_per_node=4, world_size=4)
    CheckpointEngine(tmp_path, distributed=Distributed(**one_node, storage="local"), export=export)


@pytest.mark.integration
def test_one_step_across_node_local_roots_commits_on_every_node_and_loads(tmp_path):
    """2 nodes x 2 ranks, one root per node: every node's local rank 0 commits its node's
    directory (its ranks' files, rank 0's: DCP's metadata and the tensor every rank holds
    alike), prunes it, and every rank loads its step 3 bit for bit from its node's root."""
    from test_flush_on_death_multirank import state

    here = str(Path(__file__).parents[1])

    def env(r: int) -> dict[str, str]:
        return {"GROUP_RANK": str(r // 2), "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(r % 2)}

    with ranks_running(
        tmp_path,
        LOCAL_TRAINER,
        "local",
        4,
        lambda r: [str(r), str(tmp_path), here],
        {r: env(r) for r in range(4)},
    ) as ranks:
        ranks.wait()
        ranks.assert_exited(lambda r: 0)
        assert all("loaded 3" in ranks.out(r) for r in range(4)), [ranks.err(r) for r in range(4)]
    for n in (0, 1):
        root = tmp_path / f"node{n}"
        assert L.read_tracker(root) == 3
        assert [c.step for c in L.scan(root, "global_step")] == [2, 3]  # step 1 pruned
        assert verify(root).ok
        names = {p.name for p in (root / "global_step_3").iterdir()}
        assert {".metadata", f"__{2 * n}_0.distcp", f"__{2 * n + 1}_0.distcp"} <= names
    for r in range(4):
        assert_same(torch.load(tmp_path / f"loaded{r}.pt", weights_only=False), state(r, 3))


#: Rank ``argv[1]`` of 2 nodes x 1 rank: saves 1 and 2; node 1's step 2 is then taken out (a
#: crash between the nodes' renames), every rank loads; then node 1's root is emptied (a
#: replacement node, no replica: none is persisted yet), every rank loads again.
AGREE_TRAINER = """
import shutil, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from test_flush_on_death_multirank import state
from asyncckpt import Distributed, SyncCheckpointEngine
rank, base = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(base + "/store", 2), rank=rank, world_size=2)
root = f"{base}/node{rank}"
opts = dict(keep=None, distributed=Distributed(timeout=120, storage="local"))
with SyncCheckpointEngine(root, **opts) as engine:
    for step in (1, 2):
        engine.save(step, state(rank, step)).committed_sync(200)
if rank == 1:
    shutil.rmtree(f"{root}/global_step_2")
dist.barrier()
target = state(rank, 0)
with SyncCheckpointEngine(root, **opts) as engine:
    print("loaded", engine.load_latest(target), flush=True)
torch.save(target, f"{base}/loaded{rank}.pt")
dist.barrier()
if rank == 1:
    shutil.rmtree(root)
dist.barrier()
with SyncCheckpointEngine(root, **opts) as engine:
    try:
        print("loaded again", engine.load_latest(state(rank, 0)), flush=True)
    except Exception as e:
        print("refused:", type(e).__name__, e, flush=True)
"""


@pytest.mark.integration
def test_every_rank_loads_the_newest_step_every_node_has_or_none(tmp_path):
    """Before the agreement, node 0 loaded step 2 and node 1 step 1 (a mix of steps); and
    with node 1's disk empty, node 0 resumed while node 1 started fresh."""
    from test_flush_on_death_multirank import state

    here = str(Path(__file__).parents[1])
    envs = {r: {"GROUP_RANK": str(r), "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"} for r in (0, 1)}
    with ranks_running(
        tmp_path, AGREE_TRAINER, "agree", 2, lambda r: [str(r), str(tmp_path), here], envs
    ) as ranks:
        ranks.wait()
        ranks.assert_exited(lambda r: 0)
        outs = [ranks.out(r) for r in (0, 1)]
    assert all("loaded 1\n" in o for o in outs), outs
    assert "step 2 is neither on the disks of rank(s) [1]" in ranks.err(0)
    for r in (0, 1):
        assert_same(torch.load(tmp_path / f"loaded{r}.pt", weights_only=False), state(r, 1))
    assert all("refused: NoValidCheckpoint" in o and "rank(s) [1] have no step" in o for o in outs)


# ------------------------------------------------------------------ which step every rank loads


def test_the_replacement_node_loads_the_newest_step_from_its_replicas():
    # Node 1 (ranks 2, 3) replaced with empty disks; node 0 wrote its step 3 and holds the
    # replicas of ranks 2 and 3 (ranks 0 and 1 hold them).
    choice = which_step_to_load({0: [1, 3], 1: [1, 3]}, {2: (0, [3]), 3: (1, [3])}, 4)
    assert (choice.step, choice.fetch, choice.fell_back) == (3, {2: 0, 3: 1}, False)
    assert "ranks [2, 3] from their replicas" in choice.reason


def test_own_disk_wins_over_a_replica():
    choice = which_step_to_load({0: [3], 1: [3]}, {1: (0, [3])}, 2)
    assert (choice.step, choice.fetch) == (3, {})


def test_no_replica_falls_back_to_the_newest_disk_step_every_rank_has_and_says_so():
    # Both nodes lost their workers (or replicas=0): node 0 wrote step 3, node 1 only has 1.
    choice = which_step_to_load({0: [1, 3], 1: [1, 3], 2: [1], 3: [1]}, {}, 4)
    assert (choice.step, choice.fetch, choice.fell_back) == (1, {}, True)
    assert "step 3 is neither on the disks of rank(s) [2, 3] nor replicated" in choice.reason
    assert "every rank loads step 1" in choice.reason


def test_never_a_mix_of_steps():
    # Rank 0 has 2 on disk, rank 1 only a replica of 3: step 1 is the newest both can get.
    choice = which_step_to_load({0: [1, 2], 1: [1]}, {1: (0, [3])}, 2)
    assert (choice.step, choice.fetch, choice.fell_back) == (1, {}, True)


def test_a_replacement_with_no_replica_anywhere_gets_no_step():
    choice = which_step_to_load({0: [1, 3], 1: [1, 3]}, {}, 4)
    assert choice.step is None and choice.fell_back
    assert "rank(s) [2, 3] have no step" in choice.reason


# ------------------------------------------------------------------ the fetch from the peer


def _replica_of_rank(tmp_path: Path, rank: int, step: int) -> tuple[Path, dict]:
    """Node 0's root holding rank ``rank``'s files of ``step`` as node 1's replica (a one-rank
    save of that rank's state, moved under the replica directory)."""
    from test_flush_on_death_multirank import state

    made = tmp_path / "made"
    with SyncCheckpointEngine(made, keep=None) as engine:
        engine.save(step, state(rank, step)).committed_sync(60)
    node0 = tmp_path / "node0"
    where = replica_dir(node0, "global_step", 1, step)
    where.parent.mkdir(parents=True)
    (made / L.dir_name("global_step", step)).rename(where)
    return node0, state(rank, step)


def _damaged_replica(tmp_path: Path, rank: int, step: int) -> tuple[Path, Path, Path]:
    """``_replica_of_rank`` with one byte in the middle of a shard flipped, and an empty root
    for node 1 to fetch it into: (node 0's root, node 1's root, the shard)."""
    node0, _ = _replica_of_rank(tmp_path, rank, step)
    shard = next(replica_dir(node0, "global_step", 1, step).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    node1 = tmp_path / "node1"
    node1.mkdir()
    return node0, node1, shard


#: The run's secret: the fetch proves it to the replica server and back (framing.py).
SECRET = "5e" * 32


def _fetch_into(root: Path, server: ReplicaServer, node: int, step: int) -> Path:
    tmp = LocalStore(root).stage(L.dir_name("global_step", step), "fetch")
    try:
        manifest = fetch_replica(("127.0.0.1", server.port), node, step, tmp, secret=SECRET)
    except BaseException:
        LocalStore(root).discard(tmp)
        raise
    return commit_fetched(root, "global_step", step, tmp, [manifest])


def test_a_replica_fetched_from_the_peer_loads_bit_for_bit(tmp_path):
    node0, want = _replica_of_rank(tmp_path, 2, 3)
    assert held_replicas(node0, "global_step") == {1: [3]}
    node1 = tmp_path / "node1"  # the replacement: an empty disk
    node1.mkdir()
    server = ReplicaServer(node0, "global_step", host="127.0.0.1", secret=SECRET)
    try:
        final = _fetch_into(node1, server, 1, 3)
    finally:
        server.close()
    assert server.served == 1
    assert L.read_tracker(node1) == 3 and final == node1 / "global_step_3"
    with SyncCheckpointEngine(node1, keep=None) as engine:
        target = {
            "model": {k: torch.zeros_like(v) for k, v in want["model"].items()},
            "step": 0,
        }
        assert engine.load_latest(target) == 3
    assert_same(target, want)
    assert verify(node1).ok


def test_a_byte_changed_on_the_peer_commits_nothing(tmp_path):
    node0, node1, shard = _damaged_replica(tmp_path, 2, 3)
    data = shard.read_bytes()
    server = ReplicaServer(node0, "global_step", host="127.0.0.1", secret=SECRET)
    try:
        with pytest.raises(OSError, match="fetched with errors"):
            _fetch_into(node1, server, 1, 3)
        with pytest.raises(FileNotFoundError, match="no replica of node 2's step 3"):
            _fetch_into(node1, server, 2, 3)
        shard.write_bytes(bytes(data[: len(data) // 2]))  # shorter than its manifest says
        with pytest.raises(OSError, match="is damaged: .*distcp"):
            _fetch_into(node1, server, 1, 3)
    finally:
        server.close()
    assert server.served == 1  # the changed byte went out: the fetching rank caught it
    assert L.read_tracker(node1) is None
    assert sorted(p.name for p in node1.iterdir() if not p.name.startswith(".asyncckpt")) == []


def test_a_stand_ins_write_cut_short_in_a_replica_is_removed_at_the_next_start(tmp_path):
    """A stand-in killed while it wrote node 1's directory into this node's
    ``.asyncckpt-replicas/node1`` leaves a temporary there; no scan lists it and no prune
    touches it, so it would stay forever. The next start cleans it, as it cleans the root's
    own leftovers, and keeps the committed replica beside it."""
    node0, _ = _replica_of_rank(tmp_path, 1, 3)
    held = replica_root(node0, 1)
    cut = held / L.tmp_name("global_step", 4, "abc123")
    cut.mkdir()
    (cut / "__2_0.distcp").write_bytes(b"half a shard")
    with SyncCheckpointEngine(node0, keep=None):
        pass
    assert not cut.exists()
    assert held_replicas(node0, "global_step") == {1: [3]}
    assert verify(held).ok

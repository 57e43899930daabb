"""local_load.StepAgreement in one process: two "nodes" of one rank each as threads over a
real TCPStore, each with a root of its own. Node 0's root holds its step 3 and node 1's
replica of step 3 (as the stand-ins leave it); node 1's root is empty (a replacement node)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import torch.distributed as dist
from test_node_local import _damaged_replica, _replica_of_rank

from asyncckpt import verify
from asyncckpt.cluster.dist import DistConfig
from asyncckpt.cluster.local_recovery import (
    held_replicas,
    replica_root,
    replica_roots,
    replicas_not_needed,
)
from asyncckpt.core import layout as L
from asyncckpt.errors import NoValidCheckpoint
from asyncckpt.trainer.local_load import StepAgreement

#: The run's secret: the node-local fetch between the "nodes" proves it (framing.py).
SECRET = "5e" * 32


def _agree(
    roots: dict[int, Path], disk: dict[int, list[int]], *, reclaimed: bool = True
) -> dict[int, object]:
    """Every rank's ``choose`` at once: its outcome, or the exception it raised; with
    ``reclaimed``, once the space of the replicas it dropped is reclaimed too."""
    server = dist.TCPStore("127.0.0.1", 0, None, True)
    out: dict[int, object] = {}
    agreements: list[StepAgreement] = []

    def one(rank: int) -> None:
        cfg = DistConfig(
            rank, 2, 0, "127.0.0.1", server.port, "t", timeout=60, ranks_per_node=1, secret=SECRET
        )
        agreements.append(StepAgreement(cfg, roots[rank], "global_step"))
        try:
            out[rank] = agreements[-1].choose(disk[rank])
        except Exception as e:  # noqa: BLE001 - checked by the test
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for a in agreements if reclaimed else ():
        if a.reclaiming is not None:
            a.reclaiming.join(60)
    return out


def test_the_replacement_node_fetches_its_replica_and_both_agree(tmp_path):
    node0, _ = _replica_of_rank(tmp_path, 1, 3)  # node 1's step 3, held on node 0
    node1 = tmp_path / "node1"
    node1.mkdir()
    out = _agree({0: node0, 1: node1}, {0: [1, 3], 1: []})
    a0, a1 = out[0], out[1]
    assert a0.choice.step == a1.choice.step == 3, out
    assert (a0.source, a1.source) == ("disk", "replica")
    assert "step 3 fetched from node 0's replica" in a1.reason
    assert "ranks [1] from their replicas on a peer" in a0.reason
    assert L.read_tracker(node1) == 3
    report = verify(node1)
    assert report.ok and [c.step for c in report.checkpoints] == [3], report


def test_a_damaged_replica_fails_the_load_on_every_rank_and_commits_nothing(tmp_path):
    node0, node1, _ = _damaged_replica(tmp_path, 1, 3)
    out = _agree({0: node0, 1: node1}, {0: [1, 3], 1: []})
    for rank in (0, 1):
        assert isinstance(out[rank], NoValidCheckpoint), out
        assert "fetching it from a replica failed: node 1 from rank 0" in str(out[rank])
    assert L.read_tracker(node1) is None
    assert not any(p.name.startswith("global_step") for p in node1.iterdir())


def test_no_replica_and_an_empty_disk_gets_no_step_on_every_rank(tmp_path):
    roots = {0: tmp_path / "a", 1: tmp_path / "b"}
    for root in roots.values():
        root.mkdir()
    out = _agree(roots, {0: [1], 1: []})
    for rank in (0, 1):
        choice = out[rank].choice
        assert choice.step is None and choice.fell_back
        assert "rank(s) [1] have no step" in choice.reason


def _more_replicas(node0: Path, of: int, steps: list[int]) -> None:
    """Copies of node ``of``'s replica of step 3 on node 0, as replicas of ``steps``."""
    held = replica_root(node0, of)
    for step in steps:
        shutil.copytree(held / L.dir_name("global_step", 3), held / L.dir_name("global_step", step))


def test_after_the_load_a_holder_drops_the_replicas_no_node_can_need(tmp_path):
    """Replicas were never deleted: every node loss left its directories on the holder's disk
    for good. Node 0 holds node 1's replicas of steps 1, 2, 3 and 5 and has steps 1 and 3 on
    its own disk; every rank loads step 3 (node 1 fetching it). Kept: 3 (the step loaded, a
    second copy until the next load) and 1 (node 0 still has it: a step both could load).
    Dropped: 2 (node 0 pruned it: never loadable again) and 5 (newer than the step the run
    goes on from: it saves a step 5 of its own)."""
    node0, _ = _replica_of_rank(tmp_path, 1, 3)
    _more_replicas(node0, 1, [1, 2, 5])
    (replica_root(node0, 1) / "latest_checkpointed_iteration.txt").write_text("5")
    assert held_replicas(node0, "global_step") == {1: [1, 2, 3, 5]}
    node1 = tmp_path / "node1"
    node1.mkdir()
    out = _agree({0: node0, 1: node1}, {0: [1, 3], 1: []})
    assert out[0].choice.step == out[1].choice.step == 3, out
    assert held_replicas(node0, "global_step") == {1: [1, 3]}
    assert L.read_tracker(replica_root(node0, 1)) is None  # it named step 5: gone with it
    assert L.read_tracker(node1) == 3
    assert not [p for p in replica_root(node0, 1).iterdir() if L.is_leftover(p.name)]


def test_a_node_with_nothing_left_to_hold_loses_its_replica_root(tmp_path):
    """Node 1 kept its disk (steps 1 and 3) and node 0 holds only its replica of step 5,
    which no rank of node 0 has: every rank loads step 3 from its own disk, and node 0's
    ``.asyncckpt-replicas/node1`` goes whole (tracker included)."""
    node0, _ = _replica_of_rank(tmp_path, 1, 3)
    _more_replicas(node0, 1, [5])
    held = replica_root(node0, 1)
    shutil.rmtree(held / L.dir_name("global_step", 3))
    (held / "latest_checkpointed_iteration.txt").write_text("5")
    node1 = tmp_path / "node1"
    node1.mkdir()
    out = _agree({0: node0, 1: node1}, {0: [1, 3], 1: [1, 3]})
    assert out[0].choice.step == 3 and out[0].source == out[1].source == "disk", out
    assert held_replicas(node0, "global_step") == {}
    assert not held.exists()
    assert replica_roots(node0) == []


def test_a_failed_fetch_drops_nothing(tmp_path):
    """The load failed (a damaged replica): every replica stays for the next try."""
    node0, node1, _ = _damaged_replica(tmp_path, 1, 3)
    _more_replicas(node0, 1, [2, 5])
    out = _agree({0: node0, 1: node1}, {0: [1, 3], 1: []})
    assert isinstance(out[0], NoValidCheckpoint), out
    assert held_replicas(node0, "global_step") == {1: [2, 3, 5]}


def test_which_replicas_no_node_can_need():
    """The rule alone, two nodes of two ranks and a third holder: holder -> node -> steps."""
    on_disk = {0: [1, 3, 4], 1: [1, 3, 4], 2: [], 3: [], 4: [3, 4], 5: [3, 4]}
    held = {0: {1: [2, 3, 4, 6]}, 4: {1: [1, 3], 0: [5]}}
    drop = replicas_not_needed(4, on_disk, held, per=2, world_size=6)
    # Holder 0 of node 1: 2 is on no other rank, 6 is past the step loaded; 3 is on every
    # other rank's disk. Holder 4: node 1's step 1 is not on ranks 4 and 5; node 0's 5 is new.
    assert drop == {0: {1: [2, 6]}, 4: {1: [1], 0: [5]}}
    assert replicas_not_needed(4, on_disk, {0: {1: [3, 4]}}, per=2, world_size=6) == {}


def test_dropped_replicas_leave_the_namespace_at_once_and_their_space_behind_the_load(
    tmp_path, monkeypatch
):
    """Deleting the dropped replicas (gigabytes of shards, file by file) ran inside the load:
    the training waited for it. They are renamed away during the load and removed behind it;
    a removal cut short (the process exits) is a leftover the next start removes."""
    from asyncckpt.cluster.local_recovery import REPLICAS_DIR, clean_replica_leftovers
    from asyncckpt.storage import localfs

    node0, _ = _replica_of_rank(tmp_path, 1, 3)
    _more_replicas(node0, 1, [2, 5])
    node1 = tmp_path / "node1"
    node1.mkdir()
    release = threading.Event()
    real_remove_tree = localfs.remove_tree
    removing: list[str] = []

    def remove_tree_held_back(path, *a, **kw):
        removing.append(Path(path).name)
        release.wait(30)  # (the load must not wait for this)
        return real_remove_tree(path, *a, **kw)

    monkeypatch.setattr(localfs, "remove_tree", remove_tree_held_back)
    out = _agree({0: node0, 1: node1}, {0: [1, 3], 1: []}, reclaimed=False)
    assert not release.is_set()
    assert out[0].choice.step == out[1].choice.step == 3, out
    assert held_replicas(node0, "global_step") == {1: [3]}  # out of the namespace already
    trash = [p.name for p in replica_root(node0, 1).iterdir() if L.is_leftover(p.name)]
    assert len(trash) == 2, trash  # steps 2 and 5, their space not yet reclaimed
    # The process exits before the removal: the next start removes the trash.
    monkeypatch.setattr(localfs, "remove_tree", real_remove_tree)
    removed = clean_replica_leftovers(node0)
    assert sorted(removed) == sorted(f"{REPLICAS_DIR}/node1/{n}" for n in trash)
    release.set()
    time.sleep(0.2)  # (the reclaimer finds them gone: no error)
    assert held_replicas(node0, "global_step") == {1: [3]}
    assert not [p for p in replica_root(node0, 1).iterdir() if L.is_leftover(p.name)]


def test_a_whole_node_dropped_leaves_no_trash_beside_the_replica_roots(tmp_path):
    """A node's whole replica root is renamed to a trash name in ``.asyncckpt-replicas``,
    which no start looked in: a removal cut short there stayed for good."""
    from asyncckpt.cluster.local_recovery import REPLICAS_DIR, clean_replica_leftovers

    node0, _ = _replica_of_rank(tmp_path, 1, 3)
    base = node0 / REPLICAS_DIR
    left = base / L.trash_name("node7", "deadbeef0000")
    (left / "global_step_1").mkdir(parents=True)
    assert clean_replica_leftovers(node0) == [f"{REPLICAS_DIR}/{left.name}"]
    assert not left.exists() and held_replicas(node0, "global_step") == {1: [3]}

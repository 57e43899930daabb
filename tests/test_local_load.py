"""local_load.StepAgreement in one process: two "nodes" of one rank each as threads over a
real TCPStore, each with a root of its own. Node 0's root holds its step 3 and node 1's
replica of step 3 (as the stand-ins leave it); node 1's root is empty (a replacement node)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch.distributed as dist
from test_node_local import _damaged_replica, _replica_of_rank

from asyncckpt import layout as L
from asyncckpt import verify
from asyncckpt.dist import DistConfig
from asyncckpt.errors import NoValidCheckpoint
from asyncckpt.local_load import StepAgreement


def _agree(roots: dict[int, Path], disk: dict[int, list[int]]) -> dict[int, object]:
    """Every rank's ``choose`` at once: its outcome, or the exception it raised."""
    server = dist.TCPStore("127.0.0.1", 0, None, True)
    out: dict[int, object] = {}

    def one(rank: int) -> None:
        cfg = DistConfig(rank, 2, 0, "127.0.0.1", server.port, "t", timeout=60, ranks_per_node=1)
        try:
            out[rank] = StepAgreement(cfg, roots[rank], "global_step").choose(disk[rank])
        except Exception as e:  # noqa: BLE001 - checked by the test
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
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

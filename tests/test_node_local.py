"""Node-local storage (``Distributed(storage="local")``): each node's root is its own disk.

On main a save across two node-local roots "committed" on rank 0's root with only node 0's
files in it (node 1's stayed in a temporary its next start deletes): a checkpoint nobody could
load. Until one checkpoint spans node-local roots (docs/how-to/node-loss.md), rank 0 refuses
to commit a step whose files it does not hold, and the save fails on every rank, saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncckpt import layout as L
from asyncckpt.commit import every_rank_wrote

TRAINER = """
import sys
import torch, torch.distributed as dist
from asyncckpt import Distributed, SyncCheckpointEngine
rank, base = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", store=dist.FileStore(base + "/store", 2), rank=rank, world_size=2)
state = {"model": {f"r{rank}.w": torch.full((1000,), float(rank))}}
with SyncCheckpointEngine(
    f"{base}/node{rank}", keep=None, distributed=Distributed(timeout=60, storage="local")
) as engine:
    try:
        engine.save(1, state).committed_sync(120)
        print("committed", flush=True)
    except Exception as e:
        print("failed:", e, flush=True)
"""


def test_every_rank_wrote_names_the_missing_files(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "__1_0.distcp").write_bytes(b"x")
    # Rank 0's own names, and one renamed since (a format's temporary): no error.
    every_rank_wrote(tmp_path, [{".metadata.tmp": (1, 1)}, {"__1_0.distcp": (1, 1), "x.tmp": 0}])
    with pytest.raises(FileNotFoundError, match=r"rank 2: __2_0\.distcp.*node-local"):
        every_rank_wrote(tmp_path, [{}, {"__1_0.distcp": (1, 1)}, {"__2_0.distcp": (2, 1)}])


@pytest.mark.integration
def test_a_save_across_node_local_roots_fails_instead_of_committing_a_part(tmp_path):
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

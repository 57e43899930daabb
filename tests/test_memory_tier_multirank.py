"""The memory tier on several ranks: every rank's worker holds its own part of the newest
memory checkpoint; when every trainer is SIGKILLed, the workers write their parts and agree
over the side store (served by rank 0's worker, not its trainer), and rank 0 commits it.

Each rank is a subprocess (gloo over a FileStore), as in test_flush_on_death_multirank.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from statecmp import assert_same
from test_flush_on_death import wait_gone
from test_flush_on_death_multirank import all_ranks

from asyncckpt import SyncCheckpointEngine, verify
from asyncckpt import layout as L

pytestmark = pytest.mark.integration  # several ranks: `-m integration`

TRAINER = """
import os, signal, sys
import torch
import torch.distributed as dist
from asyncckpt import SyncCheckpointEngine
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
engine = SyncCheckpointEngine(root, keep=None, dist_timeout=60)
engine.__enter__()  # never left: the trainer dies inside
engine.save(1, state(rank, 1)).committed_sync(120)
for step in (2, 3):
    engine.save(step, state(rank, step), tier="memory")  # returned: held by the worker
print(engine.worker_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("world", [2, 4])
def test_every_trainer_killed_after_a_memory_save(tmp_path, world):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    here = str(Path(__file__).parent)
    procs, logs = {}, {}
    for r in range(world):
        logs[r] = (tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err")
        # Files, not pipes: a worker inherits them and outlives its trainer.
        with open(logs[r][0], "w") as out, open(logs[r][1], "w") as err:
            procs[r] = subprocess.Popen(
                [sys.executable, str(script), str(r), str(world), str(tmp_path / "r")]
                + [str(tmp_path / "store"), here],
                stdout=out,
                stderr=err,
            )
    try:
        for p in procs.values():
            p.wait(timeout=240)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    workers = []
    for r, p in procs.items():
        assert p.returncode == -signal.SIGKILL, logs[r][1].read_text()
        workers.append(int(logs[r][0].read_text().split()[0]))
    for pid in workers:  # each writes its part, then exits: none lingers
        wait_gone(pid, 120)
    root = tmp_path / "r"
    assert L.read_tracker(root) == 3
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {
            "model": {k: torch.zeros_like(v) for k, v in all_ranks(world, 0)["model"].items()}
        }
        assert engine.load_latest(target) == 3
    assert_same(target, all_ranks(world, 3))
    manifest = json.loads((root / "global_step_3" / "asyncckpt_manifest.json").read_text())
    assert (manifest["tier"], manifest["persisted_because"]) == ("memory", "trainer died")
    assert manifest["world_size"] == world
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 3], report
    assert report.leftovers == []

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
import time
from pathlib import Path

import pytest
import torch
from rank_procs import ranks_running
from statecmp import assert_same
from test_flush_on_death import wait_gone
from test_flush_on_death_multirank import all_ranks

from asyncckpt import SyncCheckpointEngine, verify
from asyncckpt.core import layout as L

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


def run_ranks(tmp_path: Path, text: str, world: int) -> Path:
    """Run ``text`` as every rank's trainer (each SIGKILLs itself); wait for their workers to
    write and exit; the root."""
    here = str(Path(__file__).parents[1])
    args = [str(world), str(tmp_path / "r"), str(tmp_path / "store"), here]
    with ranks_running(tmp_path, text, "trainer", world, lambda r: [str(r), *args]) as ranks:
        ranks.wait()
    ranks.assert_exited(lambda r: -signal.SIGKILL)
    workers = [int(ranks.out(r).split()[0]) for r in range(world)]
    for pid in workers:  # each writes its part, then exits: none lingers
        wait_gone(pid, 120)
    return tmp_path / "r"


@pytest.mark.parametrize("world", [2, 4])
def test_every_trainer_killed_after_a_memory_save(tmp_path, world):
    root = run_ranks(tmp_path, TRAINER, world)
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


# Issue 35 item 1: a disk save made with the memory tier on is staged into a memory slot and
# written from it; the ranks count it as a memory step too. Killed with it in flight and a
# memory save behind it, every rank's worker commits the disk save, then the memory save.
SHARED = """
import os, signal, sys
import torch
import torch.distributed as dist
from asyncckpt import Schedule, SyncCheckpointEngine, faults
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
schedule = Schedule(every_steps=2, memory_every_steps=1)
engine = SyncCheckpointEngine(root, keep=None, dist_timeout=60, schedule=schedule)
engine.__enter__()  # never left: the trainer dies inside
engine.save(1, state(rank, 1), tier="memory")
faults.inject("mid_shard_write", "delay", seconds=0.3)
engine.save(2, state(rank, 2))  # returned: staged, being written from a memory slot
faults.clear()
engine.save(3, state(rank, 3), tier="memory")  # returned: held beside it
print(engine.worker_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_every_trainer_killed_with_a_shared_disk_save_in_flight(tmp_path):
    world = 2
    root = run_ranks(tmp_path, SHARED, world)
    assert L.read_tracker(root) == 3
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [2, 3], report
    assert report.leftovers == []
    for step in (2, 3):
        with SyncCheckpointEngine(root, keep=None) as engine:
            target = {
                "model": {k: torch.zeros_like(v) for k, v in all_ranks(world, 0)["model"].items()}
            }
            assert engine.load(target, step=step) == step
        assert_same(target, all_ranks(world, step))


# Issue 32 item 4: rank 0's trainer dies right after memory save K returned on every rank; the
# other ranks go on (no collective stops them) and return K+1 and K+2 (K+1 is then dropped:
# rank 0 never had it), then are SIGKILLed one after another, 0.3 s apart, mid-way through
# later memory saves. K is the newest step whose save() returned on every rank, and every
# worker must still hold it: the workers agree on it and commit it, never a mix.
STAGGERED = """
import os, signal, sys, time
import torch
import torch.distributed as dist
from asyncckpt import SyncCheckpointEngine
from asyncckpt.memory import tier as memory_tier
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store, last = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                  sys.argv[4], int(sys.argv[6]))
# Longer than the default: a loaded machine must not make rank 0's hand-off of step K late.
memory_tier.COMMON_WAIT_S = 3.0
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
engine = SyncCheckpointEngine(root, keep=None, dist_timeout=20)
engine.__enter__()  # never left: the trainer dies inside
engine.save(1, state(rank, 1)).committed_sync(120)
print(engine.worker_pid, flush=True)
step = 2
while True:
    if step <= last:
        dist.barrier()  # training's collectives, up to rank 0's death
    engine.save(step, state(rank, step), tier="memory")
    print(step, flush=True)  # returned
    if rank == 0 and step == last:
        os.kill(os.getpid(), signal.SIGKILL)
    step += 1
"""


def _returned(out: Path) -> list[int]:
    lines = out.read_text().split()
    return [int(s) for s in lines[1:]]


@pytest.mark.parametrize("world", [2, 4])
def test_staggered_kills_keep_the_newest_common_memory_step(tmp_path, world):
    last = 6
    script = tmp_path / "trainer.py"
    script.write_text(STAGGERED)
    here = str(Path(__file__).parents[1])
    procs, logs = {}, {}
    for r in range(world):
        logs[r] = (tmp_path / f"rank{r}.out", tmp_path / f"rank{r}.err")
        with open(logs[r][0], "w") as out, open(logs[r][1], "w") as err:
            procs[r] = subprocess.Popen(
                [sys.executable, str(script), str(r), str(world), str(tmp_path / "r")]
                + [str(tmp_path / "store"), here, str(last)],
                stdout=out,
                stderr=err,
            )
    try:
        procs[0].wait(timeout=240)
        assert procs[0].returncode == -signal.SIGKILL, logs[0][1].read_text()
        deadline = time.monotonic() + 120
        # The survivors return K+1 and K+2 (K+1 dropped for K+2: rank 0 never had it) ...
        for r in range(1, world):
            while not any(s >= last + 2 for s in _returned(logs[r][0])):
                assert procs[r].poll() is None, logs[r][1].read_text()
                assert time.monotonic() < deadline, logs[r][1].read_text()
                time.sleep(0.05)
        # ... then die one after another while saving on.
        for r in range(1, world):
            time.sleep(0.3)
            procs[r].send_signal(signal.SIGKILL)
            procs[r].wait(timeout=60)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    returned = {r: _returned(logs[r][0]) for r in range(world)}
    assert returned[0][-1] == last
    everywhere = min(max(steps) for steps in returned.values())  # returned on every rank
    for r in range(world):
        wait_gone(int(logs[r][0].read_text().split()[0]), 120)
    root = tmp_path / "r"
    step = L.read_tracker(root)
    assert step is not None and step >= everywhere == last, (step, returned)
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {
            "model": {k: torch.zeros_like(v) for k, v in all_ranks(world, 0)["model"].items()}
        }
        assert engine.load_latest(target) == step
    assert_same(target, all_ranks(world, step))  # bit for bit, every rank's part of one step
    manifest = json.loads((root / f"global_step_{step}" / "asyncckpt_manifest.json").read_text())
    assert (manifest["tier"], manifest["persisted_because"]) == ("memory", "trainer died")
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, step], report
    assert report.leftovers == []

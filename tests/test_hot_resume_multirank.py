"""A hot resume on two ranks (issue 34 item 5): every trainer is SIGKILLed after memory saves;
each worker commits its part, then offers it from memory (``MemoryTier(hold_seconds=)``). New
trainers load from memory only if every rank's memory matched the manifest; one rank's bad
byte sends every rank to the disk, bit for bit all the same.

Each rank is a subprocess (gloo over a FileStore), as in test_memory_tier_multirank.py.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from rank_procs import ranks_running
from test_flush_on_death import wait_gone

from asyncckpt import faults

pytestmark = pytest.mark.integration  # several ranks: `-m integration`

WORLD = 2

TRAINER = """
import os, signal, sys
import torch.distributed as dist
from asyncckpt import MemoryTier, SyncCheckpointEngine
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
engine = SyncCheckpointEngine(
    root, keep=None, dist_timeout=60, memory=MemoryTier(hold_seconds=120)
)
engine.__enter__()  # never left: the trainer dies inside
engine.save(1, state(rank, 1)).committed_sync(120)
for step in (2, 3):
    engine.save(step, state(rank, step), tier="memory")  # returned: held by the worker
print(engine.worker_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

LOADER = """
import json, sys, torch
import torch.distributed as dist
from asyncckpt import SyncCheckpointEngine
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
want = state(rank, 3)
target = {"model": {k: torch.zeros_like(v) for k, v in want["model"].items()}, "step": 0}
with SyncCheckpointEngine(root, keep=None, dist_timeout=60) as engine:
    step = engine.load_latest(target)
    report = engine.last_load_report
same = target["step"] == 3 and all(
    torch.equal(target["model"][k], v) for k, v in want["model"].items()
)
print(json.dumps({"step": step, "source": report.source, "reason": report.source_reason,
                  "same": same}), flush=True)
"""


def run_ranks(tmp_path: Path, script: str, name: str, envs: dict[int, dict]) -> list[str]:
    """Run ``script`` on every rank; returns each rank's stdout."""
    here = str(Path(__file__).parent)
    args = [str(WORLD), str(tmp_path / "r"), str(tmp_path / f"{name}.store"), here]
    with ranks_running(tmp_path, script, name, WORLD, lambda r: [str(r), *args], envs) as ranks:
        ranks.wait()
    ranks.assert_exited(lambda r: -signal.SIGKILL if name == "trainer" else 0)
    return [ranks.out(r) for r in range(WORLD)]


def resume(tmp_path: Path, trainer_envs: dict[int, dict]) -> tuple[list[dict], list[int]]:
    workers = [int(o.split()[0]) for o in run_ranks(tmp_path, TRAINER, "trainer", trainer_envs)]
    out = run_ranks(tmp_path, LOADER, "loader", {})
    return [json.loads(o.strip().splitlines()[-1]) for o in out], workers


def test_both_ranks_resume_from_memory(tmp_path):
    results, workers = resume(tmp_path, {})
    for r, res in enumerate(results):
        assert (res["step"], res["source"], res["same"]) == (3, "memory", True), (r, res)
    for pid in workers:  # taken: freed
        wait_gone(pid, 60)


def test_one_rank_whose_memory_does_not_match_sends_every_rank_to_disk(tmp_path):
    results, _ = resume(tmp_path, {1: {faults.ENV_VAR: "before_hot_serve=corrupt"}})
    for r, res in enumerate(results):
        assert (res["step"], res["source"], res["same"]) == (3, "disk", True), (r, res)
    assert "did not match the manifest" in results[1]["reason"]
    assert "another rank's memory did not" in results[0]["reason"]

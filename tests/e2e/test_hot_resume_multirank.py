"""A hot resume on two ranks (issue 34 item 5): every trainer is SIGKILLed after memory saves;
each worker offers its part of the step it persists from memory before writing it
(``MemoryTier(hold_seconds=)``), and the new trainers agree over the old run's side store to
take it from memory on every rank or on none (hot_agree.py): before its commit is over too,
each rank's ``load_latest`` then waiting for that commit and checking that its part committed
as loaded (else reading the disk). One rank's bad byte sends every rank to the disk, bit for
bit all the same.

Each rank is a subprocess (gloo over a FileStore), as in test_memory_tier_multirank.py.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from rank_procs import ranks_running
from test_flush_on_death import wait_gone

from asyncckpt import faults, verify

pytestmark = pytest.mark.integration  # several ranks: `-m integration`

WORLD = 2

TRAINER = """
import json, os, signal, sys
import torch.distributed as dist
from asyncckpt import MemoryTier, SyncCheckpointEngine, faults
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
engine = SyncCheckpointEngine(  # (the side group's timeout: over SLOW_COMMIT_S)
    root, keep=None, dist_timeout=180, memory=MemoryTier(hold_seconds=240)
)
engine.__enter__()  # never left: the trainer dies inside
engine.save(1, state(rank, 1)).committed_sync(120)
for point, action in json.loads(os.environ.get("HOT_LATER", "{}")).items():  # saves after 1
    faults.inject(point, action)
for step in (2, 3):
    engine.save(step, state(rank, step), tier="memory")  # returned: held by the worker
print(engine.worker_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""

LOADER = """
import json, os, sys, torch
from pathlib import Path
import torch.distributed as dist
from asyncckpt import SyncCheckpointEngine, UncommittedResume
from asyncckpt.core import layout as L
sys.path.insert(0, sys.argv[5])
from test_flush_on_death_multirank import state
rank, world, root, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
shapes = state(rank, 3)["model"]
target = {"model": {k: torch.zeros_like(v) for k, v in shapes.items()}, "step": 0}
engine = SyncCheckpointEngine(root, keep=None, dist_timeout=60)
early = os.environ.get("HOT_EARLY") == "1"  # load_latest before start(): no wait for the worker
if not early:
    engine.__enter__()
step = engine.load_latest(target)
committed = [c.step for c in L.scan(Path(root), "global_step")]  # when load_latest returned
report = engine.last_load_report
started = "ok"
if early:
    try:
        engine.__enter__()
    except UncommittedResume as e:  # (rank > 0: rank 0's, relayed by the rendezvous)
        started = f"{type(e).__name__}: {e}"
if started == "ok":
    engine.__exit__(None, None, None)
want = state(rank, step)
same = target["step"] == step and all(
    torch.equal(target["model"][k], v) for k, v in want["model"].items()
)
print(json.dumps({"step": step, "source": report.source, "reason": report.source_reason,
                  "same": same, "committed": committed, "started": started}), flush=True)
"""


def run_ranks(tmp_path: Path, script: str, name: str, envs: dict[int, dict]) -> list[str]:
    """Run ``script`` on every rank; returns each rank's stdout."""
    here = str(Path(__file__).parents[1])
    args = [str(WORLD), str(tmp_path / "r"), str(tmp_path / f"{name}.store"), here]
    with ranks_running(tmp_path, script, name, WORLD, lambda r: [str(r), *args], envs) as ranks:
        ranks.wait()
    ranks.assert_exited(lambda r: -signal.SIGKILL if name == "trainer" else 0)
    return [ranks.out(r) for r in range(WORLD)]


def resume(
    tmp_path: Path, trainer_envs: dict[int, dict], early: bool = False
) -> tuple[list[dict], list[int]]:
    workers = [int(o.split()[0]) for o in run_ranks(tmp_path, TRAINER, "trainer", trainer_envs)]
    loader_env = {"HOT_EARLY": "1"} if early else {}
    out = run_ranks(tmp_path, LOADER, "loader", {r: loader_env for r in range(WORLD)})
    return [json.loads(o.strip().splitlines()[-1]) for o in out], workers


#: The old workers' commit of the step they persist after the death waits this long.
SLOW_COMMIT_S = 60  # (loaders start slowly on a busy machine: tens of seconds)


def later(**faults_armed: str) -> str:
    return json.dumps(faults_armed)


def test_both_ranks_resume_from_memory(tmp_path):
    results, workers = resume(tmp_path, {})
    for r, res in enumerate(results):
        assert (res["step"], res["source"], res["same"]) == (3, "memory", True), (r, res)
        assert "on every rank" in res["reason"], (r, res)
    for pid in workers:  # taken: freed
        wait_gone(pid, 60)


def test_both_ranks_take_the_step_before_it_is_committed(tmp_path):
    """Loaded before start() while the old workers still commit step 3: both ranks from
    memory (before, several ranks waited for the commit, then read the step it wrote back),
    and each rank's load_latest returns once it found its part committed with the checksums it
    checked."""
    slow = {"HOT_LATER": later(before_metadata=f"delay:{SLOW_COMMIT_S}")}
    results, _ = resume(tmp_path, {0: slow, 1: slow}, early=True)
    for r, res in enumerate(results):
        assert (res["step"], res["source"], res["same"]) == (3, "memory", True), (r, res)
        assert res["committed"] == [1, 3], (r, res)  # returned once step 3 committed as loaded
        assert res["started"] == "ok", (r, res)
    root = tmp_path / "r"
    assert verify(root).ok and [c.step for c in verify(root).checkpoints] == [1, 3]
    manifest = json.loads((root / "global_step_3" / "asyncckpt_manifest.json").read_text())
    assert set(manifest["offered_ranks"]) == {"0", "1"}
    assert set(manifest["offered_ranks"]["1"]) == {"model.r1.w", "model.shared"}


def test_a_commit_that_fails_after_both_ranks_took_the_memory_reaches_every_rank(tmp_path):
    """Every rank's load_latest waits for the commit of the step it took from memory; it
    failed: each rank reads the newest committed step from disk itself (before, each rank's
    start() raised UncommittedResume for the user's code to load again)."""
    slow = {"HOT_LATER": later(before_metadata=f"delay:{SLOW_COMMIT_S}", before_rename="eio")}
    results, _ = resume(tmp_path, {0: slow, 1: slow}, early=True)
    for r, res in enumerate(results):
        assert (res["step"], res["source"], res["same"]) == (1, "disk", True), (r, res)
        assert "step 3 was loaded from the memory" in res["reason"], (r, res)
        assert "its commit failed" in res["reason"], (r, res)
        assert res["started"] == "ok", (r, res)
    assert [c.step for c in verify(tmp_path / "r").checkpoints] == [1]


def test_one_rank_whose_memory_does_not_match_sends_every_rank_to_disk(tmp_path):
    """Rank 1's worker flips a bit of its staged memory after checksumming it for the offer:
    its new engine's check fails (or its offer was withdrawn already), rank 0 hears so and
    applies nothing from memory; rank 1's worker refuses to commit step 3 (its files were
    written from the changed memory), so every rank reads step 1 from disk, bit for bit."""
    results, _ = resume(tmp_path, {1: {faults.ENV_VAR: "before_hot_serve=corrupt"}})
    for r, res in enumerate(results):
        assert (res["step"], res["source"], res["same"]) == (1, "disk", True), (r, res)
        assert "not applied" in res["reason"], (r, res)
    # Rank 0 heard rank 1's "no" (or, once the failed commit withdrew its own offer, was
    # offered step 1 only after it was written): never step 3 from memory.
    assert any(w in results[0]["reason"] for w in ("another rank's", "only once written"))


def test_a_rank_whose_worker_died_too_does_not_hold_the_others_for_the_timeout(tmp_path):
    """Rank 1's worker dies with its trainer, before it comes to the step it persists (a
    SIGKILL at ``before_job_group``). Rank 0's worker waited for it the side group's whole
    timeout (180 s here) before failing the step, and rank 0's new engine waited for that
    worker as long. Now rank 1's new engine says its worker is gone before it joins the new
    run (peer_gone.py): rank 0's worker fails the step at once, and both ranks read step 1
    from disk, bit for bit, long before the timeout."""
    run_ranks(tmp_path, TRAINER, "trainer", {1: {"HOT_LATER": later(before_job_group="kill")}})
    t0 = time.monotonic()
    out = run_ranks(tmp_path, LOADER, "loader", {})
    took = time.monotonic() - t0
    results = [json.loads(o.strip().splitlines()[-1]) for o in out]
    for r, res in enumerate(results):
        assert (res["step"], res["source"], res["same"]) == (1, "disk", True), (r, res)
    assert took < 120, f"the loaders took {took:.0f}s: the old run's timeout is 180s"
    assert [c.step for c in verify(tmp_path / "r").checkpoints] == [1]

"""Several ranks: a save whose ``save()`` returned on every rank is committed even if trainers
are SIGKILLed the next instant -- all of them, one of them while the others go on, or rank 0's,
whose worker serves the side store the workers agree over (asyncckpt/cluster/dist.py).

Each rank is a subprocess (gloo over a FileStore), since a rank killed by SIGKILL cannot report
through ``run_ranks``. The ranks that die first stage step 2 and die before the others stage it
(the test lets those go once the first are dead): the ranks do not save at the same instant in a
real run either, and it makes "rank 0's trainer is already gone when the others' workers meet"
certain rather than a race.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from rank_procs import ranks_running
from statecmp import assert_same
from test_flush_on_death import wait_gone

from asyncckpt import SyncCheckpointEngine, verify
from asyncckpt.core import layout as L

pytestmark = pytest.mark.integration  # several ranks: `-m integration`

DIST_TIMEOUT = 30  # how long a survivor's save waits for a rank that is gone

TRAINER = """
import json, os, signal, sys, time
import torch
import torch.distributed as dist
from asyncckpt import Distributed, SyncCheckpointEngine, faults
sys.path.insert(0, sys.argv[8])
from test_flush_on_death_multirank import state
rank, world, root, store, go = int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:6]
dies, waits = sys.argv[6] == "1", sys.argv[7] == "1"
dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
engine = SyncCheckpointEngine(root, keep=None, distributed=Distributed(timeout=@DIST_TIMEOUT@))
engine.__enter__()  # a rank that dies never leaves it
engine.save(1, state(rank, 1)).committed_sync(120)
faults.inject("before_shard_write", "delay:1.0")  # the kill lands before the write
while waits and not os.path.exists(go):
    time.sleep(0.05)
current = state(rank, 2)
handle = engine.save(2, current)  # returned: staged
for t in current["model"].values():
    t.fill_(-1.0)  # the loop goes on mutating its state
print(engine.worker_pid, flush=True)
if dies:
    os.kill(os.getpid(), signal.SIGKILL)
outcomes = {}
for step in (2, 3):
    try:
        if step == 3:
            handle = engine.save(3, state(rank, 3))
        handle.committed_sync(120)
        outcomes[step] = "committed"
    except Exception as e:
        outcomes[step] = f"failed: {e} | cause: {e.__cause__}"
engine.close()
print(json.dumps(outcomes), flush=True)
os._exit(0)  # no barrier with a dead rank at exit
""".replace("@DIST_TIMEOUT@", str(DIST_TIMEOUT))


def state(rank: int, step: int) -> dict:
    """Rank ``rank``'s state at ``step``: its own weights, and a tensor every rank holds alike."""
    own = torch.Generator().manual_seed(1000 * step + rank)
    shared = torch.Generator().manual_seed(1000 * step + 999)
    return {
        "model": {
            f"r{rank}.w": torch.randn(1 << 18, generator=own),
            "shared": torch.randn(1000, generator=shared),
        },
        "step": step,
    }


def all_ranks(world: int, step: int) -> dict:
    """What a single process loads of every rank's step ``step``."""
    out: dict = {"model": {}, "step": step}
    for rank in range(world):
        out["model"].update(state(rank, step)["model"])
    return out


def run(tmp_path: Path, world: int, victims: set[int], first: set[int]) -> tuple[dict, list]:
    """Run ``world`` trainers; ``victims`` are SIGKILLed right after save(2) returned; the
    ``first`` stage step 2 (and die, if victims) before the others stage it. Returns the
    survivors' outcomes by rank and every rank's worker pid."""
    go = tmp_path / "go"
    here = str(Path(__file__).parents[1])
    root, store = str(tmp_path / "r"), str(tmp_path / "store")

    def args(r: int) -> list[str]:
        flags = [str(int(r in victims)), str(int(r not in first))]
        return [str(r), str(world), root, store, str(go), *flags, here]

    with ranks_running(tmp_path, TRAINER, "trainer", world, args) as ranks:
        ranks.wait(r for r in first if r in victims)  # dead before the others stage step 2
        go.touch()
        ranks.wait()
    ranks.assert_exited(lambda r: -signal.SIGKILL if r in victims else 0)
    outcomes, workers = {}, []
    for r in range(world):
        out = ranks.out(r)
        workers.append(int(out.split()[0]))
        if r not in victims:
            outcomes[r] = json.loads(out.splitlines()[-1])
    return outcomes, workers


def check_step_2_committed(tmp_path: Path, world: int, workers: list) -> None:
    root = tmp_path / "r"
    for pid in workers:  # each finishes what was staged, then exits: none lingers
        wait_gone(pid, 120)
    assert L.read_tracker(root) == 2
    with SyncCheckpointEngine(root, keep=None) as engine:
        target = {
            "model": {k: torch.zeros_like(v) for k, v in all_ranks(world, 0)["model"].items()}
        }
        assert engine.load_latest(target) == 2
    assert_same(target, all_ranks(world, 2))
    report = verify(root)
    assert report.ok and [c.step for c in report.checkpoints] == [1, 2], report
    assert report.leftovers == []


@pytest.mark.parametrize("world", [2, 4])
def test_every_trainer_killed_after_save_returned(tmp_path, world):
    """Before: rank 0's trainer hosted the store, so the other workers could not meet after
    it died and step 2 failed everywhere (the tracker stayed at 1)."""
    _, workers = run(tmp_path, world, victims=set(range(world)), first={0})
    check_step_2_committed(tmp_path, world, workers)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("victim", ["rank0", "last"])
def test_one_trainer_killed_while_the_others_go_on(tmp_path, world, victim):
    """Step 2 was staged on every rank: it commits, and the survivors' handles say so. Their
    next save cannot: a rank is gone, so it fails cleanly on every survivor after
    ``Distributed(timeout=)`` (nothing of it is left), and the survivors close normally."""
    dead = 0 if victim == "rank0" else world - 1
    outcomes, workers = run(tmp_path, world, victims={dead}, first={dead})
    assert set(outcomes) == set(range(world)) - {dead}
    for rank, out in outcomes.items():
        assert out["2"] == "committed", (rank, out)
        assert out["3"].startswith("failed"), (rank, out)
    check_step_2_committed(tmp_path, world, workers)
    assert not os.path.exists(tmp_path / "r" / "global_step_3")

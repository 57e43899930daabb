"""Lightning users' paths (issue 25.9): best/last_model_path name checkpoints that load from a
new Trainer (another process has no memory of this one's saves), best_k_models says what is
kept, and filename= is refused loudly rather than ignored."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import lightning_train as lt  # noqa: E402

from asyncckpt.integrations.lightning import AsyncModelCheckpoint  # noqa: E402


def test_best_and_last_paths_load_in_a_new_trainer_and_best_k_models_is_kept(tmp_path: Path):
    root = tmp_path / "ckpts"
    torch.manual_seed(0)
    cb = lt.checkpoint_callback(root)  # save_top_k=2 by "loss", every 5 steps, save_last
    lt.trainer(20, [cb]).fit(lt.TinyModel(), lt.data())
    kept = sorted(p.name for p in root.iterdir() if p.name.startswith("global_step_"))
    assert os.path.isdir(cb.last_model_path) and cb.last_model_path.endswith("global_step_20")
    assert os.path.isdir(cb.best_model_path)
    # best_k_models: the top-k this run saved, by their score, each a checkpoint on disk.
    assert 1 <= len(cb.best_k_models) <= 2
    assert cb.best_model_path in cb.best_k_models
    assert {Path(p).name for p in cb.best_k_models} <= set(kept)
    scores = {p: float(s) for p, s in cb.best_k_models.items()}
    assert float(cb.best_model_score) == min(scores.values())
    assert cb.kth_best_model_path in cb.best_k_models
    for path in (cb.last_model_path, cb.best_model_path):
        fresh = AsyncModelCheckpoint(tmp_path / "other", every_n_train_steps=100)
        step = int(Path(path).name.split("_")[-1])
        trainer = lt.trainer(step + 1, [fresh])
        trainer.fit(lt.TinyModel(), lt.data(), ckpt_path=path)
        assert trainer.global_step == step + 1  # resumed from that step, one more step run


def test_filename_is_refused_loudly(tmp_path: Path):
    with pytest.raises(ValueError, match=r"filename=.*global_step_<N>"):
        AsyncModelCheckpoint(tmp_path, filename="{epoch}-{loss:.2f}")


_ORPHANING_TRAINER = """
import sys, time
from asyncckpt import faults
from asyncckpt.integrations.lightning import AsyncCheckpointIO

root = sys.argv[1]
io = AsyncCheckpointIO()
io.save_checkpoint({"global_step": 10, "w": [1.0]}, root + "/global_step_10")
io.load_checkpoint(root + "/global_step_10")  # waits for the commit
faults.inject("before_rename", "delay:3")  # the next save's worker is slow to commit
io.save_checkpoint({"global_step": 15, "w": [2.0]}, root + "/global_step_15")
print("STAGED 15", flush=True)
time.sleep(600)  # SIGKILLed here: its worker goes on and commits step 15
"""


def test_reading_a_root_waits_for_a_killed_runs_worker(tmp_path: Path) -> None:
    """A trainer SIGKILLed right after save(15) returned leaves its worker committing step 15.
    A new process reading the root's newest checkpoint gets 15, not 10: it waits for that
    worker (before the fix it read step 10, and the resumed run's save of step 15 then met the
    orphan's commit: "step 15 is already committed", seen in CI)."""
    import signal
    import subprocess
    import sys

    from asyncckpt.integrations.lightning import AsyncCheckpointIO

    root = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORPHANING_TRAINER, str(root)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "STAGED 15"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (root / "global_step_15").exists()  # still being written by the orphan
        ckpt = AsyncCheckpointIO().load_checkpoint(root)
    finally:
        proc.kill()
        proc.wait()
    assert ckpt["global_step"] == 15 and ckpt["w"] == [2.0]

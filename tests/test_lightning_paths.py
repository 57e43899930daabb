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

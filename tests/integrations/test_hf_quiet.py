"""``integrations.hf.load_checkpoint(root, model)`` for evaluation (issue 25.10): the parts of
the checkpoint it was not asked for (optimizer, scheduler, ...) are skipped on purpose, quietly;
a part of the model itself that does not match still warns."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from asyncckpt import SyncCheckpointEngine  # noqa: E402
from asyncckpt.integrations.hf import load_checkpoint  # noqa: E402


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    sched = torch.optim.lr_scheduler.StepLR(optim, 1)
    return model, optim, sched


def test_loading_the_model_alone_is_quiet(tmp_path, caplog):
    model, optim, sched = trained()
    with SyncCheckpointEngine(tmp_path) as eng:
        eng.save(3, {"model": model, "optimizer": optim, "scheduler": sched, "rng": {"x": 1}})
    bare = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    caplog.set_level(logging.INFO, logger="asyncckpt")
    assert load_checkpoint(tmp_path, bare) == 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    for a, b in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_model_key_the_target_lacks_still_warns(tmp_path, caplog):
    model, optim, _ = trained()
    with SyncCheckpointEngine(tmp_path) as eng:
        eng.save(3, {"model": model, "optimizer": optim})
    smaller = torch.nn.Sequential(torch.nn.Linear(4, 8))  # no "1.weight" / "1.bias"
    caplog.set_level(logging.INFO, logger="asyncckpt")
    assert load_checkpoint(tmp_path, smaller) == 3
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "model.1.weight" in warned[0], warned
    assert "optimizer" not in warned[0]

"""The standalone loader and the Trainer's optimizer: its two parameter groups (decay / no
decay) are built by ``trainer_param_groups``; a one-group optimizer is refused in one line that
says how to build it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf_trainer import Rows, args, tiny_model  # noqa: E402

from asyncckpt.errors import StateMismatch  # noqa: E402
from asyncckpt.integrations.hf import (  # noqa: E402
    AsyncCheckpointCallback,
    load_checkpoint,
    trainer_param_groups,
)


def test_load_checkpoint_takes_the_trainers_param_groups(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    trainer = transformers.Trainer(
        model=tiny_model(0),
        args=args(tmp_path / "out", max_steps=2, weight_decay=0.1),
        train_dataset=Rows(16, 0),
        callbacks=[AsyncCheckpointCallback(ckpts, save_steps=2)],
    )
    trainer.train()
    groups = [g["params"] for g in trainer.optimizer.param_groups]

    # One group, as `AdamW(model.parameters())` builds it: refused, saying how.
    model = tiny_model(1)
    with pytest.raises(StateMismatch, match=r"1 parameter group.*trainer_param_groups\(model"):
        load_checkpoint(ckpts, model, optimizer=torch.optim.AdamW(model.parameters()))

    # The Trainer's groups: the same split, and the checkpoint loads into them.
    mine = trainer_param_groups(model, 0.1)
    assert [len(g["params"]) for g in mine] == [len(g) for g in groups]
    assert [g["weight_decay"] for g in mine] == [0.1, 0.0]
    optimizer = torch.optim.AdamW(mine, lr=1e-2)
    assert load_checkpoint(ckpts, model, optimizer=optimizer) == 2
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    # ... with the Trainer's Adam moments, bit for bit (a fresh optimizer's state is {}: they
    # were once dropped without a word).
    want = trainer.optimizer.state_dict()["state"]
    got = optimizer.state_dict()["state"]
    assert want and got.keys() == want.keys()
    for k in want:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[k][name], want[k][name]), (k, name)

"""A fresh optimizer (its ``state`` still ``{}``) gets the checkpoint's moments on every load
path, the partial one (``strict=False`` with keys to skip) included: that path once read only
the keys the target named, and a fresh optimizer names none of its moments, so they were
dropped without a word."""

from __future__ import annotations

import torch

from asyncckpt import SyncCheckpointEngine


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _same_moments(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[k][m], sb[k][m]) for k in sa for m in ("step", "exp_avg", "exp_avg_sq")
    )


def test_a_partial_load_gives_a_fresh_optimizer_its_moments(tmp_path):
    model, opt = _trained()
    with SyncCheckpointEngine(tmp_path / "ckpt") as engine:
        state = {"model": model, "optimizer": opt, "extra": torch.ones(3)}
        engine.save(1, state).committed_sync(60)
    fresh_model = torch.nn.Linear(4, 4)
    fresh = torch.optim.AdamW(fresh_model.parameters())
    assert not fresh.state
    with SyncCheckpointEngine(tmp_path / "ckpt") as engine:
        assert engine.load_latest({"model": fresh_model, "optimizer": fresh}, strict=False) == 1
        assert engine.last_load_report.unexpected == ["extra"]
    assert _same_moments(opt, fresh)
    assert torch.equal(fresh_model.weight, model.weight)


def test_a_partial_load_still_leaves_out_what_the_target_lacks(tmp_path):
    """A key the target lacks and holds no empty container for stays out (``extra``), and
    one under an empty container of the target comes in."""
    model, opt = _trained()
    with SyncCheckpointEngine(tmp_path / "ckpt") as engine:
        state = {"model": model, "optimizer": opt, "extra": {"a": torch.ones(2)}}
        engine.save(1, state).committed_sync(60)
    fresh_model = torch.nn.Linear(4, 4)
    fresh = torch.optim.AdamW(fresh_model.parameters())
    target = {"model": fresh_model, "optimizer": fresh, "extra": {}}  # an open container too
    with SyncCheckpointEngine(tmp_path / "ckpt") as engine:
        engine.load_latest({"model": fresh_model, "optimizer": fresh}, strict=False)
        assert engine.last_load_report.unexpected == ["extra.a"]
    assert _same_moments(opt, fresh)
    with SyncCheckpointEngine(tmp_path / "ckpt") as engine:
        engine.load_latest(target, strict=False)
    assert torch.equal(target["extra"]["a"], torch.ones(2))

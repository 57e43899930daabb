"""torch DCP users' habits (issue 25.7): the state built the DCP way (``get_state_dict`` /
``set_state_dict``, fully qualified names) round-trips through asyncckpt, and a checkpoint of a
model and its optimizer loads through DCP's own recipe."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from asyncckpt import SyncCheckpointEngine
from asyncckpt.integrations.dcp import dcp_state


class AppState(Stateful):
    """As in torch's DCP tutorial."""

    def __init__(self, model, optimizer=None):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self):
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict):
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(5, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def fresh():
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=5e-2)


def assert_same_training_state(m1, o1, m2, o2):
    for (k, a), b in zip(m1.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for i in s1["state"]:
        for k, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][k]), (i, k)


def test_an_appstate_built_with_get_state_dict_round_trips(tmp_path):
    model, optim = trained(0)
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        eng.save(1, {"app": AppState(model, optim)}).committed_sync(60)
    model2, optim2 = fresh()
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        assert eng.load_latest({"app": AppState(model2, optim2)}) == 1
    assert_same_training_state(model, optim, model2, optim2)
    # ... and DCP's tutorial loads it as it is, without asyncckpt.
    model3, optim3 = fresh()
    dcp.load({"app": AppState(model3, optim3)}, checkpoint_id=tmp_path / "r" / "global_step_1")
    assert_same_training_state(model, optim, model3, optim3)


def dcp_recipe_load(path, model, optim):
    """DCP's documented way to load a model and its optimizer (no asyncckpt)."""
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def test_model_and_optimizer_load_through_dcps_recipe(tmp_path):
    model, optim = trained(1)
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        # The one line (README): dcp_state(model, optim) instead of {"model": m, "optim": o}.
        eng.save(1, {**dcp_state(model, optim), "epoch": 4}).committed_sync(60)
    model2, optim2 = fresh()
    dcp_recipe_load(tmp_path / "r" / "global_step_1", model2, optim2)
    assert_same_training_state(model, optim, model2, optim2)
    # asyncckpt loads it back the same way.
    model3, optim3 = fresh()
    target = {**dcp_state(model3, optim3), "epoch": 0}
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        assert eng.load_latest(target) == 1
    assert_same_training_state(model, optim, model3, optim3)
    assert target["epoch"] == 4


def test_dcp_state_refuses_what_is_not_a_module_or_an_optimizer():
    model, optim = fresh()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        dcp_state(optim, optim)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        dcp_state(model, model)

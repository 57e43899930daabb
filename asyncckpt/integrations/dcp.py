"""torch.distributed.checkpoint's habits: a model and its optimizer the way DCP names them.

An optimizer in asyncckpt's state is saved as ``optimizer.state_dict()``: its state is keyed by
parameter index (``optim.state.0.step``). DCP's documented recipe loads optimizers through
``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict``, which key them
by the parameter's fully qualified name (``optim.state.0.weight.step``), so it cannot load the
former. ``dcp_state(model, optimizer)`` is the state to save instead: the same two entries,
``"model"`` and ``"optim"``, each a Stateful that goes through ``get_*_state_dict`` /
``set_*_state_dict``::

    engine.save(step, dcp_state(model, optimizer))            # instead of {"model": m, "optim": o}
    engine.load_latest(dcp_state(model, optimizer))           # asyncckpt loads it back

    # DCP's recipe, no asyncckpt:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=".../global_step_N")
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

Add other entries beside them as usual: ``{**dcp_state(model, optimizer), "data": loader}``.
A state built the DCP way by hand (a tutorial ``AppState`` whose ``state_dict`` calls
``get_state_dict``) works as it is: any Stateful does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["dcp_state", "ModelState", "OptimizerState"]


class ModelState(Stateful):
    """A module's state under DCP's fully qualified names (``get_model_state_dict``)."""

    def __init__(self, model: torch.nn.Module, options: StateDictOptions | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        self.model = model
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict, options=self.options)


class OptimizerState(Stateful):
    """An optimizer's state keyed by parameter name (``get_optimizer_state_dict``), as DCP's
    recipe expects, instead of by parameter index (``optimizer.state_dict()``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options: StateDictOptions | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}"
            )
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer, options=self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict, options=self.options)


def dcp_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    options: StateDictOptions | None = None,
) -> dict[str, Stateful]:
    """``{"model": ..., "optim": ...}`` saved under DCP's names: loadable by DCP's recipe
    (``get_state_dict`` + ``dcp.load`` + ``set_state_dict``) and by asyncckpt. ``options``:
    DCP's ``StateDictOptions`` (full or sharded state dicts under FSDP, ...)."""
    out: dict[str, Stateful] = {"model": ModelState(model, options)}
    if optimizer is not None:
        out["optim"] = OptimizerState(model, optimizer, options)
    return out

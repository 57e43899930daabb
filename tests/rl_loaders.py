"""The RL frameworks' own resume paths, copied, run where no asyncckpt is imported.

``test_frameworks.py`` trains a tiny model, saves it with ``components=frameworks.skyrl(...)``
or ``frameworks.rlinf(...)``, then runs this file in a fresh interpreter::

    python tests/rl_loaders.py skyrl-fsdp     <ckpt_path> <out.pt>
    python tests/rl_loaders.py skyrl-megatron <ckpt_path> <out.pt>
    python tests/rl_loaders.py rlinf-megatron <checkpoints_dir> <out.pt>
    python tests/rl_loaders.py rlinf-fsdp     <checkpoints_dir> <out.pt>

(RLinf's ``runner.resume_dir: auto``: the newest ``global_step_N`` of the checkpoints dir.)

Each function below follows the framework's code, file for file and key for key (the source
each one follows is named in it); the model classes stand in for the framework's (an FSDP or
Megatron model on a GPU) with the same ``load_state_dict`` calls. What was loaded is saved to
``out.pt`` for the test to compare with what it trained.
"""

from __future__ import annotations

import glob
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)  # same structure and init as the test's; the load overwrites it
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def make_optim(model: torch.nn.Module):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return optim, sched


# ------------------------------------------------------------------------------ SkyRL
# skyrl-train: skyrl_train/trainer.py (RayPPOTrainer.load_checkpoints),
# skyrl_train/utils/trainer_utils.py (extract_step_from_path,
# validate_consistency_for_latest_checkpoint), skyrl_train/distributed/fsdp_strategy.py
# (FSDPStrategy.load_checkpoint), skyrl_train/distributed/strategy.py (load_rng_state).

GLOBAL_STEP_PREFIX = "global_step_"


def extract_step_from_path(path: Path) -> int:
    basename = os.path.basename(path)
    if basename.startswith(GLOBAL_STEP_PREFIX):
        return int(basename.split(GLOBAL_STEP_PREFIX)[1])
    return -1


def validate_consistency_for_latest_checkpoint(root, ckpt_iteration, ckpt_path, tracker, interval):
    found = [
        extract_step_from_path(Path(p)) for p in glob.glob(os.path.join(root, "global_step_*"))
    ]
    if found and max(found) - ckpt_iteration > interval:
        raise ValueError(f"{tracker} names {ckpt_iteration}, but {max(found)} is in {root}")


def skyrl_load_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    np.random.set_state(rng["numpy"])
    random.setstate(rng["random"])


def skyrl_fsdp_load_checkpoint(ckpt_dir: str, model, optimizer, scheduler) -> dict:
    world_size, rank = 1, 0
    model_path = os.path.join(ckpt_dir, f"model_world_size_{world_size}_rank_{rank}.pt")
    optim_path = os.path.join(ckpt_dir, f"optim_world_size_{world_size}_rank_{rank}.pt")
    extra_path = os.path.join(ckpt_dir, f"extra_state_world_size_{world_size}_rank_{rank}.pt")
    if not os.path.exists(model_path):
        raise FileNotFoundError(model_path)
    if not os.path.exists(extra_path):
        raise FileNotFoundError(extra_path)
    model_state_dict = torch.load(model_path, map_location="cpu", weights_only=False)
    extra_state_dict = torch.load(extra_path, map_location="cpu", weights_only=False)
    optimizer_state_dict = None
    if os.path.exists(optim_path):
        optimizer_state_dict = torch.load(optim_path, map_location="cpu", weights_only=False)
    lr_scheduler_state_dict = extra_state_dict.get("lr_scheduler", {})
    model.load_state_dict(model_state_dict, strict=True)
    if optimizer is not None and optimizer_state_dict:
        optimizer.load_state_dict(optimizer_state_dict)
    if scheduler is not None:
        scheduler.load_state_dict(lr_scheduler_state_dict)
    if "rng" in extra_state_dict:
        skyrl_load_rng_state(extra_state_dict["rng"])
    return extra_state_dict


def skyrl_load_checkpoints(ckpt_path: str, interval: int, backend: str) -> dict:
    latest_checkpoint_file = os.path.join(ckpt_path, "latest_ckpt_global_step.txt")
    if not os.path.exists(latest_checkpoint_file):
        return {"global_step": 0}
    with open(latest_checkpoint_file) as f:
        ckpt_iteration = int(f.read().strip())
    checkpoint_path = os.path.join(ckpt_path, f"{GLOBAL_STEP_PREFIX}{ckpt_iteration}")
    validate_consistency_for_latest_checkpoint(
        ckpt_path, ckpt_iteration, checkpoint_path, latest_checkpoint_file, interval
    )
    if not os.path.exists(checkpoint_path):
        raise FileNotFoundError(checkpoint_path)
    global_step = extract_step_from_path(Path(checkpoint_path))
    if global_step == -1:
        raise ValueError(checkpoint_path)
    trainer_state_path = os.path.join(checkpoint_path, "trainer_state.pt")
    if not os.path.exists(trainer_state_path):
        raise FileNotFoundError(trainer_state_path)
    trainer_state = torch.load(trainer_state_path, map_location="cpu", weights_only=False)
    saved_global_step = trainer_state.get("global_step", global_step)
    assert saved_global_step == global_step, (saved_global_step, global_step)
    out = {"global_step": global_step, "config": trainer_state["config"]}
    dataloader_state_path = os.path.join(checkpoint_path, "data.pt")
    out["data"] = torch.load(dataloader_state_path, map_location="cpu", weights_only=False)
    if backend == "fsdp":  # megatron: the test runs megatron's own loader on policy/
        for role in ("policy", "critic"):
            model = make_model()
            optim, sched = make_optim(model)
            extra = skyrl_fsdp_load_checkpoint(
                os.path.join(checkpoint_path, role), model, optim, sched
            )
            out[role] = {
                "model": model.state_dict(),
                "optimizer": optim.state_dict(),
                "lr_scheduler": sched.state_dict(),
                "rng_after_load": torch.get_rng_state(),
                "fsdp_strategy": extra["fsdp_strategy"],
            }
    return out


# ------------------------------------------------------------------------------ RLinf
# RLinf: rlinf/runners/reasoning_runner.py (init_actor_workers: the step from resume_dir, the
# actor from resume_dir/actor, data from resume_dir/data/data.pt); the Megatron actor sets
# args.load = resume_dir/actor and calls Megatron-LM's load_checkpoint
# (megatron/training/checkpointing.py: read_metadata, get_checkpoint_name, the keys read,
# optimizer.load_parameter_state for distrib_optim.pt); the FSDP actor calls
# dcp.load({"fsdp_checkpoint": Checkpoint(...)}) on actor/dcp_checkpoint (else actor/).


def rlinf_auto_resume_dir(checkpoints_dir: str) -> str | None:
    """``resume_dir == "auto"`` (ReasoningRunner.init_workers)."""
    if not os.path.exists(checkpoints_dir):
        return None
    checkpoint_steps = [
        int(d.split("global_step_")[-1])
        for d in os.listdir(checkpoints_dir)
        if d.startswith("global_step_") and os.path.isdir(os.path.join(checkpoints_dir, d))
    ]
    if not checkpoint_steps:
        return None
    return os.path.join(checkpoints_dir, f"global_step_{max(checkpoint_steps)}")


def megatron_read_metadata(tracker_filename: str) -> int:
    with open(tracker_filename) as f:
        metastring = f.read().strip()
    if metastring == "release":
        return 0
    return int(metastring)


def megatron_get_checkpoint_name(checkpoints_path, iteration, tp_rank=0, pp_rank=None):
    directory = f"iter_{iteration:07d}"
    if pp_rank is None:
        common_path = os.path.join(checkpoints_path, directory, f"mp_rank_{tp_rank:02d}")
    else:
        common_path = os.path.join(
            checkpoints_path, directory, f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        )
    return os.path.join(common_path, "model_optim_rng.pt")


def rlinf_megatron(resume_dir: str) -> dict:
    global_steps = int(resume_dir.split("global_step_")[-1])
    load_dir = os.path.join(resume_dir, "actor")
    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        sys.exit(f"no {tracker}")  # exit_on_missing_checkpoint
    iteration = megatron_read_metadata(tracker)
    checkpoint_name = megatron_get_checkpoint_name(load_dir, iteration)
    state_dict = torch.load(checkpoint_name, map_location="cpu", weights_only=False)
    checkpoint_version = state_dict.get("checkpoint_version", 0)
    iteration = state_dict.get("iteration", state_dict.get("total_iters"))
    args = state_dict["args"]
    assert args.num_layers == 2 and args.tensor_model_parallel_size == 1, args
    model = make_model()
    optim, sched = make_optim(model)
    model.load_state_dict(state_dict["model"], strict=True)
    optim.load_state_dict(state_dict["optimizer"])
    sched.load_state_dict(state_dict["opt_param_scheduler"])
    rng_state = state_dict["rng_state"][0]
    random.setstate(rng_state["random_rng_state"])
    np.random.set_state(rng_state["np_rng_state"])
    torch.set_rng_state(rng_state["torch_rng_state"])
    # use_distributed_optimizer: optimizer.load_parameter_state(<same dir>/distrib_optim.pt)
    distrib = os.path.join(os.path.dirname(checkpoint_name), "distrib_optim.pt")
    param_state = torch.load(distrib, map_location="cpu", weights_only=False)
    data = torch.load(os.path.join(resume_dir, "data/data.pt"), weights_only=False)
    return {
        "global_steps": global_steps,
        "iteration": iteration,
        "checkpoint_version": checkpoint_version,
        "model": model.state_dict(),
        "optimizer": optim.state_dict(),
        "opt_param_scheduler": sched.state_dict(),
        "rng_after_load": torch.get_rng_state(),
        "distrib_optim": param_state,
        "data": data,
    }


class RLinfCheckpoint:
    """RLinf's Stateful ``Checkpoint`` (hybrid_engines/fsdp/strategy/checkpoint.py), for a
    model without FSDP: the same keys, through torch's get_state_dict/set_state_dict."""

    def __init__(self, model, optimizer, lr_scheduler, fsdp_version="fsdp2"):
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.fsdp_version = fsdp_version

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=False, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=opts)
        return {
            "model": model_sd,
            "optimizers": optim_sd,
            "lr_schedulers": [self.lr_scheduler.state_dict()],
            "fsdp_version": self.fsdp_version,
        }

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        assert state["fsdp_version"] == self.fsdp_version, state["fsdp_version"]
        opts = StateDictOptions(full_state_dict=False, cpu_offload=True)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optimizers", state.get("optim")),
            options=opts,
        )
        self.lr_scheduler.load_state_dict(state["lr_schedulers"][0])


def rlinf_fsdp(resume_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp

    global_steps = int(resume_dir.split("global_step_")[-1])
    load_path = os.path.join(resume_dir, "actor")
    dcp_path = os.path.join(load_path, "dcp_checkpoint")
    if os.path.isdir(dcp_path):
        load_path = dcp_path
    if not glob.glob(os.path.join(load_path, "*.distcp")):
        raise FileNotFoundError(f"no *.distcp in {load_path}")
    model = make_model()
    optim, sched = make_optim(model)
    dcp.load({"fsdp_checkpoint": RLinfCheckpoint(model, optim, sched)}, checkpoint_id=load_path)
    data = torch.load(os.path.join(resume_dir, "data/data.pt"), weights_only=False)
    return {
        "global_steps": global_steps,
        "model": model.state_dict(),
        "optimizer": optim.state_dict(),
        "lr_scheduler": sched.state_dict(),
        "data": data,
    }


def main(argv: list[str]) -> None:
    which, path, out = argv
    if which.startswith("skyrl-"):
        loaded = skyrl_load_checkpoints(path, interval=10, backend=which.split("-", 1)[1])
    elif which in ("rlinf-megatron", "rlinf-fsdp"):
        resume_dir = rlinf_auto_resume_dir(path)
        assert resume_dir is not None, f"no global_step_N in {path}"
        loaded = (rlinf_megatron if which == "rlinf-megatron" else rlinf_fsdp)(resume_dir)
    else:
        raise ValueError(which)
    # The point of running here: the framework's path read it with no asyncckpt code loaded.
    assert not any(m == "asyncckpt" or m.startswith("asyncckpt.") for m in sys.modules)
    torch.save(loaded, out)
    print("OK", which)


if __name__ == "__main__":
    main(sys.argv[1:])

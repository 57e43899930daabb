"""SkyRL and RLinf layouts: what the engine writes, their own resume paths read.

A tiny model is trained with AdamW and a step scheduler, saved every 10 steps with
``components=frameworks.skyrl(...)`` / ``frameworks.rlinf(...)`` and the retention those
frameworks offer (``max_ckpts_to_keep``), and then the framework's resume path
(``rl_loaders.py``: a copy of their code, run in a fresh interpreter with no asyncckpt
imported) reads the root: the step it resumes at, weights, optimizer, scheduler, RNG and
dataloader state are compared with what was trained, bit for bit. A temporary left by a crash
sits in the root meanwhile: neither framework's directory scan may pick it. asyncckpt's own
engine resumes from the same root into fresh objects too.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import rl_loaders as rl
import torch
from statecmp import assert_same

from asyncckpt import KeepLast, SyncCheckpointEngine
from asyncckpt.core import layout as L
from asyncckpt.frameworks import rlinf, skyrl

pytestmark = pytest.mark.integration  # real frameworks / several ranks: `-m integration`

LOADERS = Path(__file__).parents[1] / "rl_loaders.py"


class Trainer:
    """A model, its AdamW and scheduler, trained a few steps at a time."""

    def __init__(self) -> None:
        self.model = rl.make_model()
        self.optim, self.sched = rl.make_optim(self.model)
        self.x = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.model(self.x).pow(2).mean().backward()
            self.optim.step()
            self.optim.zero_grad()
            self.sched.step()


def rng_state() -> dict:
    return {
        "cpu": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "random": random.getstate(),
    }


def data_state(step: int) -> dict:
    return {"_num_yielded": step * 4, "_sampler_iter_state": {"samples_yielded": step * 16}}


def run_loader(which: str, path: Path, tmp_path: Path) -> dict:
    out = tmp_path / f"{which}.loaded.pt"
    p = subprocess.run(
        [sys.executable, str(LOADERS), which, str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return torch.load(out, weights_only=False)


def leave_a_crashed_temporary(root: Path, step: int) -> None:
    """What a trainer SIGKILLed mid-save leaves until its next start: a half-written step."""
    tmp = root / L.tmp_name("global_step", step, "crashed")
    (tmp / "policy").mkdir(parents=True)
    (tmp / "policy" / "half.distcp").write_bytes(b"\0" * 100)


# ------------------------------------------------------------------------------ SkyRL


def skyrl_role(t: Trainer, rng: dict) -> dict:
    return {
        "model": t.model.state_dict(),
        "optimizer": t.optim.state_dict(),
        "extra_state": {
            "lr_scheduler": t.sched.state_dict(),
            "client_state": {},
            "tag": None,
            "fsdp_strategy": "fsdp2",
            "world_size": 1,
            "rank": 0,
            "rng": rng,
        },
    }


def test_skyrl_fsdp_resumes_what_the_engine_wrote(tmp_path):
    root = tmp_path / "ckpts"
    policy, critic = Trainer(), Trainer()
    config = {"trainer": {"ckpt_interval": 10, "max_ckpts_to_keep": 2}}
    with SyncCheckpointEngine(root, components=skyrl("fsdp", critic=True), keep=KeepLast(2)) as e:
        for step in (10, 20, 30):
            policy.train(3)
            critic.train(2)
            rng = rng_state()
            e.save(
                step,
                {
                    "policy": skyrl_role(policy, rng),
                    "critic": skyrl_role(critic, rng),
                    "data": data_state(step),
                    "trainer_state": {"global_step": step, "config": config},
                },
            )
            e.wait()  # the state dicts are staged copies; wait only to compare each step
    assert [c.step for c in L.scan(root, "global_step")] == [20, 30]  # max_ckpts_to_keep=2
    assert (root / "latest_ckpt_global_step.txt").read_text().strip() == "30"
    assert sorted(os.listdir(root / "global_step_30" / "policy")) == [
        "extra_state_world_size_1_rank_0.pt",
        "model_world_size_1_rank_0.pt",
        "optim_world_size_1_rank_0.pt",
    ]
    leave_a_crashed_temporary(root, 40)

    got = run_loader("skyrl-fsdp", root, tmp_path)
    assert got["global_step"] == 30 and got["config"] == config
    assert_same(got["data"], data_state(30))
    for role, t in (("policy", policy), ("critic", critic)):
        assert_same(got[role]["model"], t.model.state_dict(), role)
        assert_same(got[role]["optimizer"], t.optim.state_dict(), role)
        assert_same(got[role]["lr_scheduler"], t.sched.state_dict(), role)
        assert torch.equal(got[role]["rng_after_load"], rng["cpu"])
        assert got[role]["fsdp_strategy"] == "fsdp2"

    # asyncckpt's own resume, into fresh objects (modules and optimizers restored in place).
    fresh, fresh_critic = Trainer(), Trainer()
    target = {
        "policy": {
            "model": fresh.model,
            "optimizer": fresh.optim,
            "extra_state": {"lr_scheduler": fresh.sched, "rng": {}},
        },
        "critic": {"model": fresh_critic.model, "optimizer": fresh_critic.optim},
        "data": {},
        "trainer_state": {},
    }
    with SyncCheckpointEngine(root, components=skyrl("fsdp", critic=True)) as e:
        assert e.load_latest(target) == 30
    assert_same(fresh.model.state_dict(), policy.model.state_dict())
    assert_same(fresh.optim.state_dict(), policy.optim.state_dict())
    assert_same(fresh.sched.state_dict(), policy.sched.state_dict())
    assert_same(fresh_critic.optim.state_dict(), critic.optim.state_dict())
    assert target["trainer_state"]["global_step"] == 30
    assert np.array_equal(target["policy"]["extra_state"]["rng"]["numpy"][1], rng["numpy"][1])
    assert_same(target["data"], data_state(30))


def test_skyrl_megatron_policy_is_read_by_megatron(tmp_path):
    """SkyRL's Megatron strategy hands ``global_step_N/policy`` to
    ``megatron.core.dist_checkpointing.load``: megatron's own loader reads it."""
    mh = pytest.importorskip("megatron_helpers")
    pytest.importorskip("megatron.core")
    root = tmp_path / "ckpts"
    with SyncCheckpointEngine(root, components=skyrl("megatron")) as e:
        e.save(
            10,
            {
                "policy": mh.plain_state(),
                "data": data_state(10),
                "trainer_state": {"global_step": 10, "config": {}},
            },
        )
    helpers = Path(__file__).parents[1] / "megatron_helpers.py"
    p = subprocess.run(
        [sys.executable, str(helpers), "load", "plain", str(root / "global_step_10" / "policy")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0 and "OK load plain" in p.stdout, p.stdout + p.stderr
    got = run_loader("skyrl-megatron", root, tmp_path)
    assert got["global_step"] == 10
    assert_same(got["data"], data_state(10))


# ------------------------------------------------------------------------------ RLinf


def test_rlinf_megatron_resumes_what_the_engine_wrote(tmp_path):
    root = tmp_path / "checkpoints"
    t = Trainer()
    args = argparse.Namespace(num_layers=2, tensor_model_parallel_size=1, hidden_size=8)
    with SyncCheckpointEngine(root, components=rlinf("megatron"), keep=KeepLast(1)) as e:
        for step in (50, 100):
            t.train(4)
            rng = [
                {
                    "random_rng_state": random.getstate(),
                    "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(),
                    "rng_tracker_states": {},
                }
            ]
            actor = {
                "checkpoint_version": 3.0,
                "iteration": step,
                "args": args,
                "model": t.model.state_dict(),
                "optimizer": t.optim.state_dict(),
                "opt_param_scheduler": t.sched.state_dict(),
                "rng_state": rng,
                "distrib_optim": {"buckets": [torch.full((4,), float(step))]},
            }
            e.save(step, {"actor": actor, "data": data_state(step)})
            e.wait()
    assert [c.step for c in L.scan(root, "global_step")] == [100]
    assert (root / "global_step_100/actor/latest_checkpointed_iteration.txt").read_text() == "100\n"
    leave_a_crashed_temporary(root, 150)

    got = run_loader("rlinf-megatron", root, tmp_path)
    assert got["global_steps"] == 100 and got["iteration"] == 100
    assert got["checkpoint_version"] == 3.0
    assert_same(got["model"], t.model.state_dict())
    assert_same(got["optimizer"], t.optim.state_dict())
    assert_same(got["opt_param_scheduler"], t.sched.state_dict())
    assert torch.equal(got["rng_after_load"], rng[0]["torch_rng_state"])
    assert_same(got["distrib_optim"], {"buckets": [torch.full((4,), 100.0)]})
    assert_same(got["data"], data_state(100))


def test_rlinf_fsdp_resumes_what_the_engine_wrote(tmp_path):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    root = tmp_path / "checkpoints"
    t = Trainer()
    opts = StateDictOptions(full_state_dict=False, cpu_offload=True)
    with SyncCheckpointEngine(root, components=rlinf("fsdp", full_weights=True)) as e:
        for step in (10, 20):
            t.train(3)
            model_sd, optim_sd = get_state_dict(t.model, t.optim, options=opts)
            checkpoint = {
                "model": model_sd,
                "optimizers": optim_sd,
                "lr_schedulers": [t.sched.state_dict()],
                "fsdp_version": "fsdp2",
            }
            e.save(
                step,
                {
                    "actor": {"fsdp_checkpoint": checkpoint},
                    "full_weights": t.model.state_dict(),
                    "data": data_state(step),
                },
            )
            e.wait()
    step_dir = root / "global_step_20"
    assert (step_dir / "actor/dcp_checkpoint/.metadata").is_file()
    assert_same(
        torch.load(step_dir / "actor/model_state_dict/full_weights.pt", weights_only=True),
        t.model.state_dict(),
    )
    leave_a_crashed_temporary(root, 30)

    got = run_loader("rlinf-fsdp", root, tmp_path)
    assert got["global_steps"] == 20
    assert_same(got["model"], t.model.state_dict())
    assert_same(got["optimizer"], t.optim.state_dict())
    assert_same(got["lr_scheduler"], t.sched.state_dict())
    assert_same(got["data"], data_state(20))


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: skyrl("deepspeed"), "unknown SkyRL backend 'deepspeed'"),
        (lambda: rlinf("fsdp1"), "unknown RLinf backend"),
        (lambda: rlinf("megatron", full_weights=True), "full_weights= is RLinf's FSDP layout"),
    ],
)
def test_unknown_backends_are_refused(make, error):
    with pytest.raises(ValueError, match=error):
        make()

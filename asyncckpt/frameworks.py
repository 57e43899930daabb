"""The checkpoint layouts of the RL frameworks, as ``components=`` specs.

Pass one to ``CheckpointEngine(root, components=...)`` (``layout="global_step"``, the default)
and a checkpoint is written where that framework's own resume code looks for it, committed as
one step::

    engine = CheckpointEngine(ckpt_path, components=skyrl("fsdp", critic=True),
                              keep=KeepLast(max_ckpts_to_keep))
    await engine.save(step, {
        "policy": {"model": model.state_dict(), "optimizer": optim.state_dict(),
                   "extra_state": {"lr_scheduler": sched.state_dict(), "rng": rng_state}},
        "critic": {...},
        "data": dataloader.state_dict(),
        "trainer_state": {"global_step": step, "config": cfg},
    })

Every name and key here is the one the framework reads (``tests/integrations/test_frameworks.py`` runs a
copy of each load path against what the engine wrote); which keys go *inside* each part
(``model``, ``optimizer``, ``rng``...) is the caller's state, as the framework writes it.
"""

from __future__ import annotations

from asyncckpt.formats.components import Component

#: SkyRL's tracker of the newest step (written by the engine for ``layout="global_step"``).
SKYRL_TRACKER = "latest_ckpt_global_step.txt"
SKYRL_BACKENDS = ("fsdp", "megatron")
RLINF_BACKENDS = ("megatron", "fsdp")


def _check_backend(backend: str, allowed: tuple[str, ...], who: str) -> None:
    if backend not in allowed:
        raise ValueError(f"unknown {who} backend {backend!r}; expected one of {allowed}")


def skyrl(backend: str = "fsdp", *, critic: bool = False) -> dict:
    """SkyRL (skyrl-train): ``global_step_N/{policy,critic}/``, ``data.pt``, ``trainer_state.pt``.

    ``fsdp``: each model's directory holds, per rank, ``model_world_size_{W}_rank_{R}.pt``
    (the model's state dict), ``optim_world_size_{W}_rank_{R}.pt`` (the optimizer's) and
    ``extra_state_world_size_{W}_rank_{R}.pt`` (``{"lr_scheduler": ..., "rng": ...}``), as
    SkyRL's ``FSDPStrategy.load_checkpoint`` reads them: state
    ``{"policy": {"model": ..., "optimizer": ..., "extra_state": ...}}``.
    ``megatron``: each model's directory is one Megatron ``torch_dist`` checkpoint (SkyRL's
    ``MegatronStrategy`` calls ``dist_checkpointing.load`` on it) with keys ``model``,
    ``optimizer``, ``lr_scheduler``, ``rng``: state ``{"policy": {...}}``.

    ``data.pt`` (the dataloader's state dict) and ``trainer_state.pt`` (``global_step``,
    ``config``) are written by rank 0. SkyRL reads every file with ``weights_only=False``;
    the engine reads ``extra_state`` (numpy RNG state) and ``trainer_state`` (a config object)
    so too, and the rest with ``weights_only=True``.
    """
    _check_backend(backend, SKYRL_BACKENDS, "SkyRL")
    roles = ["policy", "critic"] if critic else ["policy"]
    spec: dict = {}
    for role in roles:
        if backend == "megatron":
            spec[role] = Component("torch_dist", path=role)
            continue
        per_rank = "world_size_{world_size}_rank_{rank}.pt"
        spec[role] = {
            "model": Component("pt", path=f"{role}/model_{per_rank}"),
            "optimizer": Component("pt", path=f"{role}/optim_{per_rank}"),
            "extra_state": Component(
                "pt", path=f"{role}/extra_state_{per_rank}", weights_only=False
            ),
        }
    spec["data"] = Component("pt", path="data.pt")
    spec["trainer_state"] = Component("pt", path="trainer_state.pt", weights_only=False)
    return spec


def rlinf(backend: str = "megatron", *, full_weights: bool = False) -> dict:
    """RLinf: ``global_step_N/actor/...`` and ``global_step_N/data/data.pt``.

    ``megatron``: ``actor/`` is a Megatron-LM ``--load`` directory in its legacy format
    (``ckpt_format="torch"``, RLinf's default): ``actor/latest_checkpointed_iteration.txt``
    naming the step and ``actor/iter_{N:07d}/mp_rank_XX/model_optim_rng.pt`` (plus
    ``distrib_optim.pt`` for a ``"distrib_optim"`` entry); the actor's state holds what
    Megatron-LM's ``load_checkpoint`` reads (``model``, ``optimizer``,
    ``opt_param_scheduler``, ``rng_state``, ``args``, ``iteration``, ``checkpoint_version``).
    ``fsdp``: ``actor/dcp_checkpoint/`` is a DCP checkpoint (RLinf loads it with
    ``dcp.load({"fsdp_checkpoint": Checkpoint(...)})``, so the actor's state is
    ``{"fsdp_checkpoint": {...}}``); with ``full_weights=True`` also a component
    ``"full_weights"`` at ``actor/model_state_dict/full_weights.pt`` (rank 0; RLinf's resume
    does not read it).

    ``data/data.pt`` is the dataloader's state dict (rank 0).
    """
    _check_backend(backend, RLINF_BACKENDS, "RLinf")
    if full_weights and backend != "fsdp":
        raise ValueError("full_weights= is RLinf's FSDP layout; its Megatron actor has none")
    spec: dict = {}
    if backend == "megatron":
        spec["actor"] = Component(
            "megatron_legacy",
            path="actor/iter_{step:07d}",
            tracker="actor/latest_checkpointed_iteration.txt",
        )
    else:
        spec["actor"] = Component("dcp", path="actor/dcp_checkpoint")
        if full_weights:
            spec["full_weights"] = Component("pt", path="actor/model_state_dict/full_weights.pt")
    spec["data"] = Component("pt", path="data/data.pt")
    return spec

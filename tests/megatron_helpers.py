"""Megatron-side helpers for ``test_formats_megatron.py``; only ``write_dir`` imports asyncckpt.

Imported by the tests to build states (and write them), and run as a script in a fresh
interpreter, so that megatron's own code reads (or writes) a checkpoint in a process that has
no asyncckpt in it::

    python tests/megatron_helpers.py load <scenario> <ckpt_dir>
    python tests/megatron_helpers.py reference-save <scenario> <ckpt_dir>

megatron is imported lazily so the test module can be collected (and skip) without it.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from typing import Any

import torch
from statecmp import assert_same


def plain_state() -> dict:
    """A plain nested state: every dtype the tests promise, nesting, int keys, lists, common."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    w[0, 0], w[0, 1], w[0, 2] = math.nan, -0.0, math.inf  # bit-exact, not just ==
    return {
        "model": {
            "w": w,
            "bf": torch.randn(5, 2, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**62), 2**62, (7,), generator=g, dtype=torch.int64),
            "mask": torch.randint(0, 2, (3, 3), generator=g).bool(),
            "scalar": torch.tensor(2.5),
        },
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(3, generator=g), "step": torch.tensor(7)}},
            "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.95)}],
        },
        "layers": [torch.arange(4), torch.ones(2, 2, dtype=torch.bfloat16)],
        "iteration": 50,
        "name": "run-a",
        "empty": {},
    }


def write_dir(state: dict, directory: str | os.PathLike, fmt: str = "torch_dist") -> None:
    """Write ``state`` into ``directory`` the way the engine writes a step, in this process:
    the format's trainer side (``staged.prepare``) then its worker side (``staged.write``),
    the staged tensors being the state's own (no staging copy, no worker, no manifest)."""
    from pathlib import Path

    from asyncckpt.formats import staged

    prepared = staged.prepare(fmt, state)
    Path(directory).mkdir(parents=True, exist_ok=True)
    staged.write(fmt, prepared.tensors, prepared.objects, prepared.extra, Path(directory))


def _map_tensors(x: Any, fn: Any, path: tuple = ()) -> Any:
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn, (*path, k)) for k, v in x.items()}
    if isinstance(x, list):
        return [_map_tensors(v, fn, (*path, i)) for i, v in enumerate(x)]
    return fn(".".join(map(str, path)), x) if isinstance(x, torch.Tensor) else x


def plain_template(state: dict) -> dict:
    """The sharded state dict a megatron user builds to load a plain state: key = dotted path."""
    from megatron.core.dist_checkpointing import ShardedTensor

    return _map_tensors(
        state, lambda key, t: ShardedTensor.from_rank_offsets(key, torch.empty_like(t))
    )


def megatron_state(with_data: bool = True) -> dict:
    """A megatron sharded state dict; ``with_data=False`` gives the loading template."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    g = torch.Generator().manual_seed(1)
    big = torch.randn(4, 3, generator=g)
    dense = torch.randn(2, 5, generator=g).to(torch.bfloat16)
    vec = torch.arange(6, dtype=torch.int64)

    def d(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if with_data else torch.empty_like(t)

    return {
        "model": {
            "dense": ShardedTensor.from_rank_offsets("decoder.dense.weight", d(dense)),
            # Two chunks of one global tensor held by one rank (megatron's LocalShardsContainer).
            "big_top": ShardedTensor.from_rank_offsets("decoder.big", d(big[:2]), (0, 0, 2)),
            "big_bottom": ShardedTensor.from_rank_offsets("decoder.big", d(big[2:]), (0, 1, 2)),
            # A layer-stacked tensor (prepend_axis_num, as megatron's per-layer params).
            "stacked": ShardedTensor.from_rank_offsets("decoder.stack", d(vec), prepend_axis_num=1),
            "flag": ShardedTensor.from_rank_offsets("flag", d(torch.tensor([True, False]))),
            "extra_state": 3,
        },
        "rng_state": ShardedObject(
            "rng_state", {"seed": 1234, "torch": torch.arange(3)} if with_data else None, (1,), (0,)
        ),
        "iteration": 50,
        "args": {"lr": 0.1, "name": "gpt"},
        "checkpoint_version": 3.0,
    }


MULTI_W = torch.arange(12, dtype=torch.float32).reshape(4, 3)


def multirank_state(rank: int) -> dict:
    """Rank ``rank`` of 2: half of "w", a replica of "r" (rank 0's is the main one), its own
    ShardedObject shard, and common state that is the same on both ranks."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return {
        "w": ShardedTensor.from_rank_offsets(
            "w", MULTI_W[2 * rank : 2 * rank + 2].clone(), (0, rank, 2)
        ),
        "r": ShardedTensor.from_rank_offsets(
            "r", torch.ones(3, dtype=torch.bfloat16), replica_id=rank
        ),
        "rng": ShardedObject("rng", {"rank": rank}, (2,), (rank,)),
        "iteration": 7,
    }


def megatron_expected() -> dict:
    """What ``dist_checkpointing.load(megatron_state(False), dir)`` must return."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    def unwrap(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: unwrap(v) for k, v in x.items()}
        return x.data if isinstance(x, ShardedBase) else x

    return unwrap(megatron_state())


def init_gloo() -> None:
    import torch.distributed as dist

    store = dist.FileStore(tempfile.mktemp(prefix="asyncckpt-test-store-"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def _load(scenario: str, ckpt: str) -> None:
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    assert dc.check_is_distributed_checkpoint(ckpt)
    if scenario == "plain":
        state = plain_state()
        assert_same(dc.load(plain_template(state), ckpt), state)
        common = dc.load_common_state_dict(ckpt)
        # Same split as megatron: all-tensor subtrees vanish, empty containers stay.
        assert common["iteration"] == 50 and "model" not in common and common["empty"] == {}
        tmeta = dc.load_tensors_metadata(ckpt)
        assert tmeta["model.bf"].dtype == torch.bfloat16
        assert tmeta["layers.1"].global_shape == (2, 2)
        # load_plain_tensors: megatron's "give me every tensor as stored" path.
        assert_same(dc.load_plain_tensors(ckpt)["optimizer.state.0.exp_avg"],
                    state["optimizer"]["state"][0]["exp_avg"])  # fmt: skip
    elif scenario == "megatron":
        assert_same(dc.load(megatron_state(with_data=False), ckpt), megatron_expected())
        # Resharding on load: the two saved chunks read back as one tensor.
        whole = torch.empty(4, 3)
        got = dc.load({"w": ShardedTensor.from_rank_offsets("decoder.big", whole)}, ckpt)
        want = megatron_expected()["model"]
        assert_same(got["w"], torch.cat([want["big_top"], want["big_bottom"]]))
        meta = load_sharded_metadata(ckpt)
        assert "rng_state/shard_0_1" in meta and meta["decoder.big"].global_shape == (4, 3)
        assert dc.load_common_state_dict(ckpt)["model"] == {"extra_state": 3}
    elif scenario == "multirank":  # written by 2 ranks, read back by 1
        template = {
            "w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 3)),
            "r": ShardedTensor.from_rank_offsets("r", torch.empty(3, dtype=torch.bfloat16)),
            "rng": [ShardedObject("rng", None, (2,), (i,)) for i in range(2)],
        }
        want = {
            "w": MULTI_W,
            "r": torch.ones(3, dtype=torch.bfloat16),
            "rng": [{"rank": 0}, {"rank": 1}],
            "iteration": 7,
        }
        assert_same(dc.load(template, ckpt), want)
    else:
        raise ValueError(scenario)


def _reference_save(scenario: str, ckpt: str) -> None:
    """megatron's own ``dist_checkpointing.save`` on a CPU machine.

    Its torch_dist strategy touches CUDA only to synchronize and to broadcast a failure flag;
    both are stubbed so the real save path (planner, writer, metadata) runs unchanged.
    """
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing as dc

    state = megatron_state() if scenario == "megatron" else plain_template(plain_state())
    if scenario == "plain":  # same tensors with data, plus the plain state's common leaves
        state = _fill(state, plain_state())
    dc.save(state, ckpt)


def _fill(template: Any, state: Any) -> Any:
    if isinstance(template, dict):
        return {k: _fill(template[k], state[k]) for k in template}
    if isinstance(template, list):
        return [_fill(a, b) for a, b in zip(template, state, strict=True)]
    if hasattr(template, "data") and isinstance(state, torch.Tensor):
        template.data = state
    return template


def main(argv: list[str]) -> None:
    action, scenario, ckpt = argv
    init_gloo()
    if action == "load":
        _load(scenario, ckpt)
    elif action == "reference-save":
        os.makedirs(ckpt, exist_ok=True)
        _reference_save(scenario, ckpt)
    else:
        raise ValueError(action)
    # The point of running here: megatron read it with no asyncckpt code in the process.
    assert not any(m == "asyncckpt" or m.startswith("asyncckpt.") for m in sys.modules)
    print("OK", action, scenario)


if __name__ == "__main__":
    main(sys.argv[1:])

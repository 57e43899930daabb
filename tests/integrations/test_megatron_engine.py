"""The engine writing Megatron's layouts: ``torch_dist`` (megatron-core's loader reads it back,
bit for bit) and the legacy per-rank ``--ckpt-format torch`` files, on 1 and 2 ranks.

megatron's loads run in a fresh interpreter that never imports asyncckpt
(``megatron_helpers.py``), as a user's resume would. Tests that need megatron-core skip with the
reason where it is not installed (``pip install asyncckpt[megatron]``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import megatron_helpers as mh
import pytest
import torch
from test_formats_megatron import _assert_same_layout, _megatron, _megatron_load, _run
from test_multirank import run_ranks

from asyncckpt import Distributed, SyncCheckpointEngine
from asyncckpt.core import layout as L

STEP = 50
ITER = f"iter_{STEP:07d}"


def _committed(root: Path, step: int = STEP) -> Path:
    assert L.read_tracker(root) == step
    assert (root / L.TRACKER).read_text() == f"{step}\n"
    assert not [n for n in os.listdir(root) if L.is_leftover(n)]
    return root / f"iter_{step:07d}"


# ------------------------------------------------------------------------------ torch_dist


def test_megatron_layout_defaults_to_torch_dist_plain_state(tmp_path: Path) -> None:
    """No megatron needed to write; megatron's own loader reads it, same bytes as its save."""
    root = tmp_path / "ckpt"
    with SyncCheckpointEngine(root, layout="megatron") as engine:
        engine.save(STEP, mh.plain_state()).committed_sync(timeout=120)
    ckpt = _committed(root)
    assert {".metadata", "common.pt", "metadata.json", L.MANIFEST} <= set(os.listdir(ckpt))
    # Our own reader, in place.
    target = mh.plain_state()
    target["model"]["w"].zero_()
    assert SyncCheckpointEngine(root, layout="megatron").load_latest(target) == STEP
    mh.assert_same(target, mh.plain_state())
    if not _has_megatron():
        pytest.skip("megatron-core not installed (pip install asyncckpt[megatron])")
    _megatron_load("plain", ckpt)
    _run("reference-save", "plain", str(tmp_path / "theirs"))
    _assert_same_layout(ckpt, tmp_path / "theirs")


def test_torch_dist_with_modules_and_optimizers(tmp_path: Path) -> None:
    """A trainer's usual state ({"model": module, "optim": optimizer}) in the megatron layout."""

    def make(seed: int) -> dict:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        optim = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        return {"model": model, "optim": optim, "iteration": seed}

    root = tmp_path / "ckpt"
    saved = make(1)
    with SyncCheckpointEngine(root, layout="megatron") as engine:
        engine.save(STEP, saved).committed_sync(timeout=120)
    fresh = make(2)
    weight = fresh["model"].weight
    assert SyncCheckpointEngine(root, layout="megatron").load_latest(fresh) == STEP
    assert fresh["model"].weight is weight and torch.equal(weight, saved["model"].weight)
    mh.assert_same(fresh["optim"].state_dict(), saved["optim"].state_dict())
    assert fresh["iteration"] == 1


def test_megatron_sharded_state_dict_is_accepted_directly(tmp_path: Path) -> None:
    _megatron()
    root = tmp_path / "ckpt"
    with SyncCheckpointEngine(root, layout="megatron", format="torch_dist") as engine:
        engine.save(STEP, mh.megatron_state()).committed_sync(timeout=120)
    ckpt = _committed(root)
    _megatron_load("megatron", ckpt)
    _run("reference-save", "megatron", str(tmp_path / "theirs"))
    _assert_same_layout(ckpt, tmp_path / "theirs")


def _save_multirank(rank: int, world: int, root: str) -> None:
    with SyncCheckpointEngine(
        root, layout="megatron", distributed=Distributed(timeout=60)
    ) as engine:
        engine.save(STEP, mh.multirank_state(rank)).committed_sync(timeout=120)


def _load_multirank(rank: int, world: int, root: str) -> Any:
    """Resume through the engine with a megatron template (megatron's loader underneath)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    template = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, rank, 2)),
        "r": ShardedTensor.from_rank_offsets(
            "r", torch.zeros(3, dtype=torch.bfloat16), replica_id=rank
        ),
        "rng": ShardedObject("rng", None, (2,), (rank,)),
        "iteration": 0,
    }
    w = template["w"].data
    step = SyncCheckpointEngine(root, layout="megatron").load_latest(template)
    assert template["w"].data is w  # restored in place
    mh.assert_same(w, mh.MULTI_W[2 * rank : 2 * rank + 2])
    mh.assert_same(template["r"].data, torch.ones(3, dtype=torch.bfloat16))
    assert template["rng"].data == {"rank": rank} and template["iteration"] == 7
    return step


@pytest.mark.integration
def test_two_rank_torch_dist_save_loads_with_megatron(tmp_path: Path) -> None:
    _megatron()
    root = tmp_path / "ckpt"
    run_ranks(_save_multirank, 2, tmp_path, str(root))
    ckpt = _committed(root)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "common.pt", "metadata.json"} <= set(
        os.listdir(ckpt)
    )
    _megatron_load("multirank", ckpt)  # megatron-core, one process: 2 -> 1
    assert run_ranks(_load_multirank, 2, tmp_path, str(root)) == {0: STEP, 1: STEP}


# ------------------------------------------------------------------------------ legacy


def _legacy_state(rank: int) -> dict:
    import numpy as np

    g = torch.Generator().manual_seed(rank)
    return {
        "args": argparse.Namespace(lr=0.1, tensor_model_parallel_size=2),
        "checkpoint_version": 3.0,
        "iteration": STEP,
        "model": {"w": torch.randn(3, 2, generator=g).to(torch.bfloat16), "b": torch.arange(3)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(4, generator=g)}}},
        "rng_state": [{"random_rng_state": ("x", 1), "np_rng_state": np.random.RandomState(0)}],
        "distrib_optim": {"param_state": torch.full((6,), float(rank))},
    }


def _assert_legacy(got: dict, want: dict) -> None:
    assert got["args"] == want["args"]
    np_got = got["rng_state"][0].pop("np_rng_state")
    np_want = want["rng_state"][0].pop("np_rng_state")
    assert np_got.randint(1 << 30) == np_want.randint(1 << 30)
    mh.assert_same({k: v for k, v in got.items() if k != "args"},
                   {k: v for k, v in want.items() if k != "args"})  # fmt: skip


def test_legacy_format_single_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with SyncCheckpointEngine(root, layout="megatron", format="torch") as engine:
        engine.save(STEP, _legacy_state(0)).committed_sync(timeout=120)
    ckpt = _committed(root)
    rank_dir = ckpt / "mp_rank_00"
    assert sorted(os.listdir(rank_dir)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    # What Megatron-LM's loader does: torch.load, weights_only=False.
    model = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
    want = _legacy_state(0)
    optim = want.pop("distrib_optim")
    _assert_legacy(model, want)
    mh.assert_same(torch.load(rank_dir / "distrib_optim.pt", weights_only=False), optim)
    # And back through the engine, in place.
    target = _legacy_state(5)
    w = target["model"]["w"]
    assert SyncCheckpointEngine(root, layout="megatron", format="torch").load_latest(target) == STEP
    assert target["model"]["w"] is w
    _assert_legacy(target, _legacy_state(0))


def _save_legacy(rank: int, world: int, root: str, pp: bool) -> None:
    ranks = {"tp_rank": 0, "pp_rank": rank, "pp_size": world} if pp else {"tp_rank": rank}
    with SyncCheckpointEngine(
        root,
        layout="megatron",
        format="torch",
        distributed=Distributed(legacy_ranks=ranks, timeout=60),
    ) as engine:
        engine.save(STEP, _legacy_state(rank)).committed_sync(timeout=120)


@pytest.mark.integration
@pytest.mark.parametrize("pp", [False, True], ids=["tp2", "pp2"])
def test_legacy_format_two_ranks(tmp_path: Path, pp: bool) -> None:
    root = tmp_path / "ckpt"
    run_ranks(_save_legacy, 2, tmp_path, str(root), pp)
    ckpt = _committed(root)
    dirs = ["mp_rank_00_000", "mp_rank_00_001"] if pp else ["mp_rank_00", "mp_rank_01"]
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("mp_rank")) == dirs
    for rank, d in enumerate(dirs):
        want = _legacy_state(rank)
        optim = want.pop("distrib_optim")
        _assert_legacy(torch.load(ckpt / d / "model_optim_rng.pt", weights_only=False), want)
        mh.assert_same(torch.load(ckpt / d / "distrib_optim.pt", weights_only=False), optim)


def _has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------ the example

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_style.py"


def _torchrun(*args: str) -> str:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(EXAMPLE), *args]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p.stdout


@pytest.mark.integration
def test_example_megatron_style_writes_megatron_layout_on_two_ranks_and_resumes(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "ckpt"
    common = ["--root", str(root), "--steps", "8", "--save-every", "4"]
    out = _torchrun(*common, "--stop-at", "6")
    assert "fresh start" in out and L.read_tracker(root) == 4
    out = _torchrun(*common)
    assert "resumed from step 4" in out
    ckpt = _committed(root, 8)
    assert {"__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"} <= set(os.listdir(ckpt))
    # The resumed run ended where an uninterrupted one would (the example's update, replayed).
    w = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8) / 100
    m = torch.zeros_like(w)
    for step in range(1, 9):
        grad = w - torch.sin(torch.tensor(float(step)))
        m.mul_(0.9).add_(grad)
        w.sub_(0.05 * m)
    key = "decoder.weight" if _has_megatron() else "model.decoder.weight"
    got = {key: torch.zeros(16, 8)}
    dcp.load(got, checkpoint_id=str(ckpt), no_dist=True)  # upstream DCP, world size 1
    assert torch.equal(got[key], w)
    if _has_megatron():
        assert torch.load(ckpt / "common.pt", weights_only=True)["iteration"] == 8

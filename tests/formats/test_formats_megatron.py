"""Megatron formats: what asyncckpt writes, megatron-core's own loaders read back.

Directories are written by the formats' own code, as the engine runs it: the trainer's
``prepare`` and the worker's ``write`` (``megatron_helpers.write_dir``, one process), or the
engine itself (two ranks). Every megatron load runs in a fresh interpreter
(``megatron_helpers.py``) that has never imported asyncckpt, under a world-size-1 gloo group,
as a user's resume would.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import megatron_helpers as mh
import pytest
import torch
from test_multirank import run_ranks

from asyncckpt import Distributed, Preemption, SyncCheckpointEngine
from asyncckpt.core import layout as L
from asyncckpt.formats import megatron_legacy as legacy
from asyncckpt.formats import staged
from asyncckpt.formats import torch_dist as td

HELPERS = Path(__file__).parents[1] / "megatron_helpers.py"
ROOT = HELPERS.parent.parent


def _megatron() -> None:
    pytest.importorskip(
        "megatron.core", reason="megatron-core not installed (pip install asyncckpt[megatron])"
    )


def _run(*args: str, code: str | None = None) -> str:
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, str(HELPERS), *args]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{HELPERS.parent}",
    }
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return p.stdout


def _megatron_load(scenario: str, ckpt: Path) -> None:
    assert "OK load" in _run("load", scenario, str(ckpt))


def _metadata(ckpt: Path):
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)


def _items(ckpt: Path) -> dict[tuple, object]:
    """Every stored item, decoded, by (DCP key, chunk offset): file names do not matter.

    Decoded rather than raw bytes: the engine's worker writes torch.save records without
    torch's own zip crc32 (its manifest checksums every byte), so only that field differs.
    """
    out = {}
    for idx, info in _metadata(ckpt).storage_data.items():
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out[(idx.fqn, idx.offset)] = torch.load(
                io.BytesIO(f.read(info.length)), weights_only=False
            )
    return out


def _assert_same_layout(ours: Path, theirs: Path) -> None:
    assert (ours / "metadata.json").read_bytes() == (theirs / "metadata.json").read_bytes()
    mh.assert_same(
        torch.load(ours / "common.pt", weights_only=True),
        torch.load(theirs / "common.pt", weights_only=True),
    )
    a, b = _metadata(ours), _metadata(theirs)
    assert a.state_dict_metadata == b.state_dict_metadata
    assert a.planner_data == b.planner_data
    ours_items, theirs_items = _items(ours), _items(theirs)
    assert ours_items.keys() == theirs_items.keys()
    for key in ours_items:
        mh.assert_same(ours_items[key], theirs_items[key])


# --- torch_dist: megatron's loader reads our files ----------------------------------------


def test_metadata_json_is_megatron_s(tmp_path: Path) -> None:
    _megatron()
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    save_config(CheckpointingConfig("torch_dist", 1), str(tmp_path))
    assert json.loads((tmp_path / "metadata.json").read_text()) == td.CONFIG
    mh.write_dir({"x": torch.ones(1)}, tmp_path / "ours")
    assert (tmp_path / "ours" / "metadata.json").read_bytes() == (
        tmp_path / "metadata.json"
    ).read_bytes()


@pytest.mark.integration  # fresh interpreters importing megatron
def test_plain_state_loads_with_megatron(tmp_path: Path) -> None:
    _megatron()
    state = mh.plain_state()
    mh.write_dir(state, tmp_path / "ck")
    mh.assert_same(state, mh.plain_state())  # the input is not modified
    assert sorted(os.listdir(tmp_path / "ck")) == [
        ".metadata",
        "__0_0.distcp",
        "common.pt",
        "metadata.json",
    ]
    _megatron_load("plain", tmp_path / "ck")


@pytest.mark.integration  # fresh interpreters importing megatron
def test_megatron_sharded_state_loads_with_megatron(tmp_path: Path) -> None:
    _megatron()
    mh.write_dir(mh.megatron_state(), tmp_path / "ck")
    _megatron_load("megatron", tmp_path / "ck")


@pytest.mark.integration
@pytest.mark.parametrize("scenario", ["plain", "megatron"])
def test_same_files_as_megatron_save(tmp_path: Path, scenario: str) -> None:
    """megatron's own save (CUDA calls stubbed) and ours: same metadata, common, item bytes."""
    _megatron()
    _run("reference-save", scenario, str(tmp_path / "theirs"))
    state = mh.plain_state() if scenario == "plain" else mh.megatron_state()
    mh.write_dir(state, tmp_path / "ours")
    _assert_same_layout(tmp_path / "ours", tmp_path / "theirs")


@pytest.mark.integration  # fresh interpreters importing megatron
def test_plain_layout_without_megatron(tmp_path: Path) -> None:
    """With megatron unimportable the format imports and writes the very same files."""
    code = (
        "import sys; sys.modules['megatron'] = None\n"  # any megatron import now fails
        "import megatron_helpers as mh\n"
        "mh.write_dir(mh.plain_state(), sys.argv[1])\n"
        "assert not any(m.startswith('megatron.') for m in sys.modules)\n"
        "print('OK')\n"
    )
    assert "OK" in _run(str(tmp_path / "bare"), code=code)
    mh.write_dir(mh.plain_state(), tmp_path / "full")
    _assert_same_layout(tmp_path / "bare", tmp_path / "full")
    for name in ("common.pt", "__0_0.distcp"):
        assert (tmp_path / "bare" / name).read_bytes() == (tmp_path / "full" / name).read_bytes()
    if _has_megatron():
        _megatron_load("plain", tmp_path / "bare")


def _has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


STEP = 7


def _save_two_ranks(rank: int, world: int, mcore: str, plain: str) -> None:
    """One rank: its engine's worker writes this rank's shards, rank 0's the global files."""
    for root, state in ((mcore, mh.multirank_state(rank)), (plain, mh.plain_state())):
        with SyncCheckpointEngine(
            root, layout="megatron", format="torch_dist", distributed=Distributed(timeout=60)
        ) as engine:
            engine.save(STEP, state).committed_sync(timeout=120)


@pytest.mark.integration  # several ranks, fresh interpreters importing megatron
def test_two_rank_save_loads_with_megatron(tmp_path: Path) -> None:
    """Two ranks, two engines: their workers' side group plans the save together."""
    _megatron()
    run_ranks(_save_two_ranks, 2, tmp_path, str(tmp_path / "mcore"), str(tmp_path / "plain"))
    mcore, plain = (tmp_path / d / L.dir_name("megatron", STEP) for d in ("mcore", "plain"))
    expected = [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    sidecars = ["__0_fingerprints.json", "__1_fingerprints.json"]  # differential saves' own
    assert sorted(os.listdir(mcore)) == sorted([*expected, *sidecars, L.MANIFEST])
    # Rank 1's own chunk and object landed in rank 1's file; the replica was written once.
    files = {(i.fqn, i.offset): s.relative_path for i, s in _metadata(mcore).storage_data.items()}
    assert files == {
        ("w", torch.Size([0, 0])): "__0_0.distcp",
        ("w", torch.Size([2, 0])): "__1_0.distcp",
        ("r", torch.Size([0])): "__0_0.distcp",
        ("rng/shard_0_2", None): "__0_0.distcp",
        ("rng/shard_1_2", None): "__1_0.distcp",
    }
    _megatron_load("multirank", mcore)
    # Plain state replicated on both ranks: DCP writes each tensor once, megatron reads it.
    stored = _metadata(plain).storage_data.values()
    assert len(stored) == len(td.split_common(mh.plain_state())[0])
    on_disk = sum(f.stat().st_size for f in plain.glob(f"*{L.DCP_SHARD_SUFFIX}"))
    assert on_disk == sum(s.length for s in stored)  # no byte written twice
    _megatron_load("plain", plain)


# --- torch_dist: our own reader, split rules, bad input -----------------------------------


def test_read_torch_dist_round_trip_in_place(tmp_path: Path) -> None:
    state = mh.plain_state()
    mh.write_dir(state, tmp_path / "ck")
    target = mh.plain_state()
    for t in (target["model"]["w"], target["layers"][0]):
        t.zero_()
    target["iteration"], target["optimizer"]["param_groups"][0]["lr"] = 0, 9.0
    w = target["model"]["w"]
    assert td.read_torch_dist(tmp_path / "ck", target) is target
    assert target["model"]["w"] is w  # loaded into the caller's tensors
    mh.assert_same(target, state)


def test_split_common_plain_convention() -> None:
    t = torch.ones(2)
    sharded, common = td.split_common(
        {"a": {"b": t, "n": 1}, "l": [t, t], "e": {}, "o": {0: {"x": t}}}
    )
    assert list(sharded) == ["a.b", "l.0", "l.1", "o.0.x"]
    assert all(len(v) == 1 and v[0] is t for v in sharded.values())
    assert common == {"a": {"n": 1}, "e": {}}


@pytest.mark.parametrize(
    "state, match",
    [
        ({"l": [torch.ones(1), 3]}, "mixes tensors"),
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, "same checkpoint key"),
        ({"f": lambda: 0}, "common.pt"),
    ],
)
def test_bad_input_fails_before_writing(tmp_path: Path, state: dict, match: str) -> None:
    with SyncCheckpointEngine(
        tmp_path, layout="megatron", preemption=Preemption(handle_sigterm=False)
    ) as engine:
        with pytest.raises(Exception, match=match):
            engine.save(1, state)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("iter_") or L.is_leftover(n)]


class Opaque:
    """A class torch.load(weights_only=True) will not rebuild, megatron imported or not."""


def test_common_state_megatron_can_read_round_trips(tmp_path: Path) -> None:
    """Common leaves load with weights_only=True plus megatron-core's safe globals."""
    import argparse

    if not _has_megatron():  # megatron-core registers argparse.Namespace (Megatron-LM's args)
        pytest.skip("megatron-core not installed (pip install asyncckpt[megatron])")
    args = argparse.Namespace(lr=0.1, tensor_model_parallel_size=2)
    mh.write_dir({"w": torch.ones(2), "args": args}, tmp_path / "ok")
    target: dict = {"w": torch.zeros(2), "args": None}
    td.read_torch_dist(tmp_path / "ok", target)
    assert target["args"] == args and torch.equal(target["w"], torch.ones(2))


def test_common_state_megatron_cannot_read_is_refused() -> None:
    """Before: such a state committed, then every load of it failed as a CorruptCheckpoint."""
    with pytest.raises(TypeError, match="weights_only"):
        staged.prepare("torch_dist", {"w": torch.ones(1), "o": Opaque()})


# --- legacy per-rank format ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args, name",
    [
        ((0,), "mp_rank_00"),
        ((3, 0, 1), "mp_rank_03"),
        ((1, 2, 4), "mp_rank_01_002"),
        ((1, 2, 4, 5, 8), "mp_rank_01_002_005"),
        ((0, 0, 1, 1, 2), "mp_rank_00_001"),
    ],
)
def test_legacy_rank_dir(args: tuple, name: str) -> None:
    assert legacy.legacy_rank_dir(*args) == name


def test_legacy_files_load_with_plain_torch_load(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(3, 2).to(torch.bfloat16)}, "iteration": 50}
    state["distrib_optim"] = {"exp_avg": torch.arange(4)}
    it = tmp_path / "iter_0000050"
    files = legacy.write_legacy(state, it, tp_rank=1, pp_rank=2, pp_size=4)
    assert files == [
        it / "mp_rank_01_002/model_optim_rng.pt",
        it / "mp_rank_01_002/distrib_optim.pt",
    ]
    assert "distrib_optim" in state  # input untouched
    model = torch.load(files[0], weights_only=True)
    mh.assert_same(model, {"model": state["model"], "iteration": 50})
    mh.assert_same(torch.load(files[1], weights_only=True), state["distrib_optim"])
    mh.assert_same(legacy.read_legacy(it, 1, 2, 4), state)

    legacy.write_legacy({"iteration": 1}, tmp_path / "nopp")
    assert os.listdir(tmp_path / "nopp" / "mp_rank_00") == ["model_optim_rng.pt"]
    with pytest.raises(ValueError):
        legacy.legacy_rank_dir(0, 1, 1)

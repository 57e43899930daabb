"""Megatron formats: what asyncckpt writes, megatron-core's own loaders read back.

Every megatron load runs in a fresh interpreter (``megatron_helpers.py``) that has never
imported asyncckpt, under a world-size-1 gloo group, as a user's resume would.
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

from asyncckpt.formats import megatron_legacy as legacy
from asyncckpt.formats import torch_dist as td

HELPERS = Path(__file__).with_name("megatron_helpers.py")
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
    td.write_torch_dist({"x": torch.ones(1)}, tmp_path / "ours")
    assert (tmp_path / "ours" / "metadata.json").read_bytes() == (
        tmp_path / "metadata.json"
    ).read_bytes()


@pytest.mark.integration  # fresh interpreters importing megatron
def test_plain_state_loads_with_megatron(tmp_path: Path) -> None:
    _megatron()
    state = mh.plain_state()
    td.write_torch_dist(state, tmp_path / "ck")
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
    td.write_torch_dist(mh.megatron_state(), tmp_path / "ck")
    _megatron_load("megatron", tmp_path / "ck")


@pytest.mark.integration
@pytest.mark.parametrize("scenario", ["plain", "megatron"])
def test_same_files_as_megatron_save(tmp_path: Path, scenario: str) -> None:
    """megatron's own save (CUDA calls stubbed) and ours: same metadata, common, item bytes."""
    _megatron()
    _run("reference-save", scenario, str(tmp_path / "theirs"))
    state = mh.plain_state() if scenario == "plain" else mh.megatron_state()
    td.write_torch_dist(state, tmp_path / "ours")
    _assert_same_layout(tmp_path / "ours", tmp_path / "theirs")


@pytest.mark.integration  # fresh interpreters importing megatron
def test_plain_layout_without_megatron(tmp_path: Path) -> None:
    """With megatron unimportable the module imports and writes the very same files."""
    code = (
        "import sys; sys.modules['megatron'] = None\n"  # any megatron import now fails
        "import megatron_helpers as mh\n"
        "from asyncckpt.formats.torch_dist import write_torch_dist\n"
        "write_torch_dist(mh.plain_state(), sys.argv[1])\n"
        "assert not any(m.startswith('megatron.') for m in sys.modules)\n"
        "print('OK')\n"
    )
    assert "OK" in _run(str(tmp_path / "bare"), code=code)
    td.write_torch_dist(mh.plain_state(), tmp_path / "full")
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


_RANK_WRITER = """
import os, sys, torch.distributed as dist
rank, store, d_mcore, d_plain = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
import megatron_helpers as mh
from asyncckpt.formats.torch_dist import write_torch_dist
write_torch_dist(mh.multirank_state(rank), d_mcore, process_group=dist.group.WORLD)
write_torch_dist(mh.plain_state(), d_plain, process_group=dist.group.WORLD)
dist.destroy_process_group()
print("OK", rank, flush=True)
# gloo's store threads can abort C++ teardown at interpreter exit ("terminate called without
# an active exception") after all the work is done; skip that teardown.
os._exit(0)
"""


@pytest.mark.integration  # fresh interpreters importing megatron
def test_two_rank_save_loads_with_megatron(tmp_path: Path) -> None:
    """Two processes, one gloo group: each writes its shards, rank 0 the global files."""
    _megatron()
    mcore, plain = tmp_path / "mcore", tmp_path / "plain"
    args = [str(tmp_path / "store"), str(mcore), str(plain)]
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{HELPERS.parent}",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_WRITER, str(r), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    expected = [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "metadata.json"]
    assert sorted(os.listdir(mcore)) == expected
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
    on_disk = sum(f.stat().st_size for f in plain.glob("*.distcp"))
    assert on_disk == sum(s.length for s in stored)  # no byte written twice
    _megatron_load("plain", plain)


# --- torch_dist: our own reader, split rules, bad input -----------------------------------


def test_read_torch_dist_round_trip_in_place(tmp_path: Path) -> None:
    state = mh.plain_state()
    td.write_torch_dist(state, tmp_path / "ck")
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
    with pytest.raises(Exception, match=match):
        td.write_torch_dist(state, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_writer_factory_is_used(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    made = []

    def factory(d: str) -> FileSystemWriter:
        made.append(d)
        return FileSystemWriter(d, thread_count=2)

    td.write_torch_dist(
        {"a": torch.arange(10), "b": torch.ones(3)}, tmp_path, writer_factory=factory
    )
    assert made == [str(tmp_path)]
    target = {"a": torch.zeros(10, dtype=torch.int64), "b": torch.zeros(3)}
    mh.assert_same(
        td.read_torch_dist(tmp_path, target), {"a": torch.arange(10), "b": torch.ones(3)}
    )


class Opaque:
    """A class torch.load(weights_only=True) will not rebuild, megatron imported or not."""


def test_common_must_be_what_megatron_can_read(tmp_path: Path) -> None:
    """Common leaves must load with weights_only=True plus megatron-core's safe globals."""
    import argparse

    with pytest.raises(TypeError, match="weights_only"):
        td.write_torch_dist({"w": torch.ones(1), "o": Opaque()}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    if _has_megatron():  # megatron-core registers argparse.Namespace (Megatron-LM's args)
        args = argparse.Namespace(lr=0.1, tensor_model_parallel_size=2)
        td.write_torch_dist({"w": torch.ones(2), "args": args}, tmp_path / "ok")
        target: dict = {"w": torch.zeros(2), "args": None}
        td.read_torch_dist(tmp_path / "ok", target)
        assert target["args"] == args and torch.equal(target["w"], torch.ones(2))


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

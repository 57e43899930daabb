"""Checkpoints made of components: several formats in one step, committed together.

The spec's checks are pure (no disk); the engine tests write a step of every component format
(dcp, torch_dist, megatron_legacy, pt, a group, a tracker) and check that it is committed whole,
read back bit for bit, read in part, checked as a whole before anything is loaded, verified
file by file, and never half there after a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from statecmp import assert_same

from asyncckpt import (
    CheckpointEngine,
    Component,
    Distributed,
    KeepLast,
    StateMismatch,
    SyncCheckpointEngine,
    WorkerDied,
    faults,
    verify,
)
from asyncckpt.core import layout as L
from asyncckpt.formats.components import check_spec, expand_groups

SPEC = {
    "policy": "dcp",
    "critic": Component("torch_dist", path="critic"),
    "actor": Component(
        "megatron_legacy",
        path="actor/iter_{step:07d}",
        tracker="actor/latest_checkpointed_iteration.txt",
    ),
    "ref": {"model": Component("pt", path="ref/model.pt"), "optim": Component("pt")},
    "data": Component("pt", path="data/data.pt"),
}


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "policy": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g)},
        "critic": {"v": torch.randn(3, generator=g).to(torch.bfloat16), "iteration": step},
        "actor": {
            "model": {"w": torch.randn(2, 2, generator=g)},
            "iteration": step,
            "distrib_optim": {"m": torch.randn(5, generator=g)},
        },
        "ref": {
            "model": {"w": torch.randn(3, 3, generator=g)},
            "optim": {"state": {0: {"exp_avg": torch.randn(3, generator=g)}}},
        },
        "data": {"epoch": step // 10, "seen": torch.arange(4) * step},
    }


def blank() -> dict:
    def zero(x):
        if isinstance(x, dict):
            return {k: zero(v) for k, v in x.items()}
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        return -1 if isinstance(x, int) else x

    return zero(state_at(0))


def files_in(step_dir: Path) -> list[str]:
    return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file())


def save_steps(root: Path, steps, **kw) -> None:
    with SyncCheckpointEngine(root, components=SPEC, **kw) as engine:
        for step in steps:
            engine.save(step, state_at(step))
        engine.wait()


# ------------------------------------------------------------------------------ pure checks


def test_spec_flattens_groups_and_defaults_paths():
    spec = check_spec(SPEC)
    assert list(spec) == ["policy", "critic", "actor", "ref.model", "ref.optim", "data"]
    assert spec["ref.optim"].resolve("ref.optim", 5) == "ref/optim"
    assert spec["actor"].resolve("actor", 50) == "actor/iter_0000050"
    assert spec["actor"].resolve_tracker(50) == "actor/latest_checkpointed_iteration.txt"
    assert spec["policy"] == Component("dcp")
    per_rank = Component("pt", path="p/model_world_size_{world_size}_rank_{rank}.pt")
    assert per_rank.per_rank and per_rank.resolve("x", 1, 3, 4) == "p/model_world_size_4_rank_3.pt"
    assert not spec["data"].per_rank


def test_state_groups_open_into_members():
    spec = check_spec(SPEC)
    m = {"w": 1}
    got = expand_groups(spec, {"ref": {"model": m}, "data": 2})
    assert got == {"ref.model": m, "data": 2} and got["ref.model"] is m
    with pytest.raises(TypeError, match="'ref' must be a dict of its components"):
        expand_groups(spec, {"ref": 3})


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: {}, "non-empty dict"),
        (lambda: {"a": "safetensors"}, "unknown component format 'safetensors'"),
        (lambda: {"a": Component("dcp", path="../x")}, "plain relative path"),
        (lambda: {"a": Component("dcp", path="/abs")}, "plain relative path"),
        (lambda: {"a": Component("dcp", path=".tmp-x")}, "plain relative path"),
        (lambda: {"a": Component("dcp", path="x//y")}, "plain relative path"),
        (lambda: {"a": Component("dcp", path="iter_{stpe}")}, r"only \{step\}"),
        (
            lambda: {"a": Component("dcp", path="d_{rank}")},
            "only a pt file's path may name the rank",
        ),
        (lambda: {"a/b": "dcp"}, "without '/' or '.'"),
        (lambda: {"a.b": "dcp"}, "without '/' or '.'"),
        (lambda: {"a": "dcp", "b": Component("pt", path="a")}, "both at 'a'"),
        (lambda: {"a": "dcp", "b": Component("pt", path="a/x.pt")}, "inside component 'a'"),
        (
            lambda: {"a": Component("pt", path="t"), "b": Component("dcp", tracker="t")},
            "both at 't'",
        ),
        (lambda: {"a": 3}, "must be a Component"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(make, error):
    # A Component checks its own fields when made; check_spec the rest.
    with pytest.raises((ValueError, TypeError), match=error):
        check_spec(make())


def test_pt_files_may_share_a_plain_directory():
    spec = check_spec({"m": Component("pt", path="p/m.pt"), "o": Component("pt", path="p/o.pt")})
    assert [c.resolve(n, 1) for n, c in spec.items()] == ["p/m.pt", "p/o.pt"]


def test_format_and_components_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="format= or components="):
        CheckpointEngine(tmp_path, format="dcp", components={"a": "dcp"})


# ------------------------------------------------------------------------------ the engine


def test_a_step_of_components_round_trips_bit_for_bit(tmp_path):
    save_steps(tmp_path, [10, 20])
    step_dir = tmp_path / "global_step_20"
    on_disk = files_in(step_dir)
    assert on_disk == [
        "actor/iter_0000020/mp_rank_00/distrib_optim.pt",
        "actor/iter_0000020/mp_rank_00/model_optim_rng.pt",
        "actor/latest_checkpointed_iteration.txt",
        L.MANIFEST,
        "critic/.metadata",
        "critic/__0_0.distcp",
        "critic/__0_fingerprints.json",  # torch_dist's differential saves, as dcp's
        "critic/common.pt",
        "critic/metadata.json",
        "data/data.pt",
        "policy/.metadata",
        "policy/__0_0.distcp",
        "policy/__0_fingerprints.json",  # a dcp part's differential saves
        "ref/model.pt",
        "ref/optim",
    ]
    assert (step_dir / "actor/latest_checkpointed_iteration.txt").read_text() == "20\n"
    manifest = json.loads((step_dir / L.MANIFEST).read_text())
    assert manifest["format"] == "components"
    assert manifest["components"]["actor"]["path"] == "actor/iter_{step:07d}"
    # One manifest covers every file of every component.
    assert set(manifest["files"]) == set(on_disk) - {L.MANIFEST}
    got = blank()
    with SyncCheckpointEngine(tmp_path, components=SPEC) as engine:
        assert engine.load_latest(got) == 20
        assert engine.last_load_report.exact
    assert_same(got, state_at(20))


def test_the_parts_are_readable_without_asyncckpt(tmp_path):
    """Each part is its format's own: DCP, torch.load, Megatron's tracker."""
    import torch.distributed.checkpoint as dcp

    save_steps(tmp_path, [30])
    d = tmp_path / "global_step_30"
    policy = {"w": torch.zeros(6, 4), "b": torch.zeros(4)}
    dcp.load(policy, checkpoint_id=str(d / "policy"), no_dist=True)
    assert_same(policy, state_at(30)["policy"])
    assert_same(torch.load(d / "data/data.pt", weights_only=True), state_at(30)["data"])
    it = int((d / "actor/latest_checkpointed_iteration.txt").read_text().strip())
    legacy = torch.load(d / f"actor/iter_{it:07d}/mp_rank_00/model_optim_rng.pt")
    assert legacy["iteration"] == 30 and "distrib_optim" not in legacy


def test_a_load_may_name_some_components(tmp_path):
    save_steps(tmp_path, [10])
    want = state_at(10)
    only = {"policy": blank()["policy"], "ref": {"optim": blank()["ref"]["optim"]}}
    with SyncCheckpointEngine(tmp_path, components=SPEC) as engine:
        assert engine.load_latest(only) == 10
    assert_same(only["policy"], want["policy"])
    assert_same(only["ref"]["optim"], want["ref"]["optim"])


def test_a_save_needs_every_component_and_no_stranger(tmp_path):
    with SyncCheckpointEngine(tmp_path, components=SPEC) as engine:
        partial = state_at(1)
        del partial["critic"]
        with pytest.raises(ValueError, match=r"lacks component\(s\) \['critic'\]"):
            engine.save(1, partial)
        extra = {**state_at(1), "reward": {"w": torch.ones(1)}}
        with pytest.raises(ValueError, match=r"\['reward'\] are not components"):
            engine.save(1, extra)
        with pytest.raises(TypeError, match="component 'data'.*cannot be pickled"):
            engine.save(1, {**state_at(1), "data": {"f": lambda: 0}})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("global_step")]


def test_a_mismatch_in_one_component_changes_no_component(tmp_path):
    """Invariant 11 across parts: every component is checked before any is read."""
    save_steps(tmp_path, [10])
    target = blank()
    target["ref"]["model"]["w"] = torch.zeros(4, 4)  # saved 3x3
    with SyncCheckpointEngine(tmp_path, components=SPEC) as engine:
        with pytest.raises(StateMismatch, match=r"ref\.model\.w|w: target \(4, 4\)"):
            engine.load_latest(target)
    assert torch.equal(target["policy"]["w"], torch.zeros(6, 4))  # read first, yet untouched
    assert target["data"]["epoch"] == -1


def test_components_and_plain_checkpoints_are_not_mixed_up(tmp_path):
    save_steps(tmp_path / "c", [10])
    with (
        SyncCheckpointEngine(tmp_path / "c") as plain,
        pytest.raises(StateMismatch, match="same components="),
    ):
        plain.load_latest({"w": torch.zeros(1)})
    with SyncCheckpointEngine(tmp_path / "p") as plain:
        plain.save(5, {"policy": {"w": torch.ones(2)}})
    with SyncCheckpointEngine(tmp_path / "p", components=SPEC) as engine:
        with pytest.raises(StateMismatch, match="not as components"):
            engine.load_latest({"policy": {"w": torch.zeros(2)}})


def test_a_component_the_checkpoint_lacks_is_a_mismatch(tmp_path):
    small = {"policy": "dcp"}
    with SyncCheckpointEngine(tmp_path, components=small) as engine:
        engine.save(1, {"policy": {"w": torch.ones(2)}})
    bigger = {"policy": "dcp", "critic": "dcp"}
    with SyncCheckpointEngine(tmp_path, components=bigger) as engine:
        with pytest.raises(StateMismatch, match=r"no component\(s\) \['critic'\]"):
            engine.load_latest({"policy": {"w": torch.zeros(2)}, "critic": {"w": torch.zeros(2)}})


def test_a_format_changed_since_the_save_is_a_mismatch(tmp_path):
    with SyncCheckpointEngine(tmp_path, components={"policy": "dcp"}) as engine:
        engine.save(1, {"policy": {"w": torch.ones(2)}})
    with SyncCheckpointEngine(tmp_path, components={"policy": "torch_dist"}) as engine:
        with pytest.raises(StateMismatch, match="in format 'dcp'.*declares 'torch_dist'"):
            engine.load_latest({"policy": {"w": torch.zeros(2)}})


@pytest.mark.parametrize(
    "victim",
    ["data/data.pt", "policy/__0_0.distcp", "actor/iter_0000020/mp_rank_00/model_optim_rng.pt"],
)
def test_a_damaged_part_fails_the_step_and_the_load_falls_back(tmp_path, victim):
    save_steps(tmp_path, [10, 20])
    path = tmp_path / "global_step_20" / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    report = verify(tmp_path)
    bad = {c.step: c.problems for c in report.checkpoints if not c.ok}
    assert list(bad) == [20] and any(victim in p for p in bad[20]), bad
    got = blank()
    with SyncCheckpointEngine(tmp_path, components=SPEC) as engine:
        with pytest.warns(UserWarning, match="step 20 .* unusable"):
            assert engine.load_latest(got) == 10
    assert_same(got, state_at(10))


def test_retention_prunes_whole_steps(tmp_path):
    save_steps(tmp_path, [10, 20, 30, 40], keep=KeepLast(2))
    assert [c.step for c in L.scan(tmp_path, "global_step")] == [30, 40]
    assert (tmp_path / L.TRACKER).read_text().strip() == "40"
    assert (tmp_path / L.SKYRL_TRACKER).read_text().strip() == "40"
    assert verify(tmp_path).ok


# The two ends of the window: every part written but none committed, and everything durable
# but not renamed (test_faults kills at every point for a checkpoint of one format).
@pytest.mark.parametrize("point", ["after_shard_write", "before_rename"])
def test_a_worker_killed_mid_step_leaves_no_part_of_it(tmp_path, point):
    with SyncCheckpointEngine(tmp_path, components=SPEC) as engine:
        engine.save(10, state_at(10))
        engine.wait()
        faults.inject(point, "kill")
        handle = engine.save(20, state_at(20))
        with pytest.raises(WorkerDied):
            handle.committed_sync(timeout=120)
        assert [c.step for c in L.scan(tmp_path, "global_step")] == [10]
        assert not (tmp_path / "global_step_20").exists()
        assert (tmp_path / L.TRACKER).read_text().strip() == "10"
        got = blank()
        assert engine.load_latest(got) == 10
        assert_same(got, state_at(10))
        engine.save(20, state_at(20))  # the retry commits the whole step
        engine.wait()
    got = blank()
    with SyncCheckpointEngine(tmp_path, components=SPEC) as engine:
        assert engine.load_latest(got) == 20
    assert_same(got, state_at(20))
    assert not [n for n in os.listdir(tmp_path) if L.is_leftover(n)]


def test_cli_ls_and_verify_read_a_root_of_components(tmp_path):
    save_steps(tmp_path, [10, 20])
    for cmd in (["ls", str(tmp_path)], ["verify", str(tmp_path)]):
        p = subprocess.run(
            [sys.executable, "-m", "asyncckpt", *cmd], capture_output=True, text=True, timeout=120
        )
        assert p.returncode == 0, p.stderr
        assert "20" in p.stdout
    (tmp_path / "global_step_20" / "data" / "data.pt").write_bytes(b"garbage")
    p = subprocess.run(
        [sys.executable, "-m", "asyncckpt", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "data/data.pt" in p.stdout + p.stderr


# ------------------------------------------------------------------------------ two ranks

MULTI_SPEC = {
    "policy": "dcp",
    "shard": Component("pt", path="shards/rank_{rank}_of_{world_size}.pt"),
    "actor": Component("megatron_legacy", path="actor/iter_{step:07d}", tracker="actor/t.txt"),
    "data": Component("pt", path="data.pt"),
}


def multi_state(rank: int, world: int, step: int) -> dict:
    from test_multirank import make_state

    return {
        "policy": make_state(rank, world, step),
        "shard": {"mine": torch.full((3,), float(rank * 100 + step))},
        "actor": {"model": {"w": torch.full((2,), float(rank))}, "iteration": step},
        "data": {"seen": step * (rank + 1)},  # only rank 0's is written
    }


def save_and_load_on_ranks(rank: int, world: int, root: str) -> dict:
    from test_multirank import check_loaded, zero_like_state

    with SyncCheckpointEngine(
        root, components=MULTI_SPEC, distributed=Distributed(timeout=60)
    ) as engine:
        for step in (10, 20):
            engine.save(step, multi_state(rank, world, step)).committed_sync(timeout=120)
    target = multi_state(rank, world, 0)
    target["policy"] = zero_like_state(target["policy"])
    with SyncCheckpointEngine(
        root, components=MULTI_SPEC, distributed=Distributed(timeout=60)
    ) as engine:
        step = engine.load_latest(target)
    check_loaded(target["policy"], rank, world, 20)
    assert torch.equal(target["shard"]["mine"], torch.full((3,), float(rank * 100 + 20)))
    assert torch.equal(target["actor"]["model"]["w"], torch.full((2,), float(rank)))
    assert target["data"] == {"seen": 20}  # rank 0's, read by every rank
    return step


@pytest.mark.integration
def test_two_ranks_commit_one_step_of_components(tmp_path):
    from test_multirank import ROWS, full_weight, run_ranks

    root = tmp_path / "ckpt"
    assert run_ranks(save_and_load_on_ranks, 2, tmp_path, str(root)) == {0: 20, 1: 20}
    d = root / "global_step_20"
    files = files_in(d)
    assert files == [
        "actor/iter_0000020/mp_rank_00/model_optim_rng.pt",
        "actor/iter_0000020/mp_rank_01/model_optim_rng.pt",
        "actor/t.txt",
        L.MANIFEST,
        "data.pt",
        "policy/.metadata",
        "policy/__0_0.distcp",
        "policy/__0_fingerprints.json",  # each rank's differential-save sidecar
        "policy/__1_0.distcp",
        "policy/__1_fingerprints.json",
        "shards/rank_0_of_2.pt",
        "shards/rank_1_of_2.pt",
    ]
    manifest = json.loads((d / L.MANIFEST).read_text())
    assert set(manifest["files"]) == set(files) - {L.MANIFEST} and manifest["world_size"] == 2
    assert verify(root).ok
    # At world size 1, the policy alone: DCP reshards the DTensor into the whole tensor.
    one = {
        "policy": {
            "model": {"w": torch.zeros(ROWS, 3), "bias": torch.zeros(5, dtype=torch.bfloat16)}
        }
    }
    with SyncCheckpointEngine(root, components=MULTI_SPEC) as engine:
        assert engine.load_latest(one) == 20
    assert torch.equal(one["policy"]["model"]["w"], full_weight(20))

"""Pruning on disk: trash-rename then removal, symlinks, leftovers, refusals, dry runs."""

from __future__ import annotations

import json
import os
import sys
import types
import zlib
from pathlib import Path

import pytest

import asyncckpt
from asyncckpt.core import layout as L
from asyncckpt.retention import KeepBest, KeepLast
from asyncckpt.storage.prune import (
    PruneRefused,
    clean_leftovers,
    detect_layout,
    disk_usage,
    list_checkpoints,
    prune,
    read_checkpoint_info,
    trash_and_delete,
)


def make_ckpt(
    root: Path,
    step: int,
    layout: str = "global_step",
    metrics: dict[str, float] | None = None,
    run_id: str | None = "run-a",
    payload: bytes = b"x" * 64,
) -> Path:
    """A committed checkpoint as the engine leaves it: one shard and a manifest."""
    d = root / L.dir_name(layout, step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(payload)
    manifest = {
        "step": step,
        "committed_at": 1_700_000_000.0 + step,
        "metrics": metrics or {},
        "bytes": len(payload),
        "files": {"__0_0.distcp": {"size": len(payload), "crc32": zlib.crc32(payload)}},
        "run_id": run_id,
    }
    (d / L.MANIFEST).write_text(json.dumps(manifest))
    return d


def write_tracker(root: Path, step: int) -> None:
    (root / L.TRACKER).write_text(f"{step}\n")


def names(root: Path) -> set[str]:
    return set(os.listdir(root))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    r.mkdir()
    return r


def test_read_checkpoint_info(root):
    d = make_ckpt(root, 7, metrics={"loss": 0.5, "note": "text"}, run_id="r1")
    info = read_checkpoint_info(d, 7)
    assert (info.step, info.committed_at, info.size_bytes, info.run_id) == (
        7,
        1_700_000_007.0,
        64,
        "r1",
    )
    assert dict(info.metrics) == {"loss": 0.5}
    assert info.path == d
    # a foreign DCP directory without a manifest is described from the disk
    foreign = root / "global_step_9"
    foreign.mkdir()
    (foreign / ".metadata").write_bytes(b"m" * 10)
    info = read_checkpoint_info(foreign, 9)
    assert (info.step, info.size_bytes, dict(info.metrics), info.run_id) == (9, 10, {}, None)
    with pytest.raises(ValueError):
        read_checkpoint_info(foreign)
    assert [c.step for c in list_checkpoints(root, "global_step")] == [7, 9]


def test_trash_and_delete_does_not_follow_symlinks(root, tmp_path):
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"keep me")
    outside_file = tmp_path / "precious.txt"
    outside_file.write_text("keep me too")
    d = make_ckpt(root, 1)
    (d / "link_dir").symlink_to(outside, target_is_directory=True)
    (d / "sub").mkdir()
    (d / "sub" / "link_file").symlink_to(outside_file)
    (d / "sub" / "dangling").symlink_to(tmp_path / "nowhere")

    trash_and_delete(root, d)

    assert names(root) == set()  # no checkpoint and no trash left
    assert (outside / "data.bin").read_bytes() == b"keep me"
    assert outside_file.read_text() == "keep me too"


def test_trash_and_delete_a_checkpoint_that_is_a_symlink(root, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir()
    (real / "shard").write_bytes(b"s")
    (root / "global_step_3").symlink_to(real, target_is_directory=True)
    trash_and_delete(root, root / "global_step_3")
    assert names(root) == set()
    assert (real / "shard").read_bytes() == b"s"


@pytest.mark.parametrize(
    "target",
    [
        lambda root: root,
        lambda root: root / "..",
        lambda root: root / "global_step_1" / "__0_0.distcp",
        lambda root: root.parent,
        lambda root: root / "global_step_1" / ".." / ".." / "victim",
    ],
)
def test_trash_and_delete_refuses_anything_but_a_direct_child(root, target):
    make_ckpt(root, 1)
    (root.parent / "victim").mkdir()
    with pytest.raises(ValueError, match="refusing"):
        trash_and_delete(root, target(root))
    assert (root / "global_step_1" / "__0_0.distcp").exists()
    assert (root.parent / "victim").exists()


def test_trash_and_delete_missing(root):
    with pytest.raises(FileNotFoundError):
        trash_and_delete(root, root / "global_step_404")


def _fake_faults(monkeypatch, action):
    fake = types.ModuleType("asyncckpt.faults")
    fake.point = action
    monkeypatch.setitem(sys.modules, "asyncckpt.faults", fake)
    monkeypatch.setattr(asyncckpt, "faults", fake, raising=False)


def test_crash_mid_prune_leaves_only_trash(root, monkeypatch, tmp_path):
    """Between the rename and the removal, the checkpoint is already out of the namespace."""
    outside = tmp_path / "target"
    outside.write_text("t")
    d = make_ckpt(root, 1)
    (d / "link").symlink_to(outside)
    make_ckpt(root, 2)
    write_tracker(root, 2)
    seen = []

    def point(name):
        seen.append(name)
        assert [c.step for c in L.scan(root, "global_step")] == [2]
        raise RuntimeError("crash at mid_prune")

    _fake_faults(monkeypatch, point)
    with pytest.raises(RuntimeError, match="mid_prune"):
        prune(root, "global_step", KeepLast(1))
    assert seen == ["mid_prune"]
    leftovers = sorted(n for n in names(root) if L.is_leftover(n))
    assert len(leftovers) == 1 and leftovers[0].startswith(L.TRASH_PREFIX + "global_step_1-")
    monkeypatch.undo()
    assert clean_leftovers(root) == leftovers
    assert names(root) == {"global_step_2", L.TRACKER}
    assert outside.read_text() == "t"


def test_fault_point_absent_is_a_noop(root, monkeypatch):
    monkeypatch.setitem(sys.modules, "asyncckpt.faults", types.ModuleType("asyncckpt.faults"))
    monkeypatch.setattr(asyncckpt, "faults", sys.modules["asyncckpt.faults"], raising=False)
    trash_and_delete(root, make_ckpt(root, 1))
    assert names(root) == set()


def test_clean_leftovers(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("safe")
    make_ckpt(root, 5)
    tmp = root / L.tmp_name("global_step", 6, "abc")
    tmp.mkdir()
    (tmp / "shard").write_bytes(b"partial")
    (tmp / "escape").symlink_to(outside, target_is_directory=True)
    trash = root / L.trash_name("global_step_4", "def")
    trash.mkdir()
    (trash / "deep").mkdir()
    (trash / "deep" / "f").write_text("x")
    (root / ".tmp-tracker").write_text("4")
    (root / ".trash-link").symlink_to(outside, target_is_directory=True)

    removed = clean_leftovers(root)

    assert sorted(removed) == sorted([tmp.name, trash.name, ".tmp-tracker", ".trash-link"])
    assert names(root) == {"global_step_5"}
    assert (outside / "f").read_text() == "safe"
    assert clean_leftovers(root) == []
    assert clean_leftovers(root / "missing") == []


def test_prune_keeps_policy_and_protected(root):
    for s in range(1, 11):
        make_ckpt(root, s, metrics={"loss": abs(s - 4) + 0.1})
    write_tracker(root, 10)
    result = prune(root, "global_step", KeepLast(2) | KeepBest(1, "loss"), pinned=[6])
    assert result.deleted == [1, 2, 3, 5, 7, 8]
    assert result.kept == {
        4: ["KeepBest(1, 'loss')"],
        6: ["protected"],
        9: ["KeepLast(2)"],
        10: ["newest", "tracker", "KeepLast(2)"],
    }
    assert names(root) == {f"global_step_{s}" for s in (4, 6, 9, 10)} | {L.TRACKER}
    assert not result.errors and not result.dry_run


def test_prune_refuses_when_tracker_lags(root):
    for s in (1, 2, 3):
        make_ckpt(root, s)
    write_tracker(root, 2)  # step 3 committed but the tracker does not name it yet
    with pytest.raises(PruneRefused, match="tracker"):
        prune(root, "global_step", KeepLast(1))
    (root / L.TRACKER).unlink()
    with pytest.raises(PruneRefused):
        prune(root, "global_step", KeepLast(1))
    assert len(L.scan(root, "global_step")) == 3
    result = prune(root, "global_step", KeepLast(1), tracker_step=2, allow_tracker_lag=True)
    assert result.deleted == [1]  # the tracker's step and the newest both survive
    assert {c.step for c in L.scan(root, "global_step")} == {2, 3}


def test_prune_dry_run_deletes_nothing(root):
    for s in range(1, 6):
        make_ckpt(root, s)
    write_tracker(root, 5)
    before = names(root)
    result = prune(root, "global_step", KeepLast(1), dry_run=True)
    assert result.dry_run and result.deleted == [1, 2, 3, 4]
    assert names(root) == before


def test_prune_scope_run_and_megatron_layout(root):
    make_ckpt(root, 100, layout="megatron", run_id="old")
    make_ckpt(root, 200, layout="megatron", run_id="new")
    make_ckpt(root, 300, layout="megatron", run_id="new")
    write_tracker(root, 300)
    assert detect_layout(root) == "megatron"
    result = prune(root, "megatron", KeepLast(1), run_id="new", scope="run")
    assert result.deleted == [200]
    assert names(root) == {"iter_0000100", "iter_0000300", L.TRACKER}


def test_prune_empty_root_and_policy_none(root):
    assert prune(root, "global_step", KeepLast(1)).deleted == []
    make_ckpt(root, 1)
    make_ckpt(root, 2)
    write_tracker(root, 2)
    assert prune(root, "global_step", None).deleted == []


def test_prune_reports_failed_removal(root, monkeypatch):
    for s in (1, 2):
        make_ckpt(root, s)
    write_tracker(root, 2)

    def fail(path):
        raise PermissionError(13, "denied", str(path))

    monkeypatch.setattr("asyncckpt.storage.localfs.remove_tree", fail)
    result = prune(root, "global_step", KeepLast(1))
    assert result.deleted == [] and 1 in result.errors
    assert [c.step for c in L.scan(root, "global_step")] == [2]  # already out of the namespace
    monkeypatch.undo()
    assert len(clean_leftovers(root)) == 1


def test_detect_layout(root):
    assert detect_layout(root) == "global_step"
    assert detect_layout(root / "missing", default="megatron") == "megatron"
    make_ckpt(root, 1)
    assert detect_layout(root) == "global_step"
    make_ckpt(root, 2, layout="megatron")
    with pytest.raises(ValueError, match="several layouts"):
        detect_layout(root)


def test_disk_usage(root):
    make_ckpt(root, 1, payload=b"a" * 1000)
    make_ckpt(root, 2, payload=b"b" * 2000)
    tmp = root / L.tmp_name("global_step", 3, "t")
    tmp.mkdir()
    (tmp / "shard").write_bytes(b"c" * 500)
    usage = disk_usage(root)
    manifests = sum((root / f"global_step_{s}" / L.MANIFEST).stat().st_size for s in (1, 2))
    assert usage["committed_bytes"] == 3000 + manifests
    assert usage["leftover_bytes"] == 500
    assert usage["checkpoints"] == 2
    assert usage["total_bytes"] >= usage["free_bytes"] > 0

"""Orbax's habits (issue 25.8): which checkpoint is best, and a small user dict per checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from asyncckpt import SyncCheckpointEngine
from asyncckpt.cli import main
from asyncckpt.retention import CheckpointInfo, best_step


def state() -> dict:
    return {"w": torch.ones(4)}


def test_best_step_by_metric_min_and_max(tmp_path):
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: float("nan")}
    with SyncCheckpointEngine(tmp_path / "r") as eng:
        assert eng.best_step("loss") is None  # nothing saved yet
        for step, loss in losses.items():
            eng.save(step, state(), metrics={"loss": loss, "acc": step / 10})
        eng.save(5, state())  # no metrics: not a candidate
        eng.wait()
        assert eng.best_step("loss") == 2
        assert eng.best_step("loss", mode="min") == 2
        assert eng.best_step("acc", mode="max") == 4
        with pytest.raises(ValueError, match=r"no checkpoint .* 'los'.*\['acc', 'loss'\]"):
            eng.best_step("los")
        with pytest.raises(ValueError, match="mode"):
            eng.best_step("loss", mode="lowest")


def test_best_step_ties_go_to_the_newer_and_nan_is_never_best():
    infos = [
        CheckpointInfo(step=1, committed_at=0, metrics={"m": 0.1}),
        CheckpointInfo(step=2, committed_at=0, metrics={"m": 0.1}),
        CheckpointInfo(step=3, committed_at=0, metrics={"m": math.nan}),
    ]
    assert best_step(infos, "m") == 2
    assert best_step(infos[2:], "m") is None  # only NaN: nothing is best


def test_metadata_is_saved_listed_and_shown_by_ls(tmp_path, capsys):
    root = tmp_path / "r"
    meta = {"git": "abc123", "data": {"epoch": 3, "files": ["a", "b"]}, "note": None}
    with SyncCheckpointEngine(root) as eng:
        eng.save(1, state(), metrics={"loss": 1.0}, metadata=meta)
        meta["git"] = "changed after save"  # what was passed is what is saved
        eng.save(2, state())
        eng.wait()
        infos = eng.list_checkpoints()
    assert infos[0].metadata == {
        "git": "abc123",
        "data": {"epoch": 3, "files": ["a", "b"]},
        "note": None,
    }
    assert infos[1].metadata == {}
    assert main(["ls", "--json", str(root)]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [c["metadata"] for c in listed] == [infos[0].metadata, {}]
    assert main(["ls", str(root)]) == 0
    assert "abc123" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"t": torch.ones(1)}, "JSON"),
        ({"x": float("nan")}, "JSON"),
        ({1: "a"}, "keys must be str"),
        (["a"], "dict"),
        ({"blob": "x" * 70_000}, "KiB"),
    ],
)
def test_bad_metadata_is_refused_at_save_before_anything_is_written(tmp_path, bad, match):
    root = tmp_path / "r"
    with SyncCheckpointEngine(root) as eng:
        with pytest.raises((TypeError, ValueError), match=match):
            eng.save(1, state(), metadata=bad)
        assert eng.list_checkpoints() == []
        eng.save(1, state())  # the engine goes on

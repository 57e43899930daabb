"""Checkpoints committed by older code still load, verify, list and take part in retention.

``tests/fixtures/format_v1`` was written once by scripts/make_format_fixture.py at commit
1645e0a (before the Store redesign and the engine split) and is never regenerated: a change that
alters what is on disk, or how it is read, fails here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from format_fixture_state import fixture_state
from statecmp import assert_same

from asyncckpt import CheckpointError, KeepLast, SyncCheckpointEngine
from asyncckpt.cli import main as cli_main
from asyncckpt.formats.components import Component

FIXTURE = Path(__file__).parents[1] / "fixtures" / "format_v1"


@pytest.fixture
def old_root(tmp_path: Path) -> Path:
    # A copy: loading takes the root's lock and a later save prunes; the fixture stays as it is.
    shutil.copytree(FIXTURE, tmp_path / "old")
    return tmp_path / "old"


def _zeroed(state):
    """A target of the same structure with different values, so a load that does nothing fails."""
    import torch

    if isinstance(state, dict):
        return {k: _zeroed(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return state


def test_old_dcp_checkpoints_load_bit_for_bit(old_root: Path) -> None:
    with SyncCheckpointEngine(old_root / "dcp") as engine:
        assert [c.step for c in engine.list_checkpoints()] == [20, 30]
        assert engine.latest_step() == 30
        target = _zeroed(fixture_state(30))
        assert engine.load_latest(target) == 30
        assert_same(target, fixture_state(30))
        target = _zeroed(fixture_state(20))
        engine.load(target, 20)
        assert_same(target, fixture_state(20))
        assert engine.best_step("loss", "min") == 30


def test_old_checkpoints_verify_and_list(old_root: Path, capsys) -> None:
    assert cli_main(["verify", str(old_root / "dcp")]) == 0
    capsys.readouterr()
    assert cli_main(["ls", "--json", str(old_root / "dcp")]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in listed["checkpoints"]] == [20, 30], listed
    assert cli_main(["verify", str(old_root / "components")]) == 0


def test_new_saves_continue_an_old_root(old_root: Path) -> None:
    # The old checkpoints count for retention and the forward-step rule like new ones.
    with SyncCheckpointEngine(old_root / "dcp", keep=KeepLast(2)) as engine:
        with pytest.raises(CheckpointError, match="older than step 30, committed"):
            engine.save(25, fixture_state(25))
        engine.save(40, fixture_state(40))
    # close() waited for the commit and the prune after it.
    with SyncCheckpointEngine(old_root / "dcp") as engine:
        assert [c.step for c in engine.list_checkpoints()] == [30, 40]
    assert (old_root / "dcp" / "latest_checkpointed_iteration.txt").read_text().strip() == "40"


def test_old_components_checkpoint_loads(old_root: Path) -> None:
    components = {"policy": Component("dcp", "policy"), "data": Component("pt", "data.pt")}
    with SyncCheckpointEngine(old_root / "components", components=components) as engine:
        target = {"policy": _zeroed(fixture_state(5)["model"]), "data": {}}
        assert engine.load_latest(target) == 5
        assert_same(target["policy"], fixture_state(5)["model"])
        assert target["data"] == {"epoch": 1, "seen": 640}

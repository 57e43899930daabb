"""The goodput ledger read back: ``python -m asyncckpt stats ROOT`` (table and ``--json``) and
``TensorBoardLogger(goodput=True)``."""

from __future__ import annotations

import json

import pytest
import torch

from asyncckpt import SaveStats, SyncCheckpointEngine
from asyncckpt.cli import main
from asyncckpt.storage.goodput import Ledger, RunRecord, write_ledger


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_shows_the_ledger_of_two_runs(tmp_path, capsys):
    root = tmp_path / "r"
    state = {"w": torch.arange(256, dtype=torch.float32)}
    for step in (5, 10):  # two runs: the second resumes the first's step
        with SyncCheckpointEngine(root, keep=None) as engine:
            if step == 10:
                assert engine.load_latest(state) == 5
            engine.save(step, state).committed_sync()
    code, out, err = run(capsys, "stats", str(root))
    assert code == 0, err
    assert "goodput ledger" in out
    for col in ("productive", "save blocking", "load", "start-up", "wasted"):
        assert col in out
    assert "over 2 run(s)" in out
    code, out, err = run(capsys, "stats", str(root), "--json")
    assert code == 0, err
    g = json.loads(out)["goodput"]
    assert g["total"]["runs"] == 2
    assert [r["resumed_step"] for r in g["runs"]] == [None, 5]
    assert g["runs"][1]["load_seconds"] > 0
    assert all(r["closed"] for r in g["runs"])


def test_stats_without_a_ledger_says_nothing_of_goodput(tmp_path, capsys):
    root = tmp_path / "r"
    with SyncCheckpointEngine(root, keep=None) as engine:
        engine.save(1, {"w": torch.zeros(8)}).committed_sync()
    (root / ".asyncckpt-goodput.json").unlink()
    code, out, err = run(capsys, "stats", str(root), "--json")
    assert code == 0, err
    assert json.loads(out)["goodput"] is None
    code, out, err = run(capsys, "stats", str(root))
    assert code == 0 and "goodput ledger" not in out


def test_tensorboard_logs_the_ledger_when_asked(tmp_path):
    pytest.importorskip("tensorboard")
    from asyncckpt.tensorboard import GOODPUT_SCALARS, TensorBoardLogger

    class Writer:
        def __init__(self):
            self.calls = {}

        def add_scalar(self, tag, value, global_step=None, walltime=None):
            self.calls[tag] = (value, global_step)

        def flush(self):
            pass

    run_ = RunRecord("a", 0.0, 100.0, startup_seconds=10.0, save_blocking_seconds=5.0)
    write_ledger(tmp_path, Ledger([run_]))
    path = str(tmp_path / "global_step7")
    w = Writer()
    TensorBoardLogger(writer=w, goodput=True)(SaveStats(7, path=path))
    assert w.calls["checkpoint/goodput/goodput"] == (0.85, 7)
    assert w.calls["checkpoint/goodput/startup_seconds"] == (10.0, 7)
    assert {f"checkpoint/goodput/{n}" for n in GOODPUT_SCALARS} <= set(w.calls)
    w = Writer()
    TensorBoardLogger(writer=w)(SaveStats(7, path=path))  # by default: the save's figures only
    assert not any("goodput" in tag for tag in w.calls)

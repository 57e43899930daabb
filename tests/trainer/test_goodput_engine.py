"""The engine keeps the goodput ledger in its root across runs (trainer/ledger.py), and
``Schedule(mtbf=)`` reports the intervals in effect."""

from __future__ import annotations

import json

import torch

from asyncckpt import Schedule, SyncCheckpointEngine
from asyncckpt.storage.goodput import LEDGER_NAME, read_ledger


def state() -> dict:
    return {
        "w": torch.arange(1024, dtype=torch.float32),
        "step": torch.zeros((), dtype=torch.int64),
    }


def test_the_ledger_records_a_restarts_load_and_the_steps_it_repeats(tmp_path):
    root = tmp_path / "r"
    s = state()
    first = SyncCheckpointEngine(root, keep=None, schedule=Schedule(every_steps=5))
    with first:
        for step in range(1, 9):  # reaches step 8; step 5 is the newest checkpoint
            s["step"].fill_(step)
            if first.should_save(step):
                first.save(step, s).committed_sync()
    led = read_ledger(root)
    assert led is not None and len(led.runs) == 1
    one = led.runs[0]
    assert one.highest_step == 8 and one.saves == 1 and one.closed
    assert one.save_blocking_seconds > 0 and one.startup_seconds > 0
    assert one.resumed_step is None and one.wasted_steps == 0 and one.load_seconds == 0

    second = SyncCheckpointEngine(root, keep=None, schedule=Schedule(every_steps=5))
    with second:
        target = state()
        assert second.load_latest(target) == 5
        st = second.stats
    assert st.goodput_run is not None and st.goodput is not None
    assert st.goodput_run.resumed_step == 5 and st.goodput_run.wasted_steps == 3
    assert st.goodput_run.load_seconds > 0
    assert st.goodput.runs == 2 and st.goodput.wasted_steps == 3
    assert st.disk_every_steps == 5 and st.memory_every_steps is None
    assert not st.intervals_measured
    d = json.loads((root / LEDGER_NAME).read_text())
    assert [r["resumed_step"] for r in d["runs"]] == [None, 5]
    assert d["runs"][1]["load_seconds"] > 0 and d["runs"][1]["wasted_steps"] == 3
    assert d["total"]["runs"] == 2


def test_mtbf_starts_from_the_users_intervals_and_says_which_are_in_effect(tmp_path):
    s = state()
    engine = SyncCheckpointEngine(
        tmp_path / "r", keep=None, schedule=Schedule(every_steps=3, mtbf=3600.0)
    )
    with engine:
        assert engine.stats.disk_every_steps == 3 and not engine.stats.intervals_measured
        for step in range(1, 4):
            tier = engine.due(step)
            if tier:
                engine.save(step, s, tier=tier).committed_sync()
    assert engine.latest_step() == 3

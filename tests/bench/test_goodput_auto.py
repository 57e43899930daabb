"""``goodput.py --e2e``'s auto rows: an engine told the MTBF (``Schedule(mtbf=)``) chooses its
intervals, is killed at the same place in the interval it chose, and resumes bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_auto_rows_choose_their_intervals_and_stand_beside_the_fixed_ones(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "goodput.py"), "--e2e", "--quick"]
    cmd += ["--strategies", "disk", "--auto", "auto", "--fail-every-min", "1,2"]
    cmd += ["--dir", str(tmp_path / "s"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((out / "goodput_e2e.json").read_text())
    assert set(rep["rows"]) == {"disk", "auto M=1", "auto M=2"}
    for m in ("1", "2"):
        row = rep["rows"][f"auto M={m}"]
        assert set(row["goodput"]) == {str(float(m))}  # worth its goodput at its own M only
        assert 0 <= row["goodput"][str(float(m))] <= 1
        assert row["model_restart_s"] == pytest.approx(row["restart_s"] + row["warmup_s"])
        (run,) = rep["runs"][f"auto M={m}"]
        assert run["bit_for_bit"] and run["disk_every"] >= 1 and run["memory_every"] is None
        # Killed after the intervals were chosen from measurements, not at the fixed step.
        assert run["steps_done"] > run["measured_at"]
    verdict = rep["auto_vs_fixed"]
    assert set(verdict) == {"1.0", "2.0"}
    for v in verdict.values():
        assert v["best_auto"].startswith("auto M=") and set(v["fixed"]) == {"disk"}
        assert v["met"] == (v["best_auto_goodput"] >= v["fixed"]["disk"] - 0.005)


def _step(step: int, tier: str, disk: int, memory: int | None) -> dict:
    return dict(step=step, tier=tier, disk_every=disk, memory_every=memory, measured=True)


def test_the_kill_of_a_memory_row_whose_engine_dropped_the_memory_tier_follows_the_disk():
    """``auto+memory+hot`` is killed at its place in the memory interval the engine chose. An
    engine that finds memory saves cost what disk saves do schedules none (memory_every None):
    the kill then follows the disk saves. It waited for a memory save that never came, and
    the benchmark ran out of its 600 s."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from goodput_e2e import KillAt

    kill = KillAt("auto+memory+hot", 62, 50)  # 24% of the way to the next save
    kill.see(_step(40, "disk", 100, None))  # the first save on measured intervals
    kill.see(_step(140, "disk", 100, None))
    assert kill.measured_at == 40 and kill.target == 140 + 24
    assert not kill.due(163) and kill.due(164)
    # With the memory tier kept, the memory saves set it, as before.
    kept = KillAt("auto+memory+hot", 62, 50)
    kept.see(_step(40, "memory", 100, 10))
    kept.see(_step(100, "disk", 100, 10))  # a disk save does not set it
    kept.see(_step(110, "memory", 100, 10))
    assert kept.target == 110 + 2

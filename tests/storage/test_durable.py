"""``durable_within``: the worker escalates as the deadline nears (issue 27, item 3).

Observed through ``SaveStats`` and the ``Pacer``'s figures, never through timings.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

from asyncckpt import CheckpointEngine, SyncCheckpointEngine, ThrottleConfig
from asyncckpt.io.throttle import Pacer, RateLimiter

pytestmark = pytest.mark.anyio


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept += s
        self.now += s


def _pacer(durable_within, renice=None):
    clock = _Clock()
    limiter = RateLimiter(1000.0, burst_bytes=100, clock=clock, sleep=clock.sleep)
    pacer = Pacer(
        limiter,
        None,
        2.0,
        clock=clock,
        sleep=clock.sleep,
        durable_within=durable_within,
        renice=renice,
        wall_clock=lambda: 1000.0,
    )
    return pacer, clock


def test_pacer_far_from_the_deadline_stays_throttled():
    pacer, clock = _pacer(durable_within=600.0)
    pacer.begin(saved_at=1000.0)  # just called: escalation is 300 s away
    pacer(1100)
    pacer.end()
    assert clock.slept == pytest.approx(1.0)  # (1100 - 100 burst) / 1000 B/s
    f = pacer.figures()
    assert f["escalated_after_seconds"] is None and f["escalations"] == []
    assert f["throttled_seconds"] == pytest.approx(1.0)


def test_pacer_past_half_the_deadline_writes_at_full_speed_and_says_so():
    calls = []

    def renice(up):
        calls.append(up)
        return ["nice"]

    pacer, clock = _pacer(durable_within=10.0, renice=renice)
    pacer.begin(saved_at=1000.0 - 6.0)  # 6 s of a 10 s budget gone
    pacer(1100)
    assert clock.slept == 0.0
    f = pacer.figures()
    assert f["escalated_after_seconds"] == pytest.approx(6.0)
    assert f["escalations"] == ["write_rate", "nice"]
    assert f["throttled_seconds"] == 0.0
    assert calls == [True]
    # The next save starts throttled again (and the worker is reniced back first).
    pacer.begin(saved_at=1000.0)
    pacer(1100)
    assert calls == [True, False]
    assert clock.slept > 0 and pacer.figures()["escalated_after_seconds"] is None


def test_pacer_without_a_deadline_never_escalates():
    pacer, clock = _pacer(durable_within=None)
    pacer.begin(saved_at=0.0)  # long ago, but there is no deadline
    pacer(1100)
    assert clock.slept > 0 and pacer.figures()["escalations"] == []


@pytest.mark.parametrize("bad", [0, -1.0, "5", True, float("inf")])
def test_durable_within_refuses_what_is_not_a_positive_number(tmp_path, bad):
    with pytest.raises(ValueError, match="durable_within"):
        ThrottleConfig.background(durable_within=bad)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="durable_within"):
        CheckpointEngine(tmp_path, durable_within=bad)  # the flat keyword of before
    with pytest.raises(ValueError, match="durable_within"):
        ThrottleConfig(durable_within=bad)


RATE = ThrottleConfig(write_rate_bytes_per_s=8 << 20, io_threads=1, max_pause_seconds=0.0)


def _state() -> dict:
    return {"w": torch.randn(1 << 20)}  # 4 MiB: at 8 MiB/s, ~0.5 s held by the cap


def test_stats_report_time_to_durable_and_throttling_without_a_deadline(tmp_path):
    with SyncCheckpointEngine(tmp_path, throttle=RATE) as engine:
        stats = engine.save(1, _state()).committed_sync()
    assert stats.saved_at is not None and stats.durable_seconds is not None
    assert stats.durable_seconds > 0
    assert stats.throttled_seconds > 0  # the rate cap held it
    assert stats.escalated_after_seconds is None and stats.escalations == []


def test_a_deadline_lifts_the_rate_cap(tmp_path):
    # A deadline already half gone when the worker starts the save: it escalates at once.
    deadline = dataclasses.replace(RATE, durable_within=1e-6)
    with SyncCheckpointEngine(tmp_path, throttle=deadline) as engine:
        stats = engine.save(1, _state()).committed_sync()
    assert stats.escalated_after_seconds is not None
    assert "write_rate" in stats.escalations
    assert stats.throttled_seconds == 0.0
    assert stats.durable_seconds > 0


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="lowering niceness needs root"
)
async def test_a_deadline_renices_the_default_worker(tmp_path, anyio_backend):
    throttle = ThrottleConfig.background(durable_within=1e-6)
    async with CheckpointEngine(tmp_path, throttle=throttle) as engine:
        h = await engine.save(1, _state())
        stats = await h.committed()
    assert "nice" in stats.escalations  # the default throttle: nice 19, back to the base


def test_the_default_keeps_the_worker_gentle(tmp_path):
    # No deadline: the default throttle stays on for the whole save.
    with SyncCheckpointEngine(tmp_path) as engine:
        t0 = time.time()
        stats = engine.save(1, _state()).committed_sync()
    assert stats.saved_at >= t0
    assert stats.escalations == [] and stats.escalated_after_seconds is None


def test_durable_benchmark_runs_quick(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "durable.json"
    r = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "durable.py"), "--quick", "--out", str(out),
         "--modes", "default,deadline"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())["results"]
    assert set(rep) == {"default", "deadline"}
    assert rep["default"]["stats"]["escalations"] == []

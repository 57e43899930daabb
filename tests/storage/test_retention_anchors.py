"""Retention semantics users know from the anchors (issue 14): Orbax's ``keep_time_interval`` and
non-exact ``EveryNSteps``, Lightning's tie-break in ``ModelCheckpoint`` and its protection of the
checkpoint a run resumed from; plus the README's retention snippet."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncckpt.options import Retention
from asyncckpt.retention import CheckpointInfo, KeepBest, KeepEvery, KeepInterval, plan_prune


def ck(step: int, t: float = 0.0, **metrics: float) -> CheckpointInfo:
    return CheckpointInfo(step=step, committed_at=t, metrics=metrics)


def orbax_every_n_seconds(times: list[float], interval: float) -> list[bool]:
    """Orbax's ``EveryNSeconds.should_preserve`` (preservation_policy.py), on bare times in
    walking order: the first is preserved, then each at least ``interval`` after the last one
    preserved."""
    out, last = [], None
    for t in times:
        keep = last is None or t - last >= interval
        out.append(keep)
        last = t if keep else last
    return out


# -- KeepInterval: time since the last kept one (Orbax keep_time_interval) ----------------------


def test_keep_interval_counts_from_the_last_kept_checkpoint_not_fixed_windows():
    # Saves every 40 s with a 100 s interval. Epoch windows [0,100),[100,200),... kept the first
    # of each window (0, 120, 200, 320, 400: 200 only 80 s after 120); Orbax keeps 0, 120, 240,
    # 360 (each at least 100 s after the last kept).
    cps = [ck(i + 1, t=40.0 * i) for i in range(11)]  # t = 0, 40, ..., 400
    assert KeepInterval(100).keep(cps) == {1, 4, 7, 10}
    assert orbax_every_n_seconds([c.committed_at for c in cps], 100) == [
        c.step in {1, 4, 7, 10} for c in cps
    ]


def test_keep_interval_exactly_the_interval_is_enough_and_order_is_by_commit_time():
    assert KeepInterval(10).keep([ck(1, t=5), ck(2, t=15), ck(3, t=24.9)]) == {1, 2}
    # An older step committed later (allow_older_steps) is walked in commit order.
    assert KeepInterval(10).keep([ck(5, t=0), ck(3, t=12), ck(7, t=14)]) == {5, 3}


@given(
    st.lists(st.floats(0, 10_000, allow_nan=False), min_size=0, max_size=25, unique=True),
    st.floats(0.5, 3000),
)
def test_keep_interval_matches_orbax_and_is_stable(times, interval):
    cps = [ck(i + 1, t=t) for i, t in enumerate(times)]
    ordered = sorted(cps, key=lambda c: (c.committed_at, c.step))
    flags = orbax_every_n_seconds([c.committed_at for c in ordered], interval)
    expect = {c.step for c, k in zip(ordered, flags, strict=True) if k}
    kept = KeepInterval(interval).keep(cps)
    assert kept == expect
    # Deleting what it does not keep never changes its answer.
    assert KeepInterval(interval).keep([c for c in cps if c.step in kept]) == kept


# -- KeepEvery(exact=False): Orbax's non-exact EveryNSteps ---------------------------------------


def test_keep_every_non_exact_for_irregular_saves():
    cps = [ck(s) for s in (95, 203, 298, 405)]
    assert KeepEvery(100).keep(cps) == set()  # no step is a multiple of 100
    # First kept, then each at least 100 steps after the last kept: 203 - 95 = 108,
    # 298 - 203 = 95 (no), 405 - 203 = 202.
    assert KeepEvery(100, exact=False).keep(cps) == {95, 203, 405}
    # Spaced from the last kept one, not aligned to multiples of 100 (Orbax's behaviour too).
    drift = [ck(s) for s in (0, 150, 260, 300, 410)]
    assert KeepEvery(100, exact=False).keep(drift) == {0, 150, 260, 410}
    assert KeepEvery(100, exact=False).keep([ck(s) for s in (100, 200, 300)]) == {100, 200, 300}
    assert repr(KeepEvery(100, exact=False)) == "KeepEvery(100, exact=False)"
    assert repr(KeepEvery(100)) == "KeepEvery(100)"
    with pytest.raises(TypeError, match="exact"):
        KeepEvery(100, exact="no")  # type: ignore[arg-type]


@given(st.sets(st.integers(0, 2000), max_size=30), st.integers(1, 300))
def test_keep_every_non_exact_spacing_and_stability(steps, n):
    cps = [ck(s) for s in steps]
    kept = sorted(KeepEvery(n, exact=False).keep(cps))
    if steps:
        assert kept[0] == min(steps)
    assert all(b - a >= n for a, b in zip(kept, kept[1:], strict=False))
    # every skipped step is within n of the last kept one before it
    for s in steps - set(kept):
        assert s - max(k for k in kept if k < s) < n
    assert sorted(KeepEvery(n, exact=False).keep([ck(s) for s in kept])) == kept


# -- KeepBest ties -------------------------------------------------------------------------------


def test_keep_best_ties_are_selectable():
    cps = [ck(1, loss=0.5), ck(5, loss=0.7), ck(9, loss=0.5), ck(12, loss=0.5)]
    assert KeepBest(1, "loss").keep(cps) == {12}  # newer wins (default, Orbax's BestN)
    assert KeepBest(1, "loss", ties="newer").keep(cps) == {12}
    assert KeepBest(1, "loss", ties="older").keep(cps) == {1}  # Lightning's ModelCheckpoint
    assert KeepBest(2, "loss", ties="older").keep(cps) == {1, 9}
    # mode="max" and NaN ties too
    nan = float("nan")
    assert KeepBest(1, "acc", mode="max", ties="older").keep([ck(3, acc=0.9), ck(4, acc=0.9)]) == {
        3
    }
    assert KeepBest(1, "loss", ties="older").keep([ck(3, loss=nan), ck(4, loss=nan)]) == {3}
    assert repr(KeepBest(1, "loss", ties="older")) == "KeepBest(1, 'loss', ties='older')"
    with pytest.raises(ValueError, match="ties"):
        KeepBest(1, "loss", ties="first")


def test_plan_prune_with_the_new_options():
    cps = [ck(s, t=10.0 * s, loss=1.0) for s in (95, 203, 298, 405, 512)]
    plan = plan_prune(cps, KeepEvery(100, exact=False) | KeepBest(1, "loss", ties="older"))
    assert plan.delete == [298]
    assert plan.keep[95] == ["KeepEvery(100, exact=False)", "KeepBest(1, 'loss', ties='older')"]


# -- keep_resumed ---------------------------------------------------------------------------------


def _steps(root: Path) -> list[int]:
    from asyncckpt.core import layout as L

    return sorted(s for n in os.listdir(root) if (s := L.parse_dir_name("global_step", n)))


@pytest.mark.anyio
@pytest.mark.parametrize("keep_resumed", ["until_newer", "run"])
async def test_keep_resumed_run_keeps_the_resumed_from_checkpoint_all_run(tmp_path, keep_resumed):
    import torch

    from asyncckpt import CheckpointEngine, KeepLast

    async with CheckpointEngine(tmp_path) as engine:
        await engine.save(5, {"w": torch.full((2,), 5.0)})
    engine = CheckpointEngine(
        tmp_path, keep=KeepLast(1), retention=Retention(keep_resumed=keep_resumed)
    )
    t = {"w": torch.zeros(2)}
    assert await engine.load_latest(t) == 5
    async with engine:
        for s in (6, 7, 8):
            await (await engine.save(s, t)).committed()
        await engine.wait()
        expected = [5, 8] if keep_resumed == "run" else [8]
        deadline = time.monotonic() + 10
        while _steps(tmp_path) != expected:  # pruning runs after the commit, in the worker
            assert time.monotonic() < deadline, (_steps(tmp_path), expected)
            time.sleep(0.05)


def test_keep_resumed_rejects_unknown_values(tmp_path):
    from asyncckpt import CheckpointEngine

    with pytest.raises(ValueError, match="keep_resumed"):
        CheckpointEngine(tmp_path, retention=Retention(keep_resumed="forever"))


# -- prune's flags for the new options -----------------------------------------------------------


def _fake_root(root: Path, losses: dict[int, float]) -> Path:
    import json
    import zlib

    from asyncckpt.core import layout as L

    for step, loss in losses.items():
        d = root / L.dir_name("global_step", step)
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x" * 64)
        manifest = {
            "step": step,
            "committed_at": 1_700_000_000.0 + step,
            "metrics": {"loss": loss},
            "bytes": 64,
            "files": {"__0_0.distcp": {"size": 64, "crc32": zlib.crc32(b"x" * 64)}},
            "run_id": "run-a",
        }
        (d / L.MANIFEST).write_text(json.dumps(manifest))
    (root / L.TRACKER).write_text(f"{max(losses)}\n")
    return root


def test_prune_cli_not_exact_and_ties(tmp_path, capsys):
    import json

    from asyncckpt.cli import main

    root = _fake_root(tmp_path / "r", {95: 1.0, 203: 2.0, 298: 0.5, 350: 0.5, 405: 3.0, 512: 4.0})
    argv = ["prune", str(root), "--keep-every", "100", "--not-exact", "--keep-best", "1"]
    argv += ["--metric", "loss", "--ties", "older", "--json", "--dry-run"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    # KeepEvery(100, exact=False): 95, 203, 350 (147 after 203), 512 (162 after 350); 298 and
    # 350 tie on loss, the older (298) wins.
    assert data["deleted"] == [405]
    assert data["kept"]["298"] == ["KeepBest(1, 'loss', ties='older')"]
    assert data["kept"]["350"] == ["KeepEvery(100, exact=False)"]
    for bad in (["--not-exact", "--keep-last", "1"], ["--ties", "older", "--keep-last", "1"]):
        assert main(["prune", str(root), *bad]) == 2
        assert "only used with" in capsys.readouterr().err

"""The benchmarks' targets table reads as a person reads it (issue 25.11): rounded numbers,
yes/no, and a --quick run says that its verdicts mean nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TARGETS = {
    "stall_vs_copy": {"target": "<= 1.25x", "measured": 1.7345678912, "met": False},
    "dcp": {"target": "<= 1x", "measured": [0.81234567, 0.7712345, 0.2612345], "met": True},
    "arenas": {"target": "same", "measured": {"reused": True, "pinned": False}, "met": False},
}


def test_targets_are_rounded_and_say_yes_or_no(capsys):
    common().print_targets(TARGETS, quick=False)
    out = capsys.readouterr().out
    assert "1.73" in out and "1.7345678912" not in out
    assert "0.812, 0.771, 0.261" in out and "0.81234567" not in out
    assert "reused=yes, pinned=no" in out
    assert "False" not in out and "True" not in out
    assert "--quick" not in out


def test_a_quick_run_says_its_verdicts_are_not_judged(capsys):
    common().print_targets(TARGETS, quick=True)
    out = capsys.readouterr().out
    assert "not judged" in out and "a 'no' here is expected" in out


def restore():
    sys.path.insert(0, str(BENCH))  # restore.py imports common as a sibling
    spec = importlib.util.spec_from_file_location("bench_restore", BENCH / "restore.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_hot_resume_target_is_taken_against_the_median_cold_load_not_one_rounds():
    # Two rounds each; the first hot round's own dcp.load was a fast one (0.5 s), so its
    # per-round ratio is 0.6x though the hot resume took what the other did.
    seconds = {"hot": [0.30, 0.30], "disk": [1.0, 1.1], "dcp.load": [0.5, 1.2, 1.2, 1.3]}
    ratios = {"hot": [0.6, 0.25], "disk": [1.0 / 1.2, 1.1 / 1.3]}
    runs = [{"bit_for_bit": True}] * 4
    got = restore().resume_figures(seconds, ratios, runs)
    assert got["hot_vs_median_dcp_load"] == 0.30 / 1.2
    assert got["disk_vs_median_dcp_load"] == 1.05 / 1.2
    assert got["hot_vs_cold_dcp_load"]["median"] == (0.6 + 0.25) / 2  # kept beside it
    assert got["bit_for_bit"] is True
    assert restore().resume_figures(seconds, ratios, [])["bit_for_bit"] is False  # no round ran

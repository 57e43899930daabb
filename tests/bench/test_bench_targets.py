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

"""The GPU suite's dry run (CPU, tiny sizes): the one command a session lent a GPU runs
(benchmarks/gpu_suite.sh) runs every step here and reports each, so it is not first tried
on the GPU's scarce minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["setup", "env", "tests", "overhead", "training_loop"]

# It runs two benchmarks: alone, after the parallel run (see tests/test_benchmarks.py).
pytestmark = pytest.mark.serial


def test_gpu_suite_dry_run(tmp_path):
    res = tmp_path / "res"
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run"]
    cmd += ["--out", str(res), "--scratch", str(tmp_path / "scratch")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out

    # Few files, all in the one folder (the device tool brings back at most 8).
    names = {p.name for p in res.iterdir()}
    assert names == {
        "suite.log",
        "steps.tsv",
        "env.txt",
        "junit_cuda.xml",
        "overhead.json",
        "training_loop.json",
        "summary.md",
    }, names

    steps = [line.split("\t") for line in (res / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == STEPS
    assert all(s[1] == "ok" for s in steps), steps
    summary = (res / "summary.md").read_text()
    for name in STEPS:
        assert f"| {name} | ok |" in summary, name
    assert "Result: every required step ok" in summary

    # Every CUDA test is listed, and on this CPU each skip says why.
    cases = list(ET.parse(res / "junit_cuda.xml").getroot().iter("testcase"))
    assert len(cases) >= 8
    for tc in cases:
        sk = tc.find("skipped")
        assert sk is not None and sk.get("message"), tc.get("name")
        assert f"| tests.test_cuda::{tc.get('name')} | skipped |" in summary
        assert sk.get("message").split(": ", 1)[-1] in summary

    over = json.loads((res / "overhead.json").read_text())
    assert over["environment"]["device"] == "cpu"
    assert 0 < over["state_bytes"] <= 80 << 20  # the dry run's 64 MiB, not 8 GiB
    a = over["methods"]["asyncckpt"]
    assert a["stall_seconds"]["n"] == 2 and a["stall_seconds"]["median"] > 0
    assert a["arenas"]["reused"] is True
    assert over["targets"]["pinned_arenas_registered_once"]["met"] is True
    assert "stall_vs_fastest_dcp_async" in over["targets"]

    loop = json.loads((res / "training_loop.json").read_text())
    assert set(loop["methods"]) == {"none", "asyncckpt", "none:again"}
    assert loop["methods"]["asyncckpt"]["saves"] == 2
    assert "overhead_pct" in loop["targets"]["asyncckpt"]
    # The scratch checkpoints are gone.
    assert not list((tmp_path / "scratch").rglob("*.distcp"))

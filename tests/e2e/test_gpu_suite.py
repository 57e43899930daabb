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

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["setup", "env", "tests", "overhead", "training_loop", "restore", "differential"]

# It runs two benchmarks: alone, after the parallel run (see tests/bench/test_benchmarks.py).
pytestmark = pytest.mark.serial


def test_gpu_suite_dry_run(tmp_path):
    res = tmp_path / "res"
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    env.pop("OUT", None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--dry-run"]
    cmd += ["--out", str(res), "--scratch", str(tmp_path / "scratch")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    out = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out

    # Few files, all in the one folder (the device tool brings back at most 8).
    names = {p.name for p in res.iterdir()}
    assert names == {
        "suite.log",
        "steps.tsv",
        "junit_cuda.xml",
        "overhead.json",
        "training_loop.json",
        "restore.json",
        "differential.json",
        "summary.md",
    }, names

    steps = [line.split("\t") for line in (res / "steps.tsv").read_text().splitlines()]
    assert [s[0] for s in steps] == STEPS
    assert all(s[1] == "ok" for s in steps), steps
    summary = (res / "summary.md").read_text()
    for name in STEPS:
        assert f"| {name} | ok |" in summary, name
    assert "Result: every required step ok" in summary
    assert "## Machine" in summary and "cuda available False" in summary  # the probe, kept
    # The new benchmarks are not required (a miss is a finding) and are reported.
    assert [s[4] for s in steps] == ["yes"] * 5 + ["no"] * 2

    # Every CUDA test is listed, and on this CPU each skip says why.
    cases = list(ET.parse(res / "junit_cuda.xml").getroot().iter("testcase"))
    assert len(cases) >= 8
    for tc in cases:
        sk = tc.find("skipped")
        assert sk is not None and sk.get("message"), tc.get("name")
        assert f"| tests.e2e.test_cuda::{tc.get('name')} | skipped |" in summary
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
    rest = json.loads((res / "restore.json").read_text())
    assert rest["device"] == "cpu" and rest["bytes"] <= 20 << 20
    assert rest["resume"]["bit_for_bit"] is True  # the hot and disk resume rounds ran
    assert {r["name"] for r in rest["resume"]["runs"]} == {"hot", "disk"}
    assert "- cold: load_latest" in summary and "- warm: load_latest" in summary
    assert "resume in a new process after SIGKILL: hot" in summary
    diff = json.loads((res / "differential.json").read_text())
    assert set(diff["states"]) == {"rl", "lora"}
    assert "rl: a save added / state" in summary and "lora: stall vs full copy" in summary

    # The scratch checkpoints are gone.
    assert not list((tmp_path / "scratch").rglob("*.distcp"))


def test_overhead_dcp_methods_survive_a_stager_that_stages_once(tmp_path, monkeypatch):
    """torch 2.11 (the GPU image's) closes a DefaultStager's state-dict stager after each stage,
    so a reused stager's second save failed (``KeyError: <class 'type'>``, seen in the dry run
    under 2.11): the overhead step would have failed on the GPU. Here 2.11's behaviour is
    imposed on whatever torch runs: the benchmark says it made a new stager per save."""
    import argparse

    from torch.distributed.checkpoint.staging import DefaultStager

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import common as C
    import overhead

    real = DefaultStager._stage

    def stage_then_close(self, state_dict, **kw):  # as torch 2.11's DefaultStager._stage
        out = real(self, state_dict, **kw)
        self._state_dict_stager.close()
        return out

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    state = C.make_state(1 << 20)
    ref = C.CopyReference(C.state_tensors(state))
    args = argparse.Namespace(device="cpu", paired_raw=False)
    try:
        out = overhead.run_dcp_async("thread", "reused", state, tmp_path / "r", 3, ref, args)
    finally:
        ref.close()
    assert len(out["stalls"]) == 3 and out["stager_reused"] is False
    assert overhead.stager_stages_twice() is False


def test_a_part_that_does_not_exist_is_refused_before_anything_runs(tmp_path):
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "--part", "3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--part must be 1, 2 or all, got 3" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("part", "shown", "absent"),
    [
        ("1", ["## CUDA tests", "## overhead"], ["## training_loop", "## restore"]),
        ("2", ["## training_loop", "## restore", "## differential"], ["## CUDA tests"]),
    ],
)
def test_a_parts_summary_reports_only_its_own_steps(tmp_path, part, shown, absent):
    """Each part of the suite is one device call with its own results: the summary must not
    call the other part's steps missing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_summary
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    names = ["setup", "env"] + list(gpu_summary.PARTS[part])
    (tmp_path / "steps.tsv").write_text(
        "".join(f"{n}\tok\t0\t1\t{'yes' if n in STEPS[:5] else 'no'}\t\n" for n in names)
    )
    assert gpu_summary.main(tmp_path, part=part) == 0
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith(f"# GPU suite, part {part}")
    for heading in shown:
        assert heading in text, heading
    for heading in absent:
        assert heading not in text, heading

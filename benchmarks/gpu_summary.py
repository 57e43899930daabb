"""summary.md for benchmarks/gpu_suite.sh: every step with its status, every test with its
outcome (a skip with its reason), and the benchmarks' targets, from the files in one folder.

    python benchmarks/gpu_summary.py RESULTS_DIR

Reads ``steps.tsv`` (one line per step: name, status, exit code, seconds, note), the pytest
junit XML, ``overhead.json`` and ``training_loop.json``; writes ``summary.md`` and prints it.
Exits 1 if a required step did not pass (the suite's exit code).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def read_steps(path: Path) -> list[dict[str, str]]:
    steps = []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                name, status, rc, secs, required, note = (line.split("\t") + [""] * 6)[:6]
                steps.append(
                    {
                        "name": name,
                        "status": status,
                        "rc": rc,
                        "seconds": secs,
                        "required": required,
                        "note": note,
                    }  # fmt: skip
                )
    return steps


def read_junit(path: Path) -> list[dict[str, str]]:
    """Each test case: outcome (passed, failed, error, skipped) and the message."""
    if not path.exists():
        return []
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                msg = (el.get("message") or el.text or "").strip().splitlines()
                msg = msg[0] if msg else ""
                break
        cases.append({"test": name, "outcome": outcome, "message": msg, "time": tc.get("time")})
    return cases


def fmt(x: Any) -> str:
    if isinstance(x, float):
        return "nan" if x != x else f"{x:.3g}"
    if isinstance(x, list):
        return ", ".join(fmt(v) for v in x)
    if isinstance(x, dict):
        return ", ".join(f"{k}={fmt(v)}" for k, v in x.items())
    return str(x)


def targets_rows(rep: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, t in rep.get("targets", {}).items():
        if "target" in t:
            rows.append((name, t["target"], fmt(t["measured"]), "yes" if t["met"] else "NOT MET"))
        else:  # training_loop: per method
            for k, v in t.items():
                rows.append(
                    (
                        f"{name} {k}",
                        v["target"],
                        fmt(v["measured"]),
                        "yes" if v["met"] else "NOT MET",
                    )
                )
    return rows


def main(out: Path) -> int:
    lines = ["# GPU suite", ""]
    env = out / "env.txt"
    steps = read_steps(out / "steps.tsv")
    lines += ["## Steps", "", "| step | status | exit code | seconds | required | note |"]
    lines += ["|---|---|---:|---:|---|---|"]
    for s in steps:
        lines.append(
            f"| {s['name']} | {s['status']} | {s['rc']} | {s['seconds']} | {s['required']} "
            f"| {s['note']} |"
        )
    failed_required = [s["name"] for s in steps if s["required"] == "yes" and s["status"] != "ok"]
    lines.append("")
    lines.append(
        "Result: **FAILED** (required steps not ok: " + ", ".join(failed_required) + ")"
        if failed_required
        else "Result: every required step ok"
    )
    if env.exists():
        lines += ["", "## Machine", "", "```", env.read_text().strip(), "```"]
    cases = read_junit(out / "junit_cuda.xml")
    lines += ["", "## CUDA tests (tests/test_cuda.py)", ""]
    if cases:
        counts: dict[str, int] = {}
        for c in cases:
            counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
        lines.append(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        lines += ["", "| test | outcome | seconds | reason / message |", "|---|---|---:|---|"]
        for c in cases:
            lines.append(f"| {c['test']} | {c['outcome']} | {c['time']} | {c['message']} |")
    else:
        lines.append("no junit XML: the test step did not run or crashed (see suite.log)")
    for name in ("overhead", "training_loop"):
        path = out / f"{name}.json"
        lines += ["", f"## {name}", ""]
        if not path.exists():
            lines.append(f"no {path.name}: the step did not finish (see suite.log)")
            continue
        rep = json.loads(path.read_text())
        e = rep.get("environment", {})
        lines.append(
            f"device {e.get('device')} ({e.get('gpu', 'no GPU')}), state "
            f"{rep.get('state_bytes', 0) / 2**30:.2f} GiB, torch {e.get('torch')}, "
            f"asyncckpt {e.get('git_commit', '?')[:10]}"
        )
        if name == "overhead":
            for m, x in rep.get("methods", {}).items():
                lines.append(
                    f"- {m}: stall median {fmt(x['stall_seconds']['median'])} s, first "
                    f"{fmt(x['stall_first_seconds'])} s, commit median "
                    f"{fmt(x['commit_seconds']['median'])} s"
                    + (f", prepare {fmt(x['prepare_seconds'])} s" if "prepare_seconds" in x else "")
                )
        else:
            for m, x in rep.get("methods", {}).items():
                lines.append(
                    f"- {m}: mean step {fmt(x['mean_step_seconds'] * 1e3)} ms, overhead "
                    f"{fmt(x['overhead_pct'])}%, during a write {fmt(x['during_write_slowdown_pct'])}%"
                    f" ({x['steps_during_write']} steps)"
                )
        lines += ["", "| target | goal | measured | met |", "|---|---|---|---|"]
        for row in targets_rows(rep):
            lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 1 if failed_required or not steps else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python benchmarks/gpu_summary.py RESULTS_DIR")
    sys.exit(main(Path(sys.argv[1])))

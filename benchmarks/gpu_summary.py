"""summary.md for benchmarks/gpu_suite.sh: every step with its status, every test with its
outcome (a skip with its reason), and the benchmarks' targets, from the files in one folder.

    python benchmarks/gpu_summary.py RESULTS_DIR [--env ENV_TXT]

Reads ``steps.tsv`` (one line per step: name, status, exit code, seconds, required, note), the
pytest junit XML, ``overhead.json``, ``training_loop.json``, ``restore.json`` and
``differential.json``, and the machine's probe (``--env``, else ``RESULTS_DIR/env.txt``);
writes ``summary.md`` and prints it. Every target missed says ``NOT MET``. Exits 1 if a
required step did not pass (the suite's exit code); a step with required=no that failed is a
finding listed as such, not a failure.
"""

from __future__ import annotations

import argparse
import json
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
            rows.append((name, t["target"], fmt(t["measured"]), met(t["met"])))
        else:  # training_loop: per method
            for k, v in t.items():
                rows.append(
                    (
                        f"{name} {k}",
                        v["target"],
                        fmt(v["measured"]),
                        met(v["met"]),
                    )
                )
    return rows


def met(ok: bool) -> str:
    return "yes" if ok else "NOT MET"


def overhead_lines(rep: dict) -> list[str]:
    """Per method: the stall (median, first), the commit, the prepare."""
    out = []
    for m, x in rep.get("methods", {}).items():
        out.append(
            f"- {m}: stall median {fmt(x['stall_seconds']['median'])} s, first "
            f"{fmt(x['stall_first_seconds'])} s, commit median "
            f"{fmt(x['commit_seconds']['median'])} s"
            + (f", prepare {fmt(x['prepare_seconds'])} s" if "prepare_seconds" in x else "")
            # torch 2.11's DefaultStager stages once: a new one per save there.
            + (", stager NOT reused (this torch)" if x.get("stager_reused") is False else "")
        )
    return out


def training_lines(rep: dict) -> list[str]:
    """Per method: the mean step, the overhead, the slowdown during a write."""
    return [
        f"- {m}: mean step {fmt(x['mean_step_seconds'] * 1e3)} ms, overhead "
        f"{fmt(x['overhead_pct'])}%, during a write {fmt(x['during_write_slowdown_pct'])}%"
        f" ({x['steps_during_write']} steps)"
        for m, x in rep.get("methods", {}).items()
    ]


def restore_lines(rep: dict[str, Any]) -> list[str]:
    """Hot and cold loads: each ratio within a round (median over rounds)."""
    lines = []
    for mode in ("cold", "warm"):
        r = rep.get(mode)
        if r:
            lines.append(
                f"- {mode}: load_latest {fmt(r['asyncckpt_vs_dcp_load']['median'])}x dcp.load, "
                f"{fmt(r['asyncckpt_vs_raw_read']['median'])}x a raw read; GB/s "
                + fmt({k: v for k, v in r["gb_per_s"].items()})
            )
    res = rep.get("resume", {})
    if "hot_vs_cold_dcp_load" in res:
        # (results written before the median-of-loads figure: the per-round one)
        hot = res.get("hot_vs_median_dcp_load", res["hot_vs_cold_dcp_load"]["median"])
        lines.append(
            f"- resume in a new process after SIGKILL: hot {fmt(hot)}x the median cold dcp.load"
            f" ({fmt(res['hot_vs_cold_dcp_load']['median'])}x its round's), from disk "
            f"{fmt(res['disk_vs_cold_dcp_load']['median'])}x; "
            f"bit for bit: {res['bit_for_bit']}; sources: "
            + ", ".join(sorted({f"{r['name']}={r['source']}" for r in res.get("runs", [])}))
        )
        if not res["bit_for_bit"]:
            lines.append("- NOT MET: a resume did not restore the state bit for bit")
    else:
        lines.append(f"- resume: {fmt(res)}")
    return lines


def differential_lines(rep: dict[str, Any]) -> list[str]:
    """Per state: what the last save added to the disk, the stall and time to durable vs a full
    copy."""
    lines = []
    for name, st in rep.get("states", {}).items():
        ms = st["methods"]
        lines.append(
            f"- {name} ({st['state_bytes'] / 2**20:.0f} MiB): the last save added "
            f"{fmt(ms['asyncckpt']['added_over_state'])}x the state; stall "
            f"{fmt(st['stall_vs_full'])}x a full copy, {fmt(st['stall_vs_dcp_async_save'])}x "
            f"dcp.async_save; durable {fmt(st['durable_vs_full'])}x full; memory save stall "
            f"{fmt(st['memory_stall_vs_full'])}x full; not copied "
            f"{fmt(ms['asyncckpt']['copy_skipped_bytes'] / 2**20)} MiB, trainer-side fingerprint "
            f"{fmt(ms['asyncckpt']['copy_fingerprint_s'])} s"
        )
    return lines


def differential_targets(rep: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    t = rep.get("target")
    if t:
        rows.append(
            ("rl: a save added / state", f"<= {t['target']}",
             fmt(t.get("added_over_state", t["step_2_added_over_state"])), met(t["met"]))
        )  # fmt: skip
    for name, st in rep.get("states", {}).items():
        # An unchanged frozen part is neither copied nor written: the save stalls less.
        rows.append((f"{name}: stall vs full copy", "< 1.0", fmt(st["stall_vs_full"]),
                     met(st["stall_vs_full"] < 1.0)))  # fmt: skip
    return rows


def _test_lines(cases: list[dict[str, str]]) -> list[str]:
    if not cases:
        return ["no junit XML: the test step did not run or crashed (see suite.log)"]
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    lines = [", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
    lines += ["", "| test | outcome | seconds | reason / message |", "|---|---|---:|---|"]
    for c in cases:
        lines.append(f"| {c['test']} | {c['outcome']} | {c['time']} | {c['message']} |")
    return lines


#: The steps each part of the suite runs (``gpu_suite.sh --part``) beside setup and env.
PARTS = {"1": ("tests", "overhead"), "2": ("training_loop", "restore", "differential")}


def main(out: Path, env: Path | None = None, part: str = "all") -> int:
    lines = ["# GPU suite" + ("" if part == "all" else f", part {part}"), ""]
    ran = {name for p, names in PARTS.items() if part in ("all", p) for name in names}
    env = env if env is not None else out / "env.txt"
    steps = read_steps(out / "steps.tsv")
    lines += ["## Steps", "", "| step | status | exit code | seconds | required | note |"]
    lines += ["|---|---|---:|---:|---|---|"]
    for s in steps:
        lines.append(
            f"| {s['name']} | {s['status']} | {s['rc']} | {s['seconds']} | {s['required']} "
            f"| {s['note']} |"
        )
    failed_required = [s["name"] for s in steps if s["required"] == "yes" and s["status"] != "ok"]
    findings = [
        f"{s['name']} {s['status']}"
        for s in steps
        if s["required"] != "yes" and s["status"] != "ok"
    ]
    lines.append("")
    if findings:
        lines.append("Findings (steps not required, not ok): " + ", ".join(findings))
        lines.append("")
    lines.append(
        "Result: **FAILED** (required steps not ok: " + ", ".join(failed_required) + ")"
        if failed_required
        else "Result: every required step ok"
    )
    if env.exists():
        lines += ["", "## Machine", "", "```", env.read_text().strip(), "```"]
    cases = read_junit(out / "junit_cuda.xml")
    if "tests" in ran:
        lines += ["", "## CUDA tests (tests/e2e/test_cuda.py)", ""] + _test_lines(cases)
    for name, describe, rows in (
        ("overhead", overhead_lines, targets_rows),
        ("training_loop", training_lines, targets_rows),
        ("restore", restore_lines, targets_rows),
        ("differential", differential_lines, differential_targets),
    ):
        if name not in ran:  # another part's step
            continue
        path = out / f"{name}.json"
        lines += ["", f"## {name}", ""]
        if not path.exists():
            lines.append(f"no {path.name}: the step did not finish (see suite.log)")
            continue
        rep = json.loads(path.read_text())
        e = rep.get("environment", {})
        size = rep.get("state_bytes", rep.get("bytes"))
        lines.append(
            f"device {e.get('device')} ({e.get('gpu', 'no GPU')}), torch {e.get('torch')}"
            + (f", state {size / 2**30:.2f} GiB" if size is not None else "")
            + (f", asyncckpt {e['git_commit'][:10]}" if e.get("git_commit") else "")
        )
        lines += describe(rep)
        lines += ["", "| target | goal | measured | met |", "|---|---|---|---|"]
        for row in rows(rep):
            lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 1 if failed_required or not steps else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="summary.md for benchmarks/gpu_suite.sh")
    p.add_argument("results", type=Path)
    p.add_argument("--env", type=Path, help="the machine's probe (default RESULTS/env.txt)")
    p.add_argument("--part", choices=["1", "2", "all"], default="all")
    a = p.parse_args()
    raise SystemExit(main(a.results, a.env, a.part))

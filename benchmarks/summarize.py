"""Markdown tables from the benchmark JSON in benchmarks/results/ (for the READMEs).

python benchmarks/summarize.py [--results benchmarks/results] [--tag ""]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def row(cells: list) -> str:
    return "| " + " | ".join(C.fmt(c) if not isinstance(c, str) else c for c in cells) + " |"


def table(cols: list[str], rows: list[list]) -> str:
    head = row(cols) + "\n|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"
    return head + "\n" + "\n".join(row(r) for r in rows)


def overhead(rep: dict) -> str:
    refs = rep["references"]
    gb = rep["state_bytes"] / C.GiB
    out = [
        f"**overhead** — {gb:.2f} GiB state in {rep['state_tensors']} tensors, "
        f"{rep['saves']} saves, {rep['environment']['device']}, "
        f"load average at start {rep['environment']['load_avg'][0]:.1f}\n",
    ]
    cols = ["method", "stall median s", "min", "max", "first save", "commit s"]
    cols += ["write MB/s", "extra mem GiB", "stall / copy", "MB/s / raw write"]
    rows = [
        C.timing_row(
            f"reference: parallel copy ({refs['parallel_copy']['threads']} threads)",
            refs["parallel_copy"]["seconds"],
            len(cols),
        ),
        C.timing_row("reference: 1-thread copy", refs["single_thread_copy"]["seconds"], len(cols)),
        [
            "reference: sequential write + fsync",
            "",
            "",
            "",
            "",
            refs["sequential_write_fsync"]["seconds"]["median"],
            refs["sequential_write_fsync"]["throughput_bytes_per_s"] / 1e6,
            "",
            "",
            "",
        ],
    ]
    for m, e in rep["methods"].items():
        tx = e.get("ratio_throughput_vs_paired_raw_write", float("nan"))
        if tx != tx:
            tx = e["ratio_throughput_vs_raw_write"]
        rows.append(
            [
                f"**{m}**" if m == "asyncckpt" else m,
                e["stall_seconds"]["median"],
                e["stall_seconds"]["min"],
                e["stall_seconds"]["max"],
                e["stall_first_seconds"],
                e["commit_seconds"]["median"],
                e["write_throughput_bytes_per_s"] / 1e6,
                e["memory"]["extra_memory_bytes"] / C.GiB,
                e["ratio_stall_vs_paired_copy"],
                tx,
            ]
        )
    out.append(table(cols, rows))
    alts = rep["comparisons"].get("asyncckpt_vs_alternative", {})
    if alts:
        out.append("\nasyncckpt / alternative (< 1: asyncckpt is lower):\n")
        out.append(
            table(
                [
                    "alternative",
                    "stall median",
                    "median, paired",
                    "first stall",
                    "max stall",
                    "commit",
                    "MB/s",
                ],
                [
                    [m, x["stall_median"], x.get("stall_median_paired", float("nan"))]
                    + [x["stall_first"], x["stall_max"], x["commit_median"], x["throughput"]]
                    for m, x in alts.items()
                ],
            )
        )
    out.append("\n" + targets(rep["targets"]))
    return "\n".join(out)


def targets(t: dict) -> str:
    rows = []
    for k, v in t.items():
        if "target" in v:
            rows.append([k, v["target"], _m(v["measured"]), "yes" if v["met"] else "**no**"])
        else:
            for k2, v2 in v.items():
                rows.append(
                    [f"{k}: {k2}", v2["target"], _m(v2["measured"])]
                    + ["yes" if v2["met"] else "**no**"]
                )
    return table(["target", "goal", "measured", "met"], rows)


def _m(x) -> str:
    if isinstance(x, list):
        return ", ".join(C.fmt(float(v)) for v in x)
    if isinstance(x, (int, float)):
        return C.fmt(float(x))
    return str(x)


def training(rep: dict) -> str:
    cal = rep.get("calibration", {})
    threads = rep.get("trainer_threads", rep["environment"]["torch_threads"])
    out = [
        f"**training_loop** — {rep['model_params'] / 1e6:.1f}M-parameter transformer, "
        f"{rep['state_bytes'] / C.MiB:.0f} MiB state, {threads} trainer thread(s), save every "
        f"{rep['save_every_steps']} steps ({rep['args']['saves']} saves"
        + (f" in {rep['rounds']} interleaved rounds" if rep.get("rounds", 1) > 1 else "")
        + "), baseline step "
        f"{rep['baseline_mean_step_seconds'] * 1e3:.0f} ms, load average at start "
        f"{rep['environment']['load_avg'][0]:.1f}\n"
    ]
    if cal:
        out.append(
            f"Save interval: calibration save (asyncckpt, default throttle, training running) "
            f"wrote + committed in {cal['write_plus_commit_seconds']:.2f} s against a "
            f"{rep['step_seconds_calibration'] * 1e3:.0f} ms step: {cal['rule']} = "
            f"{cal['auto_every']}; used: every {rep['save_every_steps']} steps "
            f"({cal['every_source']}).\n"
        )
    rows = []
    for m, e in rep["methods"].items():
        wc = e.get("write_commit_seconds", {}).get("median", float("nan"))
        bp = e.get("backpressure_wait_seconds", {}).get("median", float("nan"))
        rows.append(
            [
                m,
                e["mean_step_seconds"] * 1e3,
                e["overhead_pct"],
                e.get("overhead_sem_pct", float("nan")),
                e.get("overhead_vs_own_quiet_steps_pct", float("nan")),
                e["steps_during_write"],
                e["during_write_slowdown_pct"],
                e["stall_seconds"]["median"],
                bp,
                wc,
                e["rss_growth_bytes"] / C.MiB,
            ]
        )
    cols = ["method", "mean step ms", "overhead A/B %", "± SEM", "overhead paired %"]
    cols += ["steps during a write", "slowdown during a write %", "stall median s"]
    cols += ["of which back-pressure s", "write+commit median s", "RSS change in a round MiB"]
    out.append(table(cols, rows))
    soak = rep.get("rss_soak")
    if soak:
        mib = [x / C.MiB for x in soak["trainer_rss"]]
        wmib = [x / C.MiB for x in soak["worker_rss"]]
        out.append(
            f"\nRSS soak ({soak['saves']} saves on one engine, {soak['seconds']:.0f} s): trainer "
            f"{min(mib):.0f}-{max(mib):.0f} MiB ({soak['trainer_growth_bytes'] / C.MiB:+.1f} MiB "
            f"first to last save), worker {min(wmib):.0f}-{max(wmib):.0f} MiB "
            f"({soak['worker_growth_bytes'] / C.MiB:+.1f} MiB).\n"
        )
    out.append("\n" + targets(rep["targets"]))
    return "\n".join(out)


def offload(rep: dict) -> str:
    threads = rep.get("trainer_threads", rep["environment"]["torch_threads"])
    out = [
        f"**offload_throttle** — CPU Adam over {rep['params'] / 1e6:.0f}M parameters in "
        f"{rep['tensors']} tensors on {threads} thread(s), {rep['state_bytes'] / C.GiB:.2f} GiB "
        f"written per save, idle gap {rep['gap_seconds'] * 1e3:.0f} ms between steps, load "
        f"average at start {rep['environment']['load_avg'][0]:.1f}"
        + (
            f", +cap = {rep['write_rate_cap_bytes_per_s'] / 1e6:.0f} MB/s "
            f"({rep['write_rate_cap_source']})"
            if "write_rate_cap_bytes_per_s" in rep and any("cap" in m for m in rep["modes"])
            else ""
        )
        + "\n"
    ]
    rows = []
    for m, r in rep["modes"].items():
        rows.append(
            [
                m,
                r["mean_quiet_step_seconds"] * 1e3,
                r["mean_busy_step_seconds"] * 1e3,
                r["slowdown_pct"],
                r.get("slowdown_median_pct", float("nan")),
                r.get("slowdown_vs_unpinned_quiet_pct", float("nan")),
                len(r["busy"]),
                r["write_seconds_median"],
                C.med(r["paused_seconds"]) if r.get("paused_seconds") else float("nan"),
            ]
        )
    cols = ["throttle", "Adam step ms", "during a write ms", "slowdown % (means)"]
    cols += ["slowdown % (medians)", "vs unpinned quiet %", "steps in write", "write s"]
    cols += ["writes held s"]
    out.append(table(cols, rows))
    out.append("\n" + targets(rep["targets"]))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--results", type=Path, default=C.RESULTS)
    p.add_argument("--tag", default="")
    a = p.parse_args()
    for name, fn in (("overhead", overhead), ("training_loop", training)):
        path = a.results / f"{name}{a.tag}.json"
        if path.exists():
            print(fn(json.loads(path.read_text())) + "\n")
    path = a.results / f"offload_throttle{a.tag}.json"
    if path.exists():
        print(offload(json.loads(path.read_text())) + "\n")


if __name__ == "__main__":
    main()

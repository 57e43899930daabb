"""What starting an engine costs the trainer (issue 25.6).

The worker is a spawned interpreter that imports torch: seconds. ``start()`` returns once the
worker is launched, not once it is ready, so that time overlaps the trainer's own start-up
(building the model, the data loader); only a save made before the worker is ready waits for
it, after staging. Measured, per repeat, in a fresh process each (imports warm in the page
cache, as on a second run):

- ``start``: ``with SyncCheckpointEngine(root)`` entered (what the trainer waits for);
- ``ready``: from ``start()`` to the worker's Ready (the start-up it overlaps);
- ``first_save_now``: the first ``save()`` made at once after start (waits for Ready);
- ``first_save_after``: the first ``save()`` made ``--user-startup`` seconds after start.

Usage: ``python benchmarks/start_time.py [--repeats 5] [--user-startup 5]``; prints a table of
medians (min-max) and writes ``results/start_time.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from asyncckpt import SyncCheckpointEngine
from asyncckpt.testing import wait_worker_ready
root, wait_first = sys.argv[1], float(sys.argv[2])
state = {"w": torch.ones(1 << 20)}
eng = SyncCheckpointEngine(root)
t = time.perf_counter()
eng.__enter__()
start = time.perf_counter() - t
if wait_first:
    time.sleep(wait_first)  # the trainer's own start-up
t_save = time.perf_counter()
eng.save(1, state)
first_save = time.perf_counter() - t_save
wait_worker_ready(eng)
eng.close()
print(json.dumps({"start": start, "first_save": first_save}))
"""

READY = r"""
import json, sys, time
from asyncckpt import SyncCheckpointEngine
from asyncckpt.testing import wait_worker_ready
eng = SyncCheckpointEngine(sys.argv[1])
t = time.perf_counter()
eng.__enter__()
wait_worker_ready(eng)
ready = time.perf_counter() - t
eng.close()
print(json.dumps({"ready": ready}))
"""


def run(code: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--user-startup", type=float, default=5.0)
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    import common

    bytecode = common.compile_bytecode()  # as installed: no child pays the compile
    rows: dict[str, list[float]] = {
        "start": [],
        "ready": [],
        "first_save_now": [],
        "first_save_after": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            now = run(CHILD, f"{tmp}/now{i}", "0")
            after = run(CHILD, f"{tmp}/after{i}", str(args.user_startup))
            rows["start"] += [now["start"], after["start"]]
            rows["first_save_now"].append(now["first_save"])
            rows["first_save_after"].append(after["first_save"])
            rows["ready"].append(run(READY, f"{tmp}/ready{i}")["ready"])
    summary = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
        for k, v in rows.items()
    }
    print(f"{'':18} {'median':>8} {'min':>8} {'max':>8}   (seconds, {args.repeats} repeats)")
    for k, s in summary.items():
        label = f"{k} ({args.user_startup:g} s)" if k == "first_save_after" else k
        print(f"{label:18} {s['median']:8.3f} {s['min']:8.3f} {s['max']:8.3f}")
    out = HERE / "results" / "start_time.json"
    out.write_text(
        json.dumps({"user_startup_s": args.user_startup, **bytecode, "seconds": summary}, indent=2)
    )
    print(f"written {out}")


if __name__ == "__main__":
    main()

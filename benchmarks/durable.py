"""Time to durable under a trainer that keeps every core busy (issue 27, item 3).

The "trainer" is a loop of matmuls on all of torch's threads. In each mode one save of a
``--size-mb`` state is made between steps, and the loop goes on stepping until the checkpoint
is durable (committed), at most ``--max-seconds``. Reported per mode: time from the save call
to durable, the step time while the save was being written against the steps before it, and
for asyncckpt the ``SaveStats`` figures (``throttled_seconds``, ``escalated_after_seconds``).

Modes: ``default`` (the gentle default throttle), ``deadline`` (``ThrottleConfig.background(durable_within=--deadline)``)
and ``dcp.async_save`` (torch's thread executor).

``python benchmarks/durable.py [--size-mb 256 --deadline 4 --max-seconds 60]``; writes
``results/durable.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from asyncckpt import SyncCheckpointEngine, ThrottleConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--deadline", type=float, default=4.0)
    ap.add_argument("--max-seconds", type=float, default=60.0)
    ap.add_argument("--matmul", type=int, default=768, help="the trainer's square matmul size")
    ap.add_argument("--modes", default="default,deadline,dcp.async_save")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "durable.json"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.size_mb, args.max_seconds, args.matmul = 8, 20.0, 128

    n = args.size_mb * (1 << 20) // 4 // 8
    state = {f"t{i}": torch.randn(n) for i in range(8)}
    a = torch.randn(args.matmul, args.matmul)

    def step() -> float:
        t0 = time.perf_counter()
        b = a
        for _ in range(4):
            b = (b @ a).tanh_()
        return time.perf_counter() - t0

    for _ in range(5):
        step()
    results = {}
    for mode in args.modes.split(","):
        root = Path(tempfile.mkdtemp(prefix="durable-bench-"))
        try:
            results[mode] = run_mode(mode, root, state, step, args)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        r = results[mode]
        print(
            f"{mode:16s} durable {r['durable_s']:7.2f} s  steps during {r['steps_during']:4d}  "
            f"step slowdown {r['step_slowdown'] * 100:+6.1f}%  {r.get('stats', '')}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "bench": "durable",
                "size_mb": args.size_mb,
                "deadline_s": args.deadline,
                "threads": torch.get_num_threads(),
                "matmul": args.matmul,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )


def run_mode(mode: str, root: Path, state: dict, step, args) -> dict:
    before = [step() for _ in range(20)]
    during: list[float] = []
    out: dict = {}
    if mode == "dcp.async_save":
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(root / "step_1"))
        while not fut.done() and time.perf_counter() - t0 < args.max_seconds:
            during.append(step())
        fut.result(timeout=600)
        durable = time.perf_counter() - t0
    else:
        kw = (
            {"throttle": ThrottleConfig.background(durable_within=args.deadline)}
            if mode == "deadline"
            else {}
        )
        with SyncCheckpointEngine(root, **kw) as engine:
            engine.prepare(state)
            t0 = time.perf_counter()
            h = engine.save(1, state)
            while not h.done() and time.perf_counter() - t0 < args.max_seconds:
                during.append(step())
            s = h.committed_sync(600)
            durable = time.perf_counter() - t0
            out["stats"] = {
                "durable_seconds": s.durable_seconds,
                "throttled_seconds": s.throttled_seconds,
                "escalated_after_seconds": s.escalated_after_seconds,
                "escalations": s.escalations,
                "write_seconds": s.write_seconds,
            }
    base = statistics.median(before)
    out.update(
        durable_s=durable,
        capped=durable >= args.max_seconds,
        steps_during=len(during),
        step_before_s=base,
        step_during_s=statistics.median(during) if during else None,
        step_slowdown=(statistics.median(during) / base - 1) if during else 0.0,
    )
    return out


if __name__ == "__main__":
    main()

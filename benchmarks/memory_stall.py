"""A memory save's stall behind a disk write from a memory slot (issue 53, item 1).

With the memory tier on, a disk save is staged into one of its two slots and written from
there. Before: the memory save after next waited for that write (1.3 s per 256 MiB disk save).
A training loop of ``--steps`` steps of ``--step-ms`` each over a ``--state-mb`` state (8
tensors, the state bumped every step) saves to memory every step and to disk every
``--disk-every``-th (``Schedule(every_steps=, memory_every_steps=1)``, ``engine.due``). Per save:
the time inside ``save()``, whether a disk save was still in flight, and whether it was skipped
(``handle.skipped``). A thread samples the PSS of the trainer and its worker (memory_peak.py).

Reported: the median memory save's blocking time (of those taken, and of all, skipped ones
included), the longest one while a disk save was in flight (target: <= 3x the median of those
taken), and the peak host memory over the state (target: <= 2.1x). Beside them, what the loop
paid in all: its wall time, every save's blocking added up, and the longest disk save's (a disk
save waits for the previous disk write's slot: a disk interval shorter than the write moves
the wait there).

``python benchmarks/memory_stall.py [--state-mb 256] [--out results/memory_stall.json]``;
``--quick`` for a smoke run (16 MiB, 12 steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from memory_peak import PssSampler, make_state, settled  # noqa: E402


def run(args: argparse.Namespace) -> dict[str, Any]:
    from asyncckpt import KeepLast, Schedule, SyncCheckpointEngine

    torch.set_num_threads(1)
    state = make_state(args.state_mb)
    nbytes = C.state_nbytes(state)
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="memory-stall-"))
    saves: list[dict[str, Any]] = []
    disk = None
    sampler = PssSampler(args.interval)
    schedule = Schedule(every_steps=args.disk_every, memory_every_steps=1)
    engine = SyncCheckpointEngine(root, keep=KeepLast(2), schedule=schedule)
    with engine:
        base = settled(sampler)  # the worker's imports are done
        with sampler:
            loop_t0 = time.perf_counter()
            for step in range(1, args.steps + 1):
                time.sleep(args.step_ms / 1e3)  # the step's compute
                for t in state.values():
                    t.add_(1.0)
                tier = engine.due(step)
                if tier is None:
                    continue
                in_flight = disk is not None and not disk.done()
                t0 = time.perf_counter()
                handle = engine.save(step, state, tier=tier)
                blocked = time.perf_counter() - t0
                if tier == "disk":
                    disk = handle
                saves.append(
                    {
                        "step": step,
                        "tier": tier,
                        "blocked_s": blocked,
                        "disk_in_flight": in_flight,
                        "skipped": bool(getattr(handle, "skipped", False)),
                    }
                )
            loop_s = time.perf_counter() - loop_t0
            engine.wait()
        skipped_count = getattr(engine.stats, "memory_saves_skipped", None)
    C.rmtree(root)
    memory = [s["blocked_s"] for s in saves if s["tier"] == "memory"]
    taken = [s["blocked_s"] for s in saves if s["tier"] == "memory" and not s["skipped"]]
    behind = [s["blocked_s"] for s in saves if s["tier"] == "memory" and s["disk_in_flight"]]
    median = statistics.median(taken) if taken else statistics.median(memory)
    worst = max(behind, default=0.0)
    disk_blocked = [s["blocked_s"] for s in saves if s["tier"] == "disk"]
    ratio = (sampler.peak - base) / nbytes
    return {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "source": C.package_source(),
        "state_bytes": nbytes,
        "memory_saves": len(memory),
        "memory_saves_skipped": skipped_count,
        "median_memory_blocked_s": statistics.median(memory),
        "median_taken_memory_blocked_s": median,
        "max_memory_blocked_disk_in_flight_s": worst,
        "stall_ratio": worst / median if median else None,
        "loop_seconds": loop_s,
        "blocked_seconds_total": sum(s["blocked_s"] for s in saves),
        "max_disk_blocked_s": max(disk_blocked, default=0.0),
        "peak_pss_ratio": ratio,
        "base_pss_bytes": base,
        "peak_pss_bytes": sampler.peak,
        "targets": {"stall_ratio": "<= 3", "peak_pss_ratio": "<= 2.1"},
        "met": worst <= 3 * median and ratio <= 2.1,
        "saves": saves,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--state-mb", type=int, default=256)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--disk-every", type=int, default=10)
    p.add_argument("--step-ms", type=float, default=100.0)
    p.add_argument("--interval", type=float, default=0.005)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory")
    p.add_argument("--out", type=Path, default=C.RESULTS / "memory_stall.json")
    p.add_argument("--quick", action="store_true", help="16 MiB, 12 steps: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.state_mb, args.steps, args.disk_every = 16, 12, 4
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    rep = run(args)
    C.write_json(args.out.parent, args.out.stem, rep)
    print(
        f"state {rep['state_bytes'] / C.MiB:.0f} MiB, {rep['memory_saves']} memory saves "
        f"({rep['memory_saves_skipped']} skipped): median blocked "
        f"{rep['median_taken_memory_blocked_s'] * 1e3:.1f} ms (all: "
        f"{rep['median_memory_blocked_s'] * 1e3:.1f} ms), max with a disk save in flight "
        f"{rep['max_memory_blocked_disk_in_flight_s'] * 1e3:.1f} ms "
        f"({rep['stall_ratio']:.2f}x the median), peak PSS {rep['peak_pss_ratio']:.2f}x the state; "
        f"loop {rep['loop_seconds']:.2f} s, saves blocked {rep['blocked_seconds_total']:.2f} s in "
        f"all, longest disk save {rep['max_disk_blocked_s'] * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()

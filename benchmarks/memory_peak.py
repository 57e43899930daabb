"""Host memory of the memory tier with a disk save in flight (issue 35, item 1).

The trainer holds a ``--state-mb`` state; one engine (defaults, ``Schedule(every_steps=2,
memory_every_steps=1)``) then saves: memory step 1, disk step 2, and memory steps 3 and 4
right behind it while step 2 is still being written (recorded: ``disk_in_flight``), then disk
step 6 and memory step 7 the same way. A thread samples the PSS (proportional set size: a
page shared by the trainer and its worker counts once, split between them) of the trainer and
all its child processes every ``--interval`` seconds; ``peak_ratio`` is the rise of that sum
over its value once the engine started (worker up, state allocated, nothing staged), divided by
the state's bytes. The target: <= 2.1x (two copies of the state serve both tiers).

``python benchmarks/memory_peak.py [--state-mb 512]``; ``--quick`` for the tests (16 MiB).
Writes ``results/memory_peak.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"


def tree_pss(proc: psutil.Process) -> list[int]:
    """PSS of ``proc`` and of each of its descendants (a shared page counts once across them:
    split between the processes that map it)."""
    out = []
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            out.append(p.memory_full_info().pss)
    return out


class PssSampler(C.Sampler):
    """The PSS sum of the trainer and its children, sampled in a thread; keeps the peak."""

    def __init__(self, interval: float) -> None:
        super().__init__(interval)
        self.proc = psutil.Process()
        self.peak = 0
        self.peak_parts: list[int] = []  # trainer, then each child, at the peak
        self.samples = 0

    def sample(self) -> int:
        parts = tree_pss(self.proc)
        now = sum(parts)
        if now > self.peak:
            self.peak, self.peak_parts = now, parts
        self.samples += 1
        return now


def settled(sampler: PssSampler, within: int = 2 * MiB, timeout: float = 120.0) -> int:
    """The PSS sum once the worker has started (imported torch): two samples a second apart
    within ``within`` bytes of each other."""
    last = sampler.sample()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = sampler.sample()
        if len(sampler.peak_parts) > 1 and abs(now - last) <= within:
            break
        last = now
    sampler.peak, sampler.peak_parts = now, tree_pss(sampler.proc)
    return now


def make_state(mb: int) -> dict[str, torch.Tensor]:
    n = mb * MiB // 4 // 8
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(8)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from asyncckpt import KeepLast, Schedule, SyncCheckpointEngine

    torch.set_num_threads(1)
    state = make_state(args.state_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="memory-peak-"))
    in_flight = []  # (memory step, whether a disk save was still in flight when it returned)
    stalls = []
    disk = None
    sampler = PssSampler(args.interval)
    engine = SyncCheckpointEngine(
        root, keep=KeepLast(2), schedule=Schedule(every_steps=2, memory_every_steps=1)
    )
    with engine:
        base = settled(sampler)  # the worker's imports are done
        base_parts = list(sampler.peak_parts)
        with sampler:
            for step, tier in ((1, "memory"), (2, "disk"), (3, "memory"), (4, "memory")) + (
                (6, "disk"),
                (7, "memory"),
            ):
                for t in state.values():
                    t.add_(1.0)
                t0 = time.perf_counter()
                handle = engine.save(step, state, tier=tier)
                stalls.append((step, tier, time.perf_counter() - t0))
                if tier == "disk":
                    disk = handle
                else:
                    in_flight.append((step, disk is not None and not disk.done()))
            engine.wait()
    ratio = (sampler.peak - base) / nbytes
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return {
        "state_bytes": nbytes,
        "base_pss_bytes": base,
        "peak_pss_bytes": sampler.peak,
        "base_parts_bytes": base_parts,
        "peak_parts_bytes": sampler.peak_parts,
        "peak_ratio": ratio,
        "samples": sampler.samples,
        "disk_in_flight": in_flight,
        "stalls_s": stalls,
        "target": "peak_ratio <= 2.1",
        "met": ratio <= 2.1,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--state-mb", type=int, default=512)
    p.add_argument("--interval", type=float, default=0.005)
    p.add_argument("--dir", type=Path, default=None, help="scratch directory")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="16 MiB, for the tests")
    args = p.parse_args()
    if args.quick:
        args.state_mb = 16
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    rep = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_peak.json").write_text(json.dumps(rep, indent=1))
    print(
        f"state {rep['state_bytes'] / MiB:.0f} MiB: peak PSS (trainer + worker) "
        f"+{(rep['peak_pss_bytes'] - rep['base_pss_bytes']) / MiB:.0f} MiB = "
        f"{rep['peak_ratio']:.2f}x the state (MiB per process, base -> peak: "
        f"{[round(b / MiB) for b in rep['base_parts_bytes']]} -> "
        f"{[round(b / MiB) for b in rep['peak_parts_bytes']]}); disk save in flight during memory saves: "
        f"{rep['disk_in_flight']}; stalls {[(s, t, round(x, 3)) for s, t, x in rep['stalls_s']]}"
    )


if __name__ == "__main__":
    main()

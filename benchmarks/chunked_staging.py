"""Chunked staging (issue 35 item 2): stall, time to durable and peak memory vs the staging budget.

A ``--state-mb`` state (eight tensors of float32) is saved with ``Staging(max_host_bytes=)`` at
1x, 0.5x and 0.25x of the state (1x: the state fits and is staged whole; below it is staged in
chunks of about half the budget, the trainer copying chunk k+1 while the worker writes chunk k,
so ``save()``'s stall grows with state / budget). Each budget gets its own engine: one warm-up
save, then ``--repeats`` timed saves (the state changes in place between them); the medians,
and their ratios to the 1x row, measured in this one run. ``durable_s``: ``save()`` call to
commit (``SaveStats.durable_seconds``).

The must-show (``--peak-mb``, 128 MiB at full size): the PSS (a page shared by the trainer
and its worker counts once) of the trainer and its children, sampled every ``--interval``
seconds during one save of the state under that budget, its rise over the value once the
engine is started and idle, divided by the state's bytes: target <= 0.4x; then the step is
loaded back (``load_latest`` into zeroed tensors) and compared bit for bit.

``python benchmarks/chunked_staging.py [--state-mb 512 --peak-mb 128]``; ``--quick`` for the
tests (16 MiB, 4 MiB). Writes ``results/chunked_staging.json`` and a PNG.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MiB,
    apply_threads,
    base_parser,
    environment,
    med,
    plot_bars,
    print_table,
    quiet_spawned_children,
    ratio,
    rmtree,
    write_json,
)
from memory_peak import PssSampler, settled  # noqa: E402

from asyncckpt import Staging, SyncCheckpointEngine  # noqa: E402

FRACTIONS = (1.0, 0.5, 0.25)
#: What the 1x budget adds to the state's bytes: the arena's alignment of each tensor.
SLACK = 1 * MiB


def make_state(mb: int) -> dict[str, torch.Tensor]:
    n = mb * MiB // 4 // 8
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(8)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def timed_saves(root: Path, state: dict, budget: int, repeats: int) -> dict[str, Any]:
    stalls, durables, waits, chunks = [], [], [], []
    with SyncCheckpointEngine(root, keep=None, staging=Staging(max_host_bytes=budget)) as eng:
        eng.save(0, state).committed_sync()  # warm-up: worker up, buffers allocated
        for step in range(1, repeats + 1):
            for t in state.values():
                t.add_(1.0)
            t0 = time.perf_counter()
            handle = eng.save(step, state)
            stalls.append(time.perf_counter() - t0)
            st = handle.committed_sync()
            durables.append(st.durable_seconds)
            waits.append(st.wait_seconds)
            chunks.append(st.chunks)
    return {
        "budget_bytes": budget,
        "chunks": chunks[-1],
        "stall_s": med(stalls),
        "durable_s": med(durables),
        "wait_s": med(waits),
        "stalls_s": stalls,
        "durables_s": durables,
    }


def peak_run(root: Path, state: dict, budget: int, interval: float) -> dict[str, Any]:
    """One save under ``budget`` with the PSS sampled; then the step loaded back."""
    size = nbytes(state)
    sampler = PssSampler(interval)
    with SyncCheckpointEngine(root, keep=None, staging=Staging(max_host_bytes=budget)) as eng:
        base = settled(sampler)  # the worker's imports done, nothing staged
        with sampler:
            t0 = time.perf_counter()
            handle = eng.save(1, state)
            stall = time.perf_counter() - t0
            st = handle.committed_sync()
    back = {k: torch.zeros_like(t) for k, t in state.items()}
    with SyncCheckpointEngine(root) as eng:
        step = eng.load_latest(back)
    same = step == 1 and all(
        torch.equal(back[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state
    )
    peak_ratio = (sampler.peak - base) / size
    return {
        "budget_bytes": budget,
        "state_bytes": size,
        "chunks": st.chunks,
        "stall_s": stall,
        "durable_s": st.durable_seconds,
        "base_pss_bytes": base,
        "peak_pss_bytes": sampler.peak,
        "peak_parts_bytes": sampler.peak_parts,
        "samples": sampler.samples,
        "peak_ratio": peak_ratio,
        "loads_bit_for_bit": same,
        "target": "peak_ratio <= 0.4 and loads_bit_for_bit",
        "met": peak_ratio <= 0.4 and same,
    }


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--state-mb", type=int, default=512)
    p.add_argument("--peak-mb", type=int, default=128, help="the must-show's budget")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.005)
    args = p.parse_args()
    if args.quick:
        args.state_mb, args.peak_mb, args.repeats = 16, 4, 1
    apply_threads(args)
    quiet_spawned_children()
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = make_state(args.state_mb)
    size = nbytes(state)
    results: dict[str, Any] = {"environment": environment("cpu"), "state_bytes": size}
    budgets: dict[str, Any] = {}
    for fraction in FRACTIONS:
        root = args.dir / f"chunked-{fraction}-{os.getpid()}"
        rmtree(root)
        root.mkdir(parents=True)
        try:
            budget = int(size * fraction) + (SLACK if fraction == 1.0 else 0)
            budgets[f"{fraction}x"] = timed_saves(root, state, budget, args.repeats)
        finally:
            rmtree(root)
    whole = budgets["1.0x"]
    for row in budgets.values():
        row["stall_vs_1x"] = ratio(row["stall_s"], whole["stall_s"])
        row["durable_vs_1x"] = ratio(row["durable_s"], whole["durable_s"])
    results["budgets"] = budgets
    root = args.dir / f"chunked-peak-{os.getpid()}"
    rmtree(root)
    root.mkdir(parents=True)
    try:
        results["peak"] = peak_run(
            root, make_state(args.state_mb), args.peak_mb * MiB, args.interval
        )
    finally:
        rmtree(root)
    rows = [
        [k, r["chunks"], r["stall_s"], r["stall_vs_1x"], r["durable_s"], r["durable_vs_1x"]]
        for k, r in budgets.items()
    ]
    print_table(
        f"chunked staging, {size / MiB:.0f} MiB state (median of {args.repeats})",
        ["budget", "chunks", "stall s", "stall/1x", "durable s", "durable/1x"],
        rows,
    )
    pk = results["peak"]
    print(
        f"Staging(max_host_bytes={args.peak_mb} MiB), {size / MiB:.0f} MiB state: peak PSS rise "
        f"{(pk['peak_pss_bytes'] - pk['base_pss_bytes']) / MiB:.0f} MiB = {pk['peak_ratio']:.2f}x "
        f"the state ({pk['chunks']} chunks, {pk['samples']} samples), loads bit for bit: "
        f"{pk['loads_bit_for_bit']}; target <= 0.4x: {'met' if pk['met'] else 'NOT met'}"
    )
    tag = f"chunked_staging{args.tag}"
    write_json(args.out, tag, results)
    if not args.no_plot:
        labels = list(budgets)
        plot_bars(
            args.out / f"{tag}.png",
            f"chunked staging ({size / MiB:.0f} MiB state)",
            [
                ("stall / 1x", labels, [budgets[k]["stall_vs_1x"] for k in labels], None),
                ("durable / 1x", labels, [budgets[k]["durable_vs_1x"] for k in labels], None),
                ("peak PSS / state", [f"{args.peak_mb} MiB"], [pk["peak_ratio"]], 0.4),
            ],
        )


if __name__ == "__main__":
    main()

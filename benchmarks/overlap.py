"""Overlapped saves (issue 27): the visible stall of ``save(..., overlap=True)`` against a full
copy of the same bytes, and what the overlap costs the forward + backward it runs beside.

A stack of Linear layers (the state: weights + SGD momentum) is trained; every round does, in
each mode, one timed iteration of ``save`` (none / blocking / overlapped), forward + backward,
``optimizer.step()`` (with ``engine.stage_before_step``: it waits for an overlapped copy). The
write of each checkpoint is waited for outside the timed part, so the figures are staging's
alone. Figures (medians over the rounds):

* ``copy_s``: one ``torch._foreach_copy_`` of the state into preallocated buffers (the floor of
  a blocking save);
* ``blocking_stall_s``: ``SaveStats.blocked_seconds`` of a blocking save;
* ``overlap_stall_s``: the time in ``save`` plus the wait in the step hook (the loop's visible
  stall);
* ``fwd_bwd_s`` per mode: forward + backward time; ``overlap`` vs ``none`` is the slowdown
  the background copy costs on this machine (CPU: cores and memory bandwidth are shared).

``python benchmarks/overlap.py [--width 2048 --layers 8 --batch 256 --rounds 5]``; writes
``results/overlap.json``.
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

from asyncckpt import SyncCheckpointEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "overlap.json"))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.width, args.layers, args.batch, args.rounds = 256, 2, 32, 2

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)]
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    x = torch.randn(args.batch, args.width)

    def fwd_bwd() -> float:
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        return time.perf_counter() - t0

    fwd_bwd()
    opt.step()  # momentum buffers exist: the state is weights + momentum
    opt.zero_grad()
    state = {"model": model, "optim": opt}
    tensors = list(model.state_dict().values()) + [s["momentum_buffer"] for s in opt.state.values()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    bufs = [torch.empty_like(t) for t in tensors]

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="overlap-bench-"))
    fig: dict[str, list[float]] = {
        k: []
        for k in (
            "copy_s",
            "blocking_stall_s",
            "overlap_stall_s",
            "overlap_save_call_s",
            "overlap_hook_wait_s",
            "overlap_stage_s",
            "fwd_bwd_none_s",
            "fwd_bwd_blocking_s",
            "fwd_bwd_overlap_s",
        )
    }
    torn = 0
    step = 0
    try:
        with SyncCheckpointEngine(root, keep=None) as engine:
            engine.prepare(state)
            engine.stage_before_step(opt)
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                torch._foreach_copy_(bufs, tensors)
                fig["copy_s"].append(time.perf_counter() - t0)

                fig["fwd_bwd_none_s"].append(fwd_bwd())
                opt.step()
                opt.zero_grad()

                step += 1
                h = engine.save(step, state)
                fig["blocking_stall_s"].append(h.stats.blocked_seconds)
                fig["fwd_bwd_blocking_s"].append(fwd_bwd())
                opt.step()
                opt.zero_grad()
                h.committed_sync()

                step += 1
                t0 = time.perf_counter()
                h = engine.save(step, state, overlap=True)
                call = time.perf_counter() - t0
                fig["fwd_bwd_overlap_s"].append(fwd_bwd())
                opt.step()  # the hook waits for the copy
                opt.zero_grad()
                try:
                    h.committed_sync()
                except Exception:  # noqa: BLE001 - counted: a benchmark must not hide it
                    torn += 1
                fig["overlap_save_call_s"].append(call)
                fig["overlap_hook_wait_s"].append(h.stats.staged_wait_seconds)
                fig["overlap_stall_s"].append(call + h.stats.staged_wait_seconds)
                fig["overlap_stage_s"].append(h.stats.stage_seconds)
                engine.wait()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in fig.items()}
    result = {
        "bench": "overlap",
        "state_bytes": nbytes,
        "width": args.width,
        "layers": args.layers,
        "batch": args.batch,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "failed_overlapped_saves": torn,
        "median": med,
        "raw": fig,
        "ratios": {
            "blocking_stall_vs_copy": med["blocking_stall_s"] / med["copy_s"],
            "overlap_stall_vs_copy": med["overlap_stall_s"] / med["copy_s"],
            "fwd_bwd_slowdown_overlap": med["fwd_bwd_overlap_s"] / med["fwd_bwd_none_s"] - 1,
            "fwd_bwd_slowdown_blocking": med["fwd_bwd_blocking_s"] / med["fwd_bwd_none_s"] - 1,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"state {nbytes / 2**20:.0f} MiB, {torch.get_num_threads()} threads")
    for k, v in med.items():
        print(f"  {k:24s} {v * 1e3:9.1f} ms")
    for k, v in result["ratios"].items():
        print(f"  {k:28s} {v:7.3f}")
    print(f"  failed overlapped saves: {torn}")


if __name__ == "__main__":
    main()

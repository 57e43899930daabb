"""Differential saves (issue 37): what step 2 adds to the disk when most of the state is frozen.

States: ``rl`` (a trained policy of ``--policy-mb`` beside a frozen reference model of
``--frozen-mb``: the must-show is 64 + 448 MiB, step 2 adds <= 0.3x the state) and ``lora``
(a frozen base of ``--frozen-mb`` with adapters of 1% of it, beside each base weight). Each
round: save step 1, train (every trained tensor changes), save step 2. Methods:
``asyncckpt`` (differential, the default), ``asyncckpt full`` (``Staging(differential=False)``)
and ``dcp.async_save`` (torch's own, thread executor, one save per directory). Reported for
step 2, median of ``--repeats`` rounds: bytes added to the disk (new inodes: a hard link adds
none), that over the state's bytes, the stall, time to durable, and asyncckpt's own figures
(bytes written / skipped, fingerprint seconds); ratios are within one run.

``python benchmarks/differential.py [--device cuda] [--quick]``; writes
``results/differential.json`` and ``.png``.
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

from asyncckpt import Staging, SyncCheckpointEngine  # noqa: E402

TENSOR_MB = 4  # each model weight (a frozen one has a file of its own: >= 1 MiB)


def weights(total_mb: float, device: str, prefix: str) -> dict[str, torch.Tensor]:
    n = max(1, round(total_mb / TENSOR_MB))
    numel = int(total_mb * MiB / 4 / n)
    return {f"{prefix}.layers.{i}.weight": torch.randn(numel, device=device) for i in range(n)}


def rl_state(args: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    policy = weights(args.policy_mb, args.device, "policy")
    ref = weights(args.frozen_mb, args.device, "ref")
    return {"policy": policy, "ref": ref, "step": 0}, list(policy.values())


def lora_state(args: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    base = weights(args.frozen_mb, args.device, "base")
    model: dict[str, torch.Tensor] = {}
    adapters = []
    for key, w in base.items():
        model[key] = w
        r = max(1, w.numel() // 100 // 2048)  # 1% of the weight, as A (r x 1024) + B
        for name in ("lora_A", "lora_B"):
            a = torch.randn(r, 1024, device=args.device)
            model[key.replace("weight", name)] = a
            adapters.append(a)
    return {"model": model, "step": 0}, adapters


STATES = {"rl": rl_state, "lora": lora_state}


def nbytes(state: dict[str, Any]) -> int:
    total = 0
    for v in state.values():
        if isinstance(v, dict):
            total += nbytes(v)
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def disk_bytes(root: Path) -> int:
    """Bytes of the distinct files under ``root`` (a hard-linked file counted once)."""
    seen: dict[tuple[int, int], int] = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def train(trained: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in trained:
            t.mul_(0.999).add_(1e-3)
    if trained and trained[0].is_cuda:
        torch.cuda.synchronize()


def run_asyncckpt(root: Path, state: dict, trained: list, differential: bool) -> dict[str, Any]:
    with SyncCheckpointEngine(root, staging=Staging(differential=differential)) as engine:
        engine.save(1, state).committed_sync()
        before = disk_bytes(root)
        train(trained)
        t0 = time.perf_counter()
        handle = engine.save(2, state)
        stall = time.perf_counter() - t0
        stats = handle.committed_sync()
        durable = time.perf_counter() - t0
    return {
        "stall_s": stall,
        "durable_s": durable,
        "added_bytes": disk_bytes(root) - before,
        "bytes_written": stats.bytes_written,
        "bytes_skipped": stats.bytes_skipped,
        "files_linked": stats.files_linked,
        "fingerprint_s": stats.fingerprint_seconds,
    }


def run_dcp(root: Path, state: dict, trained: list) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    dcp.async_save(state, checkpoint_id=str(root / "1")).result()
    before = disk_bytes(root)
    train(trained)
    t0 = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(root / "2"))
    stall = time.perf_counter() - t0
    future.result()
    durable = time.perf_counter() - t0
    return {"stall_s": stall, "durable_s": durable, "added_bytes": disk_bytes(root) - before}


METHODS = ("asyncckpt", "asyncckpt full", "dcp.async_save")


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--policy-mb", type=float, default=64)
    p.add_argument("--frozen-mb", type=float, default=448)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--states", default="rl,lora")
    args = p.parse_args()
    if args.quick:
        args.policy_mb, args.frozen_mb, args.repeats = 4, 28, 1
    apply_threads(args)
    quiet_spawned_children()
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    results: dict[str, Any] = {"environment": environment(args.device), "states": {}}
    rows = []
    for name in args.states.split(","):
        state, trained = STATES[name](args)
        size = nbytes(state)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for method in METHODS:
                root = args.dir / f"differential-{name}-{os.getpid()}"
                rmtree(root)
                root.mkdir(parents=True)
                try:
                    if method == "dcp.async_save":
                        runs[method].append(run_dcp(root, state, trained))
                    else:
                        runs[method].append(
                            run_asyncckpt(root, state, trained, method == "asyncckpt")
                        )
                finally:
                    rmtree(root)
        out: dict[str, Any] = {"state_bytes": size, "methods": {}}
        for method, rs in runs.items():
            m = {k: med([r[k] for r in rs]) for k in rs[0]}
            m["added_over_state"] = m["added_bytes"] / size
            out["methods"][method] = m
            rows.append([name, method, m["added_over_state"], m["stall_s"], m["durable_s"]])
        d, full, dcp_ = (out["methods"][k]["durable_s"] for k in METHODS)
        out["durable_vs_full"] = ratio(d, full)
        out["durable_vs_dcp_async_save"] = ratio(d, dcp_)
        results["states"][name] = out
    rl = results["states"].get("rl")
    if rl is not None:
        added = rl["methods"]["asyncckpt"]["added_over_state"]
        results["target"] = {"step_2_added_over_state": added, "target": 0.3, "met": added <= 0.3}
    print_table(
        "differential saves: step 2 (median)",
        ["state", "method", "added/state", "stall s", "durable s"],
        rows,
    )
    for name, out in results["states"].items():
        print(
            f"{name}: durable vs full {out['durable_vs_full']:.2f}x, "
            f"vs dcp.async_save {out['durable_vs_dcp_async_save']:.2f}x"
        )
    tag = f"differential{args.tag}"
    write_json(args.out, tag, results)
    if not args.no_plot:
        panels = []
        for name, out in results["states"].items():
            labels = list(METHODS)
            panels.append(
                (
                    f"{name}: step 2 added / state",
                    labels,
                    [out["methods"][k]["added_over_state"] for k in labels],
                    0.3 if name == "rl" else None,
                )
            )
        plot_bars(args.out / f"{tag}.png", "differential saves (step 2)", panels)


if __name__ == "__main__":
    main()

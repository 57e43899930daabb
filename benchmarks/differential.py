"""Differential saves (issue 37): what a save adds to the disk, and what ``save()`` stalls, when
most of the state is frozen.

States: ``rl`` (a trained policy of ``--policy-mb`` beside a frozen reference model of
``--frozen-mb``: the must-show is 64 + 448 MiB, a save adds <= 0.3x the state), ``rl_critic``
(policy, a frozen reference of the same size and a trained critic of the same size: the RL
trainers' state) and ``lora`` (a frozen base of ``--frozen-mb`` with adapters of 1% of it,
beside each base weight). Each round: save step 1, then ``--saves`` - 1 times: train (every
trained tensor changes), save. Methods: ``asyncckpt`` (differential, the default: an unchanged
tensor is neither copied into the staging slot nor written), ``asyncckpt full``
(``Staging(differential=False)``), the memory tier with and without (``tier="memory"``: nothing
written, the copy only) and ``dcp.async_save`` (torch's own, thread executor, one save per
directory). Reported, median of ``--repeats`` rounds: the bytes the last save added to the disk
(new inodes: a hard link adds none) and that over the state's bytes (the must-show), step 2's
and all saves' after the first (with two or more steps kept, step 2 writes the frozen part in
full once: it would share every file with step 1, and one damaged file would take both; from
step 3 on it is linked); ``--keep-last N`` prunes as ``KeepLast(N)`` (0: nothing); the stall
(``save()``'s return time) and time to durable, medians over the saves after the first; asyncckpt's own figures
(bytes written / skipped by links, bytes not copied, fingerprint seconds of the worker and of the
copy). Ratios are within one run.

``python benchmarks/differential.py [--device cuda] [--quick]``; writes
``results/differential.json`` and ``.png``.
"""

from __future__ import annotations

import os
import stat
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

from asyncckpt import KeepLast, MemoryTier, Staging, SyncCheckpointEngine  # noqa: E402

TENSOR_MB = 4  # each model weight (a frozen one has a file of its own: >= 1 MiB)


def weights(total_mb: float, device: str, prefix: str) -> dict[str, torch.Tensor]:
    n = max(1, round(total_mb / TENSOR_MB))
    numel = int(total_mb * MiB / 4 / n)
    return {f"{prefix}.layers.{i}.weight": torch.randn(numel, device=device) for i in range(n)}


def rl_state(args: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    policy = weights(args.policy_mb, args.device, "policy")
    ref = weights(args.frozen_mb, args.device, "ref")
    return {"policy": policy, "ref": ref, "step": 0}, list(policy.values())


def rl_critic_state(args: Any) -> tuple[dict[str, Any], list[torch.Tensor]]:
    policy = weights(args.policy_mb, args.device, "policy")
    ref = weights(args.policy_mb, args.device, "ref")
    critic = weights(args.policy_mb, args.device, "critic")
    state = {"policy": policy, "ref": ref, "critic": critic, "step": 0}
    return state, [*policy.values(), *critic.values()]


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


STATES = {"rl": rl_state, "rl_critic": rl_critic_state, "lora": lora_state}


def nbytes(state: dict[str, Any]) -> int:
    total = 0
    for v in state.values():
        if isinstance(v, dict):
            total += nbytes(v)
        elif isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def disk_files(root: Path) -> dict[tuple[int, int, int], int]:
    """The distinct files under ``root`` (a hard-linked file once): identity -> bytes. The
    identity holds the mtime: an inode number freed by a prune may be a new file's."""
    seen: dict[tuple[int, int, int], int] = {}
    for where, _, names in os.walk(root):  # (a directory pruned while listed: skipped)
        for name in names:
            try:
                st = os.lstat(os.path.join(where, name))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                seen[(st.st_dev, st.st_ino, st.st_mtime_ns)] = st.st_size
    return seen


def added_since(root: Path, before: dict[tuple[int, int, int], int]) -> int:
    """Bytes of the files under ``root`` that were not there in ``before`` (what a save
    added; a prune meanwhile takes nothing off)."""
    return sum(n for f, n in disk_files(root).items() if f not in before)


def train(trained: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t in trained:
            t.mul_(0.999).add_(1e-3)
    if trained and trained[0].is_cuda:
        torch.cuda.synchronize()


def added_figures(added: list[int]) -> dict[str, int]:
    """Bytes added to the disk by each save after the first: the last one's (``added_bytes``),
    step 2's and their sum."""
    return {
        "added_bytes": added[-1],
        "added_bytes_step_2": added[0],
        "added_bytes_total": sum(added),
    }


def run_asyncckpt(
    root: Path,
    state: dict,
    trained: list,
    differential: bool,
    saves: int,
    tier: str = "disk",
    keep_last: int = 0,
) -> dict[str, Any]:
    memory = MemoryTier() if tier == "memory" else None
    stalls, durables, stats = [], [], []
    added = []
    keep = KeepLast(keep_last) if keep_last else None
    with SyncCheckpointEngine(
        root, staging=Staging(differential=differential), memory=memory, keep=keep
    ) as engine:
        first = engine.save(1, state, tier=tier)
        if tier == "disk":
            first.committed_sync()
        for step in range(2, saves + 1):
            before = disk_files(root)
            train(trained)
            t0 = time.perf_counter()
            handle = engine.save(step, state, tier=tier)
            stalls.append(time.perf_counter() - t0)
            if tier == "disk":
                stats.append(handle.committed_sync())
                durables.append(time.perf_counter() - t0)
            else:
                stats.append(handle.stats)
            added.append(added_since(root, before))
    out = {
        "stall_s": med(stalls),
        "stall_min_s": min(stalls),
        **added_figures(added),
        "copy_skipped_bytes": med([s.copy_skipped_bytes for s in stats]),
        "copy_fingerprint_s": med([s.copy_fingerprint_seconds for s in stats]),
    }
    if tier == "disk":
        out.update(
            durable_s=med(durables),
            bytes_written=stats[-1].bytes_written,  # the last save's, as added_bytes
            bytes_written_step_2=stats[0].bytes_written,
            bytes_written_total=sum(s.bytes_written for s in stats),
            bytes_skipped=stats[-1].bytes_skipped,
            files_linked=stats[-1].files_linked,
            fingerprint_s=med([s.fingerprint_seconds for s in stats]),
            # (absent before the trainer's digests reached the worker: 0)
            fingerprint_reused_bytes=med(
                [getattr(s, "fingerprint_reused_bytes", 0) for s in stats]
            ),
        )
    return out


def run_dcp(root: Path, state: dict, trained: list, saves: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    dcp.async_save(state, checkpoint_id=str(root / "1")).result()
    stalls, durables = [], []
    added = []
    for step in range(2, saves + 1):
        before = disk_files(root)
        train(trained)
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(root / str(step)))
        stalls.append(time.perf_counter() - t0)
        future.result()
        durables.append(time.perf_counter() - t0)
        added.append(added_since(root, before))
    return {
        "stall_s": med(stalls),
        "stall_min_s": min(stalls),
        "durable_s": med(durables),
        **added_figures(added),
    }


#: Tensor sizes for the copy-skip threshold (``--threshold-mb`` of them each).
THRESHOLD_KB = (4, 64, 256, 512, 1024, 4096)


def fingerprint_of(t: torch.Tensor) -> bytes:
    """As ``unchanged.CopySkipper`` fingerprints a CPU tensor: its bytes through NumPy."""
    from asyncckpt.staging.fingerprints import fingerprint_bytes

    return fingerprint_bytes(t.detach().reshape(-1).view(torch.uint8).numpy())


def threshold(total_mb: float, repeats: int) -> dict[str, Any]:
    """Where skipping a copy pays: per tensor size, ``total_mb`` of tensors copied by one
    ``torch._foreach_copy_`` (how staging copies those under ``SMALL_TENSOR_BYTES``) vs
    fingerprinted one by one as ``unchanged.CopySkipper`` does (a NumPy view and xxh3-128 each,
    on the copy pool). A skip spares the copy, never the fingerprint (an unchanged tensor is
    fingerprinted at every save; a changed one is fingerprinted, copied and fingerprinted from
    the slot), so it pays only where ``fingerprint_over_copy`` < 1. Medians of ``repeats``."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncckpt.staging.arenas import cpu_copy_threads

    threads = cpu_copy_threads()
    out: dict[str, Any] = {"copy_threads": threads, "total_bytes": int(total_mb * MiB), "sizes": {}}
    with ThreadPoolExecutor(threads) as pool:
        for kb in THRESHOLD_KB:
            n = max(1, int(total_mb * 1024 // kb))
            srcs = [torch.randn(kb * 256) for _ in range(n)]
            dsts = [torch.empty_like(t) for t in srcs]

            copies, hashes = [], []
            for _ in range(repeats + 1):  # the first of each: warm-up, dropped
                t0 = time.perf_counter()
                torch._foreach_copy_(dsts, srcs)
                copies.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                if threads > 1 and n > 1:
                    list(pool.map(fingerprint_of, srcs))
                else:
                    [fingerprint_of(t) for t in srcs]
                hashes.append(time.perf_counter() - t0)
            copy_s, hash_s = med(copies[1:]), med(hashes[1:])
            out["sizes"][str(kb)] = {
                "tensors": n,
                "copy_s": copy_s,
                "fingerprint_s": hash_s,
                "fingerprint_over_copy": ratio(hash_s, copy_s),
            }
            del srcs, dsts
    return out


METHODS = ("asyncckpt", "asyncckpt full", "dcp.async_save", "memory", "memory full")


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--policy-mb", type=float, default=64)
    p.add_argument("--frozen-mb", type=float, default=448)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--states", default="rl,rl_critic,lora")
    p.add_argument("--saves", type=int, default=4, help="saves per round (stall: after the 1st)")
    p.add_argument(
        "--methods", default=",".join(METHODS), help="a subset, comma-separated (A/B runs)"
    )
    p.add_argument("--threshold-mb", type=float, default=64, help="per size; 0: not measured")
    p.add_argument("--keep-last", type=int, default=0, help="keep=KeepLast(N); 0: keep=None")
    args = p.parse_args()
    methods = tuple(m for m in METHODS if m in args.methods.split(","))
    if args.quick:
        args.policy_mb, args.frozen_mb, args.repeats, args.saves = 4, 28, 1, 3
        args.threshold_mb = min(args.threshold_mb, 4)
    apply_threads(args)
    quiet_spawned_children()
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    results: dict[str, Any] = {"environment": environment(args.device), "states": {}}
    rows = []
    for name in filter(None, args.states.split(",")):  # none: --threshold-mb alone
        state, trained = STATES[name](args)
        size = nbytes(state)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
        for _ in range(args.repeats):
            for method in methods:
                root = args.dir / f"differential-{name}-{os.getpid()}"
                rmtree(root)
                root.mkdir(parents=True)
                try:
                    if method == "dcp.async_save":
                        runs[method].append(run_dcp(root, state, trained, args.saves))
                    else:
                        tier = "memory" if method.startswith("memory") else "disk"
                        differential = not method.endswith("full")
                        runs[method].append(
                            run_asyncckpt(
                                root,
                                state,
                                trained,
                                differential,
                                args.saves,
                                tier,
                                args.keep_last,
                            )
                        )
                finally:
                    rmtree(root)
                # Progress (the tables come at the end): where a run cut short had got to.
                print(f"[differential] {name} {method}: stall {runs[method][-1]['stall_s']:.3f} s",
                      flush=True)  # fmt: skip
        out: dict[str, Any] = {"state_bytes": size, "methods": {}}
        for method, rs in runs.items():
            m = {k: med([r[k] for r in rs]) for k in rs[0]}
            m["added_over_state"] = m["added_bytes"] / size
            m["step_2_added_over_state"] = m["added_bytes_step_2"] / size
            out["methods"][method] = m
            rows.append(
                [
                    name,
                    method,
                    m["added_over_state"],
                    m["step_2_added_over_state"],
                    m["added_bytes_total"] / MiB,
                    m["stall_s"],
                    m.get("durable_s", float("nan")),
                    m.get("copy_skipped_bytes", 0) / MiB,
                ]
            )
        ms = out["methods"]
        results["states"][name] = out
        if len(methods) < len(METHODS):
            continue  # a subset: no ratios between methods
        d, full, dcp_ = (ms[k]["durable_s"] for k in METHODS[:3])
        out["durable_vs_full"] = ratio(d, full)
        out["durable_vs_dcp_async_save"] = ratio(d, dcp_)
        out["stall_vs_full"] = ratio(ms["asyncckpt"]["stall_s"], ms["asyncckpt full"]["stall_s"])
        out["stall_vs_dcp_async_save"] = ratio(
            ms["asyncckpt"]["stall_s"], ms["dcp.async_save"]["stall_s"]
        )
        out["memory_stall_vs_full"] = ratio(ms["memory"]["stall_s"], ms["memory full"]["stall_s"])
    if args.threshold_mb > 0:
        results["threshold"] = threshold(args.threshold_mb, max(args.repeats, 5))
        print_table(
            f"copy skip threshold: {args.threshold_mb:g} MiB of tensors per size (median)",
            ["tensor KiB", "tensors", "foreach copy s", "fingerprint s", "fingerprint/copy"],
            [
                [kb, m["tensors"], m["copy_s"], m["fingerprint_s"], m["fingerprint_over_copy"]]
                for kb, m in results["threshold"]["sizes"].items()
            ],
        )
    rl = results["states"].get("rl")
    if rl is not None and "asyncckpt" in rl["methods"]:
        ms = rl["methods"]["asyncckpt"]
        added = ms["added_over_state"]  # the last save's: from step 3 on, the frozen part links
        results["target"] = {
            "added_over_state": added,
            "step_2_added_over_state": ms["step_2_added_over_state"],
            "target": 0.3,
            "met": added <= 0.3,
        }
    print_table(
        f"differential saves: the last of {args.saves} (median; keep-last {args.keep_last})",
        ["state", "method", "added/state", "step 2 added/state", "added MiB (saves 2-)",
         "stall s", "durable s", "not copied MiB"],
        rows,
    )  # fmt: skip
    for name, out in results["states"].items():
        for method, m in out["methods"].items():
            if "fingerprint_s" in m:
                print(
                    f"{name} {method}: durable {m['durable_s']:.3f} s, worker fingerprint "
                    f"{m['fingerprint_s']:.3f} s, digests reused "
                    f"{m['fingerprint_reused_bytes'] / MiB:.0f} MiB"
                )
        if "durable_vs_full" not in out:
            continue
        print(
            f"{name}: durable vs full {out['durable_vs_full']:.2f}x, "
            f"vs dcp.async_save {out['durable_vs_dcp_async_save']:.2f}x; stall vs full "
            f"{out['stall_vs_full']:.2f}x, vs dcp.async_save {out['stall_vs_dcp_async_save']:.2f}x;"
            f" memory save stall vs full {out['memory_stall_vs_full']:.2f}x"
        )
    tag = f"differential{args.tag}"
    write_json(args.out, tag, results)
    if not args.no_plot and len(methods) == len(METHODS):
        panels = []
        for name, out in results["states"].items():
            disk = list(METHODS[:3])
            panels.append(
                (
                    f"{name}: last save added / state",
                    disk,
                    [out["methods"][k]["added_over_state"] for k in disk],
                    0.3 if name == "rl" else None,
                )
            )
            panels.append(
                (
                    f"{name}: stall s",
                    list(METHODS),
                    [out["methods"][k]["stall_s"] for k in METHODS],
                    None,
                )
            )
        plot_bars(args.out / f"{tag}.png", "differential saves (the last save)", panels)


if __name__ == "__main__":
    main()

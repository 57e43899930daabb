"""Ranks: commit latency and worker memory against the number of ranks (one machine, gloo).

    python benchmarks/ranks.py [--ranks 2,4,8,16,32] [--saves 3] [--tensors 8]

For each world size N it starts N processes on this machine (gloo over a TCPStore), each with
its own engine (the engine's multi-rank commit: one checkpoint, every rank's shards) and a tiny
state (``--tensors`` tensors of 4 KiB per rank), and saves ``--saves`` times. Per save:

- commit latency: from the moment the *last* rank's ``save()`` returned to the moment rank 0
  sees the tracker name the step (rank 0 polls the tracker file; the ranks' clocks are this
  machine's one wall clock);
- worker memory: each rank's worker's RSS, USS and PSS (psutil) after the last save; rank 0's
  worker serves the side store and commits, so it is reported apart from the others; the PSS
  of every process (trainers and workers) is what N ranks cost the host;
- what one commit writes for N ranks: the size of the manifest and of DCP's ``.metadata``.

With 2 cores and N ranks (2N processes with the workers), the figures measure the design's
per-rank work more than any network: they show how it grows with N, not what a cluster sees.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

C.quiet_spawned_children()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, root: str, saves: int, tensors: int, q: Any):
    import torch.distributed as dist

    from asyncckpt import CheckpointEngine, Preemption
    from asyncckpt.core import layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = {
        "model": {f"r{rank}_w{i}": torch.full((1024,), float(rank)) for i in range(tensors)},
        "step": 0,
    }
    out: dict[str, Any] = {"rank": rank, "returned": [], "tracker": [], "durable": []}

    async def main() -> None:
        async with CheckpointEngine(root, preemption=Preemption(handle_sigterm=False)) as engine:
            for step in range(1, saves + 2):  # the first save starts the plans: reported apart
                state["step"] = step
                dist.barrier()
                t0 = time.time()
                handle = await engine.save(step, state)
                out["returned"].append(time.time())
                if rank == 0:  # the tracker names the step: committed for every rank
                    while layout.read_tracker(Path(root)) != step:
                        time.sleep(0.0005)
                    out["tracker"].append(time.time())
                await handle.committed()
                out["durable"].append(time.time() - t0)
            pid = engine.worker_pid
            mem = psutil.Process(pid).memory_full_info() if pid else None
            out["worker_rss"] = mem.rss if mem else None
            out["worker_uss"] = mem.uss if mem else None
            out["worker_pss"] = mem.pss if mem else None  # shared pages split among sharers
            out["trainer_rss"] = psutil.Process().memory_info().rss
            out["trainer_pss"] = psutil.Process().memory_full_info().pss
            if rank == 0:  # what one commit writes for N ranks: the manifest and DCP's metadata
                newest = Path(root) / layout.dir_name(engine.layout, saves + 1)
                out["manifest_bytes"] = (newest / layout.MANIFEST).stat().st_size
                out["dcp_metadata_bytes"] = (newest / ".metadata").stat().st_size

    asyncio.run(main())
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        q.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, args: Any, base: Path) -> dict[str, Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    root = base / f"n{world}"
    port = _free_port()
    t0 = time.perf_counter()
    procs = [
        ctx.Process(
            target=_rank_main, args=(r, world, port, str(root), args.saves, args.tensors, q)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        ranks = q.get(timeout=args.timeout)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    C.rmtree(root)
    latencies = []
    for i in range(1, args.saves + 1):  # save 0 (the first) left out
        last_return = max(r["returned"][i] for r in ranks)
        latencies.append(ranks[0]["tracker"][i] - last_return)
    others = [r for r in ranks if r["rank"] != 0]
    return {
        "ranks": world,
        "wall_s": time.perf_counter() - t0,
        "commit_latency_s": latencies,
        "commit_latency_min_s": min(latencies),
        "commit_latency_med_s": C.med(latencies),
        "first_commit_latency_s": ranks[0]["tracker"][0] - max(r["returned"][0] for r in ranks),
        "durable_med_s": C.med([d for r in ranks for d in r["durable"][1:]]),
        "rank0_worker_rss": ranks[0]["worker_rss"],
        "rank0_worker_uss": ranks[0]["worker_uss"],
        "rank0_worker_pss": ranks[0]["worker_pss"],
        "other_worker_pss_med": C.med([r["worker_pss"] for r in others]),
        # Every process of the run (trainers and workers): what N ranks cost this host.
        "total_pss": sum(r["worker_pss"] + r["trainer_pss"] for r in ranks),
        "other_worker_rss_med": C.med([r["worker_rss"] for r in others]),
        "other_worker_uss_med": C.med([r["worker_uss"] for r in others]),
        "trainer_rss_med": C.med([r["trainer_rss"] for r in ranks]),
        "manifest_bytes": ranks[0]["manifest_bytes"],
        "dcp_metadata_bytes": ranks[0]["dcp_metadata_bytes"],
    }


def main(argv: list[str] | None = None) -> dict:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4,8,16,32")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--tensors", type=int, default=8, help="4 KiB tensors per rank")
    # 32 ranks are 64 processes importing torch on this VM's 2 cores: minutes to start.
    p.add_argument("--timeout", type=float, default=2400)
    args = p.parse_args(argv)
    worlds = [int(n) for n in args.ranks.split(",") if n.strip()]
    if args.quick:
        worlds, args.saves = [2], 1
    base = args.dir / "ranks"
    C.rmtree(base)
    rows: list[dict[str, Any]] = []
    rep = {
        "environment": C.environment("cpu"),
        "saves": args.saves,
        "tensors_per_rank": args.tensors,
        "rows": rows,
    }
    for n in worlds:
        rows.append(measure(n, args, base))
        C.write_json(args.out, f"ranks{args.tag}", rep)  # each world size as it is measured
        r = rows[-1]
        print(
            f"{n} ranks: commit latency min {r['commit_latency_min_s']:.3f}s, "
            f"rank-0 worker USS {r['rank0_worker_uss'] / C.MiB:.0f} MiB ({r['wall_s']:.0f}s)",
            flush=True,
        )
    columns = {
        "ranks": "ranks",
        "commit_latency_min_s": "commit latency min s",
        "commit_latency_med_s": "commit latency med s",
        "durable_med_s": "durable med s",
        "manifest_bytes": "manifest bytes",
        "rank0_worker_uss": "rank-0 worker USS",
        "other_worker_uss_med": "other workers' USS (med)",
        "rank0_worker_pss": "rank-0 worker PSS",
        "other_worker_pss_med": "other workers' PSS (med)",
        "total_pss": "all processes' PSS",
        "rank0_worker_rss": "rank-0 worker RSS",
        "other_worker_rss_med": "other workers' RSS (med)",
    }

    memory = {
        "rank0_worker_uss",
        "other_worker_uss_med",
        "rank0_worker_rss",
        "other_worker_rss_med",
        "rank0_worker_pss",
        "other_worker_pss_med",
        "total_pss",
    }

    def cell(k: str, v: Any) -> Any:
        return f"{v / C.MiB:.0f} MiB" if k in memory and v is not None else v

    C.print_table(
        f"ranks — {args.tensors} x 4 KiB per rank, {args.saves} saves, load average at start "
        f"{rep['environment']['load_avg'][0]:.1f}",
        list(columns.values()),
        [[cell(k, r[k]) for k in columns] for r in rows],
    )
    path = C.write_json(args.out, f"ranks{args.tag}", rep)
    print(f"wrote {path}")
    C.rmtree(base)
    return rep


if __name__ == "__main__":
    main()

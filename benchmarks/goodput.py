"""Goodput under process failures: steps lost per trainer death, and what checkpointing costs.

A training loop (``--state-mb`` of state, a few matmuls per step) runs in a subprocess per
(config, kill step) and SIGKILLs itself right after step ``k`` (no exit handler runs: the
scheduler's kill, the OOM killer). Then a new engine (or DCP's loader) resumes from the root:
steps lost = ``k`` - the resumed step. Configs, in one run:

* ``none``: no checkpointing (the loop's own step time: the baseline of the overhead);
* ``disk``: ``save_every_steps=--disk-every`` (asyncckpt, to disk);
* ``memory+disk``: the same, plus ``memory_every_steps=--memory-every`` (``engine.due``);
* ``dcp.async_save``: torch's ``dcp.async_save`` every ``--disk-every`` steps (thread executor;
  the next one waits for the previous one, as its docs advise).

Reported per config: median and mean step time (save stalls included) and the overhead
against ``none``; per kill: the step resumed, steps lost, and the time from the trainer's death
to the commit the restart resumed from (a commit made by the orphaned worker after the death;
None if what it resumed from had committed before).

Node loss (``--node-kill K``, on by default at 155): two simulated nodes of one rank each
(torchrun's environment, gloo over a FileStore, one shared root), both running the loop to step
``K``; then node 1 is SIGKILLed whole (trainer and worker) and node 0's trainer after it, and a
single process resumes both ranks. Configs: ``disk``; ``memory+disk``; ``memory+disk+replicas``
(``MemoryTier(replicas=1)``). Reported per config: steps lost, and the mean step time and the
mean stall of a memory save (the time inside ``save``) on the two ranks; ``replication_cost``:
those of ``memory+disk+replicas`` over ``memory+disk``, in this one run (ratios, not timings
from another run). Whether the last memory save's replica was held at the kill is reported too
(``replicated_at_kill``): the kill does not wait for it (``--settle`` seconds after the last
step, 0 unless ``--quick``, whose steps take a millisecond).

End to end (``--e2e``, ``goodput_e2e.py``, its docstring has the model): a real trainer process
is SIGKILLed and a new process restarts on the same root; per strategy (disk; memory tier;
memory tier + hot resume; ``dcp.async_save`` + ``dcp.load``) the time from the kill to the
first step after resume (process + engine start, the load, the first step), the steps lost,
and the goodput of a run with a failure every ``M`` minutes (``--fail-every-min``; ``--plot``).
Its defaults: ``--state-mb 256 --step-ms 100 --kills 62,87 --disk-every 50 --memory-every 5``.

``python benchmarks/goodput.py [--state-mb 64 --matmul 1024 --kills 155,283 --disk-every 100
--memory-every 10 --node-kill 155]``; ``--quick`` for the tests (without the node-loss rows
unless ``--node-kill`` is given; ``--node-kill 0`` leaves them out). Writes
``results/goodput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import goodput_e2e
import torch

CONFIGS = ("none", "disk", "memory+disk", "dcp.async_save")
NODE_CONFIGS = ("disk", "memory+disk", "memory+disk+replicas")


def make_state(mb: int) -> dict:
    n = mb * (1 << 20) // 4 // 4
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"w{i}": torch.randn(n, generator=g) for i in range(4)},
        "step": torch.zeros((), dtype=torch.int64),
    }


def train_step(a: torch.Tensor, w: torch.Tensor, step_t: torch.Tensor, step: int) -> None:
    """One step of the loop: 4 chained matmuls, then the state changes (the head of ``w``, the
    step counter), so that every save has new bytes to write."""
    b = a
    for _ in range(4):
        b = (b @ a).tanh_()
    with torch.no_grad():
        w[: a.shape[0]].add_(b[0])
        step_t.fill_(step)


def child(args: argparse.Namespace) -> None:
    """The training loop: runs steps 1..kill, saving per its config, then SIGKILLs itself."""
    torch.set_num_threads(1)
    state = make_state(args.state_mb)
    a = torch.randn(args.matmul, args.matmul)
    root = Path(args.root)
    times: list[float] = []
    saved: list[int] = []  # the steps that saved (their stall is in their step time)
    skipped: list[int] = []  # of them, memory saves skipped (handle.skipped)
    engine = fut = None
    if args.config in ("disk", "memory+disk"):
        from asyncckpt import KeepLast, Schedule, SyncCheckpointEngine

        memory_every = args.memory_every if args.config == "memory+disk" else None
        engine = SyncCheckpointEngine(
            root,
            keep=KeepLast(2),
            schedule=Schedule(every_steps=args.disk_every, memory_every_steps=memory_every),
        )
        engine.__enter__()  # never left: the trainer dies inside
        engine.prepare(state)
    elif args.config == "dcp.async_save":
        import torch.distributed.checkpoint as dcp
    for step in range(1, args.kill + 1):
        t0 = time.perf_counter()
        train_step(a, state["model"]["w0"], state["step"], step)
        if engine is not None:
            tier = engine.due(step)
            if tier:
                handle = engine.save(step, state, tier=tier)
                saved.append(step)
                if handle.skipped:  # a memory save that found both slots busy: holds nothing
                    skipped.append(step)
        elif args.config == "dcp.async_save" and step % args.disk_every == 0:
            if fut is not None:
                fut.result()
            fut = dcp.async_save(state, checkpoint_id=str(root / f"step_{step}"))
            saved.append(step)
        times.append(time.perf_counter() - t0)
    report = {
        "step_seconds": times,
        "saved_steps": saved,
        "skipped_steps": skipped,
        "killed_at": time.time(),
    }
    print(json.dumps(report), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def rank_state(mb: int, rank: int) -> dict:
    """One rank's state on the simulated nodes: its own names (a single process resumes both)."""
    s = make_state(mb)
    return {"model": {f"r{rank}.{k}": v for k, v in s["model"].items()}, f"step{rank}": s["step"]}


def node_child(args: argparse.Namespace) -> None:
    """One rank of the node-loss loop: steps 1..kill, then a report, then it waits to be
    killed (its node, or the launcher's teardown)."""
    import torch.distributed as dist

    from asyncckpt import Distributed, KeepLast, MemoryTier, Schedule, SyncCheckpointEngine

    torch.set_num_threads(1)
    rank = args.rank
    dist.init_process_group("gloo", store=dist.FileStore(args.store, 2), rank=rank, world_size=2)
    state = rank_state(args.state_mb, rank)
    a = torch.randn(args.matmul, args.matmul)
    config = args.node_child
    engine = SyncCheckpointEngine(
        Path(args.root),
        keep=KeepLast(2),
        distributed=Distributed(timeout=60),
        memory=MemoryTier(replicas=1 if config.endswith("replicas") else 0),
        schedule=Schedule(
            every_steps=args.disk_every,
            memory_every_steps=args.memory_every if config != "disk" else None,
        ),
    )
    engine.__enter__()  # never left: the process is killed inside
    engine.prepare(state)
    times: list[float] = []
    stalls: list[float] = []  # memory saves: the time inside save()
    handle = None
    skipped: list[int] = []  # memory saves skipped for want of a free slot
    w = state["model"][f"r{rank}.w0"]
    for step in range(1, args.kill + 1):
        t0 = time.perf_counter()
        train_step(a, w, state[f"step{rank}"], step)
        tier = engine.due(step)
        if tier:
            s0 = time.perf_counter()
            h = engine.save(step, state, tier=tier)
            if tier == "memory":
                stalls.append(time.perf_counter() - s0)
                if h.skipped:  # no free slot: it holds nothing (the previous one stands)
                    skipped.append(step)
                else:
                    handle = h
        times.append(time.perf_counter() - t0)
    time.sleep(args.settle)  # --quick: steps of a millisecond; let the saves land first
    replicated = handle.is_replicated() if handle is not None else None
    report = {
        "step_seconds": times,
        "stalls": stalls,
        "worker_pid": engine.worker_pid,
        "replicated_at_kill": replicated,
        "memory_step_at_kill": handle.step if handle is not None else None,
        "memory_skipped": skipped,
    }
    print(json.dumps(report), flush=True)
    time.sleep(3600)


def run_node_loss(config: str, args: argparse.Namespace, scratch: Path) -> dict:
    """Two nodes of one rank to step ``--node-kill``; node 1 dies whole, then node 0's
    trainer; a single process resumes both ranks."""
    base = scratch / f"node_{config.replace('+', '_')}"
    base.mkdir()
    root = base / "root"
    procs, outs = {}, {}
    for r in range(2):
        cmd = [sys.executable, __file__, "--node-child", config, "--root", str(root)]
        cmd += ["--kill", str(args.node_kill), "--rank", str(r), "--store", str(base / "store")]
        for k in ("state_mb", "matmul", "disk_every", "memory_every", "settle"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        env = dict(os.environ, GROUP_RANK=str(r), LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
        outs[r] = base / f"rank{r}.out"
        # Files, not pipes: a worker inherits them and outlives its trainer.
        with open(outs[r], "w") as out, open(base / f"rank{r}.err", "w") as err:
            procs[r] = subprocess.Popen(
                cmd, stdout=out, stderr=err, env=env, start_new_session=True
            )  # a node = its trainer's process group (its worker included)
    try:
        deadline = time.monotonic() + 900
        while not all(outs[r].read_text().strip() for r in range(2)):
            for r in range(2):
                if procs[r].poll() is not None or time.monotonic() > deadline:
                    err = (base / f"rank{r}.err").read_text()[-3000:]
                    raise RuntimeError(f"node-loss {config}, rank {r}: {err}")
            time.sleep(0.05)
        reports = [json.loads(outs[r].read_text().splitlines()[-1]) for r in range(2)]
        os.killpg(procs[1].pid, signal.SIGKILL)  # node 1: its trainer and its worker
        procs[1].wait(60)
        goodput_e2e.wait_gone(reports[1]["worker_pid"], 60)
        procs[0].send_signal(signal.SIGKILL)  # then the launcher tears down node 0
        procs[0].wait(60)
        goodput_e2e.wait_gone(reports[0]["worker_pid"], 300)  # it writes what it can, then exits
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    from asyncckpt import SyncCheckpointEngine

    target = {**rank_state(args.state_mb, 0)}
    target["model"].update(rank_state(args.state_mb, 1)["model"])
    target["step1"] = torch.zeros((), dtype=torch.int64)
    step = None
    if root.exists():
        with SyncCheckpointEngine(root) as engine:
            step = engine.load_latest(target)
    if step is not None:
        assert int(target["step0"]) == int(target["step1"]) == step
    shutil.rmtree(base, ignore_errors=True)
    times = [t for rep in reports for t in rep["step_seconds"]]
    stalls = [t for rep in reports for t in rep["stalls"]]
    return {
        "kill_step": args.node_kill,
        "resumed_step": step,
        "steps_lost": args.node_kill - (step or 0),
        "step_seconds_mean": statistics.fmean(times),
        "memory_stall_s_mean": statistics.fmean(stalls) if stalls else None,
        "replicated_at_kill": [rep["replicated_at_kill"] for rep in reports],
        # The newest memory save each rank holds at the kill, and the ones it skipped (no free
        # slot while a disk write ran): with replicas, what a resume can reach.
        "memory_step_at_kill": [rep["memory_step_at_kill"] for rep in reports],
        "memory_skipped": [rep["memory_skipped"] for rep in reports],
    }


def node_loss_rows(args: argparse.Namespace, scratch: Path) -> dict:
    rows = {c: run_node_loss(c, args, scratch) for c in NODE_CONFIGS}
    plain, rep = rows["memory+disk"], rows["memory+disk+replicas"]
    cost = {
        "step_time_ratio": rep["step_seconds_mean"] / plain["step_seconds_mean"],
        "memory_stall_ratio": rep["memory_stall_s_mean"] / plain["memory_stall_s_mean"],
    }
    for c, r in rows.items():
        print(
            f"node loss {c:22s} steps lost {r['steps_lost']:4d}  step "
            f"{r['step_seconds_mean'] * 1e3:7.2f} ms  memory stall "
            f"{(r['memory_stall_s_mean'] or 0) * 1e3:6.2f} ms  replicated at the kill "
            f"{r['replicated_at_kill']}  memory saves skipped {r['memory_skipped']}"
        )
    print(
        f"replication cost (replicas=1 / 0, this run): step time x{cost['step_time_ratio']:.3f}"
        f", memory save stall x{cost['memory_stall_ratio']:.3f}"
    )
    return {"rows": rows, "replication_cost": cost}


def resume(config: str, root: Path, state_mb: int) -> tuple[int | None, float | None]:
    """(step resumed, its commit time) after the trainer's death."""
    if config == "none" or not root.exists():
        return None, None
    target = make_state(state_mb)
    if config == "dcp.async_save":
        import torch.distributed.checkpoint as dcp

        # Only a complete checkpoint (its .metadata, written last) loads.
        done = sorted(
            (int(p.name.split("_")[1]), p)
            for p in root.glob("step_*")
            if (p / ".metadata").exists()
        )
        if not done:
            return None, None
        step, path = done[-1]
        dcp.load(target, checkpoint_id=str(path))
        assert int(target["step"]) == step
        return step, (path / ".metadata").stat().st_mtime
    from asyncckpt import SyncCheckpointEngine

    with SyncCheckpointEngine(root) as engine:  # waits for the orphaned worker to finish
        step = engine.load_latest(target)
        if step is None:
            return None, None
        info = next(c for c in engine.list_checkpoints() if c.step == step)
    assert int(target["step"]) == step
    return step, info.committed_at


def run_one(config: str, kill: int, args: argparse.Namespace, scratch: Path) -> dict:
    root = scratch / f"{config.replace('+', '_').replace('.', '_')}_{kill}"
    cmd = [sys.executable, __file__, "--child", config, "--root", str(root), "--kill", str(kill)]
    for k in ("state_mb", "matmul", "disk_every", "memory_every"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    # Files, not pipes: the orphaned worker inherits them and outlives the trainer.
    with open(scratch / "child.out", "w") as out, open(scratch / "child.err", "w") as err:
        proc = subprocess.run(cmd, stdout=out, stderr=err, timeout=900)
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"{config}: {proc.returncode}\n{(scratch / 'child.err').read_text()}")
    report = json.loads((scratch / "child.out").read_text().splitlines()[-1])
    step, committed_at = resume(config, root, args.state_mb)
    times = report["step_seconds"]
    saved = set(report["saved_steps"])
    quiet = statistics.median(t for i, t in enumerate(times, 1) if i not in saved)
    after = committed_at is not None and committed_at > report["killed_at"]
    shutil.rmtree(root, ignore_errors=True)
    return {
        "kill_step": kill,
        "resumed_step": step,
        "steps_lost": kill - (step or 0),
        "death_to_commit_s": committed_at - report["killed_at"] if after else None,
        "step_seconds_median": statistics.median(times),
        "step_seconds_mean": statistics.fmean(times),
        # Paired: the mean step against this run's own steps that did not save (what the save
        # calls cost; not the background write's pull on the other steps: overhead_pct has it).
        "paired_overhead_pct": (statistics.fmean(times) / quiet - 1) * 100,
        "saves": len(saved),
        "steps": len(times),
        # The newest step a save returned holding (what a resume must reach, since a skipped
        # memory save holds nothing), and the memory saves skipped.
        "newest_saved_step": max(saved - set(report["skipped_steps"]), default=None),
        "skipped_steps": report["skipped_steps"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-mb", type=int, default=None, help="64 (--e2e: 256)")
    ap.add_argument("--matmul", type=int, default=1024, help="the step's square matmul size")
    ap.add_argument("--kills", default=None, help="steps after which the trainer dies")
    ap.add_argument("--disk-every", type=int, default=None, help="100 (--e2e: 50)")
    ap.add_argument("--memory-every", type=int, default=None, help="10 (--e2e: 5)")
    ap.add_argument("--e2e", action="store_true", help="the end-to-end rows: goodput_e2e.py")
    goodput_e2e.add_arguments(ap)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--dir", type=Path, default=Path(__file__).parent / ".scratch")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--node-kill", type=int, default=None, help="0: no node-loss rows")
    ap.add_argument(
        "--settle",
        type=float,
        default=0.0,
        help="node loss: seconds from the last step to the kill",
    )
    ap.add_argument("--child", choices=CONFIGS)
    ap.add_argument("--node-child", choices=NODE_CONFIGS)
    ap.add_argument("--root")
    ap.add_argument("--kill", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--store")
    args = ap.parse_args()
    if args.child:
        args.config = args.child
        return child(args)
    if args.node_child:
        return node_child(args)
    # The defaults of each mode (--e2e: a bigger state, saves and kills at the steps of a
    # 100 ms loop), unless given.
    defaults = (256, "62,87", 50, 5) if args.e2e else (64, "155,283", 100, 10)
    if args.quick:
        defaults = (8, "37", 20, 5) if args.e2e else (4, "37", 20, 5)
        args.matmul, args.settle, args.step_ms = 128, 3.0, 20.0
    for k, v in zip(("state_mb", "kills", "disk_every", "memory_every"), defaults, strict=True):
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.e2e:
        if args.auto is None:  # the auto rows take a while to measure: not in the tests'
            args.auto = "" if args.quick else ",".join(goodput_e2e.AUTO)
        return goodput_e2e.main(args)
    if args.node_kill is None:
        args.node_kill = 0 if args.quick else 155  # the tests ask for it on its own
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="goodput-", dir=args.dir))
    kills = [int(k) for k in args.kills.split(",")]
    results: dict = {}
    try:
        # Interleaved (every config at one kill step, then the next): the machine's load
        # drifts, and the overhead is a comparison between configs.
        for k in kills:
            for config in args.configs.split(","):
                results.setdefault(config, {"runs": []})["runs"].append(
                    run_one(config, k, args, scratch)
                )
        node_loss = node_loss_rows(args, scratch) if args.node_kill else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    base = statistics.fmean(r["step_seconds_mean"] for r in results["none"]["runs"])
    for config, res in results.items():
        runs = res["runs"]
        mean = statistics.fmean(r["step_seconds_mean"] for r in runs)
        lost = [r["steps_lost"] for r in runs]
        waits = [r["death_to_commit_s"] for r in runs if r["death_to_commit_s"] is not None]
        res.update(
            step_seconds_mean=mean,
            overhead_pct=(mean / base - 1) * 100,
            paired_overhead_pct=statistics.fmean(r["paired_overhead_pct"] for r in runs),
            steps_lost_mean=statistics.fmean(lost),
            death_to_commit_s_max=max(waits) if waits else None,
        )
        print(
            f"{config:15s} step {mean * 1e3:7.2f} ms  overhead {res['overhead_pct']:+6.1f}% "
            f"(paired {res['paired_overhead_pct']:+5.1f}%)  "
            f"steps lost {lost}  death -> commit {[round(w, 2) for w in waits]} s"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput.json").write_text(
        json.dumps(
            {
                "bench": "goodput",
                "state_mb": args.state_mb,
                "matmul": args.matmul,
                "kills": kills,
                "disk_every": args.disk_every,
                "memory_every": args.memory_every,
                "results": results,
                "node_kill": args.node_kill,
                "settle_s": args.settle,
                "node_loss": node_loss,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()

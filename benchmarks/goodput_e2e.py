"""Goodput end to end (issue 34, item 4): SIGKILL a real trainer, restart it, time the way back.

``python benchmarks/goodput.py --e2e`` runs this (``goodput.py``'s other rows simulate the
restart inside one process; here every trainer is a process of its own, as under a launcher).

Per strategy and kill step ``K`` (``--kills``), one run:

1. A trainer process (``--state-mb`` of float32 state in 4 tensors, one torch thread) trains
   steps 1, 2, ... Each step has a fixed compute time (``--step-ms``: it changes the head of
   every tensor, then sleeps out the rest of the step, the way a host waits on a GPU step), then
   saves per the strategy. What a save blocks (staging, back-pressure) adds to the step's
   time, so the step time is the fixed compute plus the saving overhead; the background write
   does not slow the sleep (no CPU contention is modelled: on a GPU machine the step runs on
   the device).
2. Once it reports step ``K`` the launcher (this process) SIGKILLs it (no exit handler runs).
   Steps done = the last step it reported; the kill can land a step or two after ``K``.
3. At once a new trainer process on the same root starts (a launcher's restart, without the
   scheduler's delay): imports, its state (zeros of the same shapes), the engine built and
   entered (one rank on a local root: it does not wait for the old worker; a load that
   reads what that worker still writes waits for it), ``load_latest``
   (or ``dcp.load`` of the newest directory with its ``.metadata``), one training step (no
   ``prepare``: it would wait for the new worker's start; the first save allocates). It
   reports each stage's end (wall clock), and afterwards checks the state it resumed bit for
   bit against the step it says it resumed (the initial state plus that many steps' changes).
   ``--load-before-start``: ``load_latest`` before entering the engine (the README's order);
   it does not wait for the old worker, so it can resume an older step than the one the old
   worker is still persisting (measured: see benchmarks/README.md).

Strategies: ``disk`` (asyncckpt, ``save_every_steps=--disk-every``); ``memory`` (the memory
tier: ``memory_every_steps=--memory-every`` + disk every ``--disk-every``; a new engine waits
for the orphaned worker to persist the newest memory save, then reads it from disk);
``memory+hot`` (the same with ``MemoryTier(hold_seconds=--hold)``: the new engine takes that
step from the surviving worker's shared memory, ``last_load_report.source == "memory"``);
``dcp.async_save`` (torch's, every ``--disk-every`` steps, thread executor, the next waits for
the previous; the restart loads with ``dcp.load``: the baseline).

Auto rows (``--auto``, all of ``AUTO`` by default, none with ``--quick``): the engine is told
the MTBF, ``Schedule(mtbf=60 M)``, one row per ``M``, and chooses its intervals itself from
``--disk-every`` (``auto``; ``auto+memory+hot``: and the memory tier every ``--memory-every``
with hot resume) once it has measured its saves. The trainer reports the intervals in effect
after each save; the launcher kills it at the same place in the chosen interval as a fixed
row's kill in its own (``KillAt``), counted from the first save made on intervals chosen from
measurements. Such a row is worth its goodput at its own ``M`` only: its step time is the
one on the chosen intervals (``step_s_run``: the whole first run's), and the warm-up on the
starting intervals (``warmup_s``: those steps' time over the chosen intervals' step time) is
charged at every failure, added to ``restart_s`` (``model_restart_s``): a restarted engine
measures anew. ``auto_vs_fixed``: per ``M``, the best auto row against every fixed row.

Measured per run: ``restart_s`` = kill -> first step after resume done, split into
``start_s`` (process start + engine start: kill -> interpreter up, torch imported, state
built, engine built and entered, the wait for the old worker included; ``process_s``: its
part up to the state built), ``load_s`` (``load_latest`` / ``dcp.load``) and
``first_step_s``; ``steps_lost`` = steps done - step resumed; ``step_s``: the first run's
mean step time (compute + saving overhead); ``source``: where the load read from.

The goodput model (Gemini, SOSP'23; Check-N-Run, NSDI'22): with a failure every ``M`` minutes
(``--fail-every-min``, a list), each interval of ``W = 60 M`` seconds of wall time spends
``restart_s`` getting back to training, then runs ``(W - restart_s) / step_s`` steps, of which
the last ``steps_lost`` are redone after the next failure. Goodput = the useful compute in it
over ``W``: ``max(0, (W - restart_s) / step_s - steps_lost) * step_compute / W`` (1.0: no
failure and no saving overhead). ``restart_s`` and ``steps_lost`` are the means over
``--kills``; spread the kills over the save interval for a mean that stands for a failure at
a random moment (the defaults: 12 and 37 steps after a disk save, 2 after a memory save).

Writes ``results/goodput_e2e.json`` (and ``goodput_e2e.png``, goodput against ``M`` per
strategy, with ``--plot``).
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
from typing import Any

import torch

STRATEGIES = ("disk", "memory", "memory+hot", "dcp.async_save")
#: The engine choosing its intervals (``Schedule(mtbf=M minutes)``), one row per ``M``: from
#: disk every ``--disk-every`` (``auto``), or that and the memory tier every ``--memory-every``
#: with hot resume (``auto+memory+hot``), until it has measured the saves.
AUTO = ("auto", "auto+memory+hot")
#: Elements at the head of every tensor a step changes (every shard file changes: a
#: differential save writes each one whole, as after a real step).
HEAD = 1024


def initial_state(mb: int) -> dict:
    n = mb * (1 << 20) // 4 // 4
    g = torch.Generator().manual_seed(0)
    return {
        "model": {f"w{i}": torch.randn(n, generator=g) for i in range(4)},
        "step": torch.zeros((), dtype=torch.int64),
    }


def blank_state(mb: int) -> dict:
    """The restarted trainer's state before it loads: the shapes, no values."""
    n = mb * (1 << 20) // 4 // 4
    return {
        "model": {f"w{i}": torch.zeros(n) for i in range(4)},
        "step": torch.zeros((), dtype=torch.int64),
    }


def compute(state: dict, step: int, step_s: float) -> None:
    """One step of fixed compute time: the state changes, then the rest of the step waits."""
    t0 = time.perf_counter()
    with torch.no_grad():
        for w in state["model"].values():
            w[:HEAD].add_(1.0)
        state["step"].fill_(step)
    time.sleep(max(0.0, step_s - (time.perf_counter() - t0)))


def expected_state(mb: int, step: int) -> dict:
    """The state after ``step`` steps, computed again (the check of a resume, bit for bit)."""
    state = initial_state(mb)
    for w in state["model"].values():
        head = w[:HEAD].clone()
        for _ in range(step):
            head.add_(1.0)
        w[:HEAD] = head
    state["step"].fill_(step)
    return state


def make_engine(args: argparse.Namespace) -> Any:
    from asyncckpt import KeepLast, MemoryTier, Schedule, SyncCheckpointEngine

    memory = args.strategy in ("memory", "memory+hot", "auto+memory+hot")
    hold = args.hold if args.strategy.endswith("+hot") else 0.0
    return SyncCheckpointEngine(
        Path(args.root),
        keep=KeepLast(2),
        memory=MemoryTier(hold_seconds=hold),
        schedule=Schedule(
            every_steps=args.disk_every,
            memory_every_steps=args.memory_every if memory else None,
            mtbf=args.mtbf if args.strategy in AUTO else None,
        ),
    )


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def train(args: argparse.Namespace) -> None:
    """The first trainer: steps until the launcher kills it."""
    torch.set_num_threads(1)
    state = initial_state(args.state_mb)
    root = Path(args.root)
    engine = fut = None
    if args.strategy == "dcp.async_save":
        import torch.distributed.checkpoint as dcp
    else:
        engine = make_engine(args)
        engine.__enter__()  # never left: the trainer dies inside
        engine.prepare(state)
    say("ready", worker=engine.worker_pid if engine is not None else None)
    for step in range(1, 1_000_000):
        t0 = time.perf_counter()
        compute(state, step, args.step_ms / 1e3)
        tier = None
        if engine is not None:
            tier = engine.due(step)
            if tier:
                engine.save(step, state, tier=tier)
        elif step % args.disk_every == 0:
            if fut is not None:
                fut.result()
            fut = dcp.async_save(state, checkpoint_id=str(root / f"step_{step}"))
        wall = time.perf_counter() - t0
        chosen = {}
        if tier and args.strategy in AUTO:  # the intervals in effect after this save
            st = engine.stats
            chosen = dict(
                tier=tier,
                disk_every=st.disk_every_steps,
                memory_every=st.memory_every_steps,
                measured=st.intervals_measured,
            )
        say("step", step=step, wall=wall, **chosen)


def newest_dcp(root: Path) -> tuple[int, Path] | None:
    """The newest complete ``dcp.async_save`` checkpoint (its ``.metadata`` is written last)."""
    done = sorted(
        (int(p.name.split("_")[1]), p) for p in root.glob("step_*") if (p / ".metadata").exists()
    )
    return done[-1] if done else None


def resume(args: argparse.Namespace) -> None:
    """The restarted trainer: the engine built and entered, ``load_latest``, one step; then
    the check (outside the timings). No ``prepare``: it would wait for the new worker's start
    before the first step (the first save allocates). ``--load-before-start``: the README's
    order instead (``load_latest`` before entering), which does not wait for the old worker."""
    torch.set_num_threads(1)
    state = blank_state(args.state_mb)
    say("up")
    engine = None
    if args.strategy == "dcp.async_save":
        import torch.distributed.checkpoint as dcp
    else:
        engine = make_engine(args)
        if not args.load_before_start:
            engine.__enter__()  # (a load that needs the old worker's writes waits for them)
    say("engine")
    source = "disk"
    if engine is None:
        newest = newest_dcp(Path(args.root))
        step = None
        if newest is not None:
            step = newest[0]
            dcp.load(state, checkpoint_id=str(newest[1]))
    else:
        step = engine.load_latest(state)
        source = engine.last_load_report.source if step is not None else "disk"
    if step is None:  # nothing to resume: the run starts again from its initial state
        for k, v in initial_state(args.state_mb)["model"].items():
            state["model"][k].copy_(v)
        source = "none"
    say(
        "loaded",
        step=step,
        source=source,
        dcp_imported="torch.distributed.checkpoint" in sys.modules,
    )
    if engine is not None and args.load_before_start:
        engine.__enter__()
    say("started")
    resumed = step or 0
    compute(state, resumed + 1, args.step_ms / 1e3)
    say("first_step")
    want = expected_state(args.state_mb, resumed + 1)
    same = all(
        torch.equal(state["model"][k], want["model"][k]) for k in want["model"]
    ) and torch.equal(state["step"], want["step"])
    say("checked", bit_for_bit=same)
    if engine is not None:
        engine.__exit__(None, None, None)


def wait_gone(pid: int, limit: float) -> None:
    """Until ``pid`` has exited (a worker that outlived its trainer: not our child)."""
    import psutil

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    raise RuntimeError(f"process {pid} still alive after {limit:.0f}s")


def events(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith("{")]


def child_cmd(args: argparse.Namespace, strategy: str, root: Path, phase: str) -> list[str]:
    cmd = [sys.executable, __file__, f"--{phase}", strategy, "--root", str(root)]
    for k in ("state_mb", "step_ms", "disk_every", "memory_every", "hold"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if strategy in AUTO:
        cmd += ["--mtbf", str(args.mtbf)]
    if args.load_before_start:
        cmd.append("--load-before-start")
    return cmd


class KillAt:
    """When the launcher kills: after step ``kill``; for an ``AUTO`` strategy, at the same
    place in the interval the engine chose (``kill``'s offset after a disk save over
    ``--disk-every``: 62 and 87 with 50 are 24% and 74% of the way to the next save), counted
    from the first save of the tier that protects the run (memory, else disk) made on the
    intervals chosen from measurements."""

    def __init__(self, strategy: str, kill: int, disk_every: int) -> None:
        self.auto = strategy in AUTO
        self.target: int | None = None if self.auto else kill
        self.fraction = (kill % disk_every) / disk_every or 0.5
        self.tier = "memory" if "memory" in strategy else "disk"
        self.measured_at: int | None = None  # the first save after which they were chosen

    def see(self, ev: dict) -> None:
        if not self.auto or self.target is not None or not ev.get("measured"):
            return
        if self.measured_at is None:
            self.measured_at = ev["step"]
            return
        # The engine may drop the memory tier (its saves cost about what disk saves do, see
        # docs/how-to/goodput.md): then the disk saves protect the run.
        tier = self.tier if ev.get("memory_every") else "disk"
        if ev["tier"] == tier:
            every = ev["memory_every" if tier == "memory" else "disk_every"]
            self.target = ev["step"] + max(1, round(self.fraction * every))

    def due(self, step: int) -> bool:
        return self.target is not None and step >= self.target


def run_one(strategy: str, kill: int, args: argparse.Namespace, scratch: Path) -> dict:
    root = scratch / f"{strategy.replace('+', '_').replace('.', '_')}_{kill}"
    killer = KillAt(strategy, kill, args.disk_every)
    out, err = scratch / "train.out", scratch / "train.err"
    # Files, not pipes: the orphaned worker inherits them and outlives the trainer.
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(child_cmd(args, strategy, root, "train"), stdout=o, stderr=e)
    deadline = time.monotonic() + 600
    seen, buf = 0, b""
    with open(out, "rb") as f:
        while not killer.due(seen):  # its steps as they come; the kill right after the target
            chunk = f.read()
            if not chunk:
                if proc.poll() is not None:
                    raise RuntimeError(f"{strategy}: the trainer stopped\n{err.read_text()}")
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(
                        f"{strategy}: no kill point after 600 s (at step {seen}; killed)\n"
                        f"{err.read_text()}"
                    )
                time.sleep(0.002)
                continue
            *lines, buf = (buf + chunk).split(b"\n")
            for ln in lines:
                if ln.startswith(b"{"):
                    ev = json.loads(ln)
                    seen = max(seen, ev.get("step", 0))
                    killer.see(ev)
    killed_at = time.time()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    trained = events(out)
    worker = trained[0]["worker"]
    steps = [ev for ev in trained if ev["event"] == "step"]
    done = steps[-1]["step"]
    rout, rerr = scratch / "resume.out", scratch / "resume.err"
    with open(rout, "w") as o, open(rerr, "w") as e:
        code = subprocess.run(
            child_cmd(args, strategy, root, "resume"), stdout=o, stderr=e, timeout=600
        ).returncode
    if code != 0:
        raise RuntimeError(f"{strategy}: the restart failed ({code})\n{rerr.read_text()}")
    if worker is not None:
        wait_gone(worker, 300)  # the old worker: taken, or persisted and gone
    ev = {e["event"]: e for e in events(rout)}
    shutil.rmtree(root, ignore_errors=True)
    resumed = ev["loaded"]["step"]
    auto = {}
    if killer.auto:  # the intervals chosen; the step time on them, and the warm-up's extra
        at = killer.measured_at
        assert at is not None
        tuned = statistics.fmean(s["wall"] for s in steps if s["step"] > at)
        last = [s for s in steps if "measured" in s][-1]
        auto = {
            "measured_at": at,
            "disk_every": last["disk_every"],
            "memory_every": last["memory_every"],
            "step_s_tuned": tuned,
            "warmup_s": sum(s["wall"] - tuned for s in steps if s["step"] <= at),
        }
    return {
        **auto,
        "kill_step": kill,
        "steps_done": done,
        "resumed_step": resumed,
        "steps_lost": done - (resumed or 0),
        "source": ev["loaded"]["source"],
        # whether the restarted trainer had imported torch.distributed.checkpoint (~1 s)
        "dcp_imported": ev["loaded"].get("dcp_imported"),
        "bit_for_bit": ev["checked"]["bit_for_bit"],
        "step_s": statistics.fmean(s["wall"] for s in steps),
        # kill -> trainer up (imports, state), engine built and entered (entered after the
        # load with --load-before-start)
        "start_s": ev["engine"]["t"] - killed_at + ev["started"]["t"] - ev["loaded"]["t"],
        "process_s": ev["up"]["t"] - killed_at,  # of start_s: up to the state built
        "load_s": ev["loaded"]["t"] - ev["engine"]["t"],
        "first_step_s": ev["first_step"]["t"] - ev["started"]["t"],
        "restart_s": ev["first_step"]["t"] - killed_at,
    }


def goodput(step_compute_s: float, step_s: float, restart_s: float, lost: float, w: float) -> float:
    """The fraction of ``w`` seconds between two failures spent on steps that count."""
    return max(0.0, (w - restart_s) / step_s - lost) * step_compute_s / w


def summarize(runs: list[dict], args: argparse.Namespace, told: float | None = None) -> dict:
    """A strategy's row. An ``AUTO`` row (``told``: the ``M`` its engine was told) is worth
    its goodput at that ``M`` only: its step time is the one on the intervals it chose
    (``step_s``; ``step_s_run``: the whole first run's), and each failure costs the warm-up
    on the starting intervals again (the restarted engine measures anew): ``warmup_s`` is
    added to ``restart_s`` in the model (``model_restart_s``)."""

    def mean(k: str) -> float:
        return statistics.fmean(r[k] for r in runs)

    row: dict[str, Any] = {
        k: mean(k) for k in ("step_s", "start_s", "load_s", "first_step_s", "restart_s")
    }
    row["steps_lost"] = mean("steps_lost")
    row["model_restart_s"] = row["restart_s"]
    minutes = args.minutes
    if told is not None:
        row["step_s_run"] = row["step_s"]
        row["step_s"] = mean("step_s_tuned")
        row["warmup_s"] = mean("warmup_s")
        row["model_restart_s"] += row["warmup_s"]
        row["disk_every"] = [r["disk_every"] for r in runs]
        row["memory_every"] = [r["memory_every"] for r in runs]
        minutes = [told]
    row["overhead_pct"] = (row["step_s"] / (args.step_ms / 1e3) - 1) * 100
    row["goodput"] = {
        str(m): goodput(
            args.step_ms / 1e3, row["step_s"], row["model_restart_s"], row["steps_lost"], m * 60
        )
        for m in minutes
    }
    return row


def auto_vs_fixed(rep: dict) -> dict:
    """Per ``M``: the best ``AUTO`` row's goodput against every fixed row's (the target: at
    least each of them - 0.005)."""
    out = {}
    for m in rep["fail_every_min"]:
        key = str(m)
        fixed = {n: r["goodput"][key] for n, r in rep["rows"].items() if n in STRATEGIES}
        auto = {n: r["goodput"][key] for n, r in rep["rows"].items() if key in r["goodput"]}
        auto = {n: g for n, g in auto.items() if n not in fixed}
        if not auto or not fixed:
            continue
        best = max(auto, key=auto.__getitem__)
        out[key] = {
            "best_auto": best,
            "best_auto_goodput": auto[best],
            "fixed": fixed,
            "met": all(auto[best] >= g - 0.005 for g in fixed.values()),
        }
    return out


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = rep["step_ms"] / 1e3
    ms = [2**i / 4 for i in range(11)]  # 15 s .. 4 h between failures
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    autos: dict[str, list[tuple[float, float]]] = {}
    for name, row in rep["rows"].items():
        if " M=" in name:  # an auto row: worth its goodput at the M its engine was told only
            ((m, g),) = row["goodput"].items()
            autos.setdefault(name.split(" M=")[0], []).append((float(m), g))
            continue
        ys = [goodput(step, row["step_s"], row["restart_s"], row["steps_lost"], m * 60) for m in ms]
        ax.plot(ms, ys, "o-" if name.startswith("memory") else "s--", label=name, markersize=3)
    for name, points in autos.items():
        at, gs = zip(*sorted(points), strict=True)
        ax.plot(at, gs, "*:", label=f"{name} (told M)", markersize=10)
    for m in rep["fail_every_min"]:
        ax.axvline(m, color="tab:gray", linewidth=0.6, linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("minutes between failures (M)")
    ax.set_ylabel("goodput (useful compute / wall time)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(f"goodput, SIGKILL + restart: {rep['state_mb']} MiB, steps of {rep['step_ms']} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> None:
    """The end-to-end rows (``goodput.py --e2e``): every strategy at each kill, interleaved."""
    args.minutes = [float(m) for m in str(args.fail_every_min).split(",")]
    import common

    bytecode = common.compile_bytecode()  # as installed: no process pays the compile
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="goodput-e2e-", dir=args.dir))
    kills = [int(k) for k in args.kills.split(",")]
    # Row name -> (strategy, M told or None): the fixed ones, then each auto one per M.
    plan: dict[str, tuple[str, float | None]] = {
        s: (s, None) for s in args.strategies.split(",") if s
    }
    for a in (a for a in (args.auto or "").split(",") if a):
        plan.update({f"{a} M={m:g}": (a, m) for m in args.minutes})
    runs: dict[str, list[dict]] = {name: [] for name in plan}
    try:
        for k in kills:  # interleaved: the machine's load drifts between runs
            for name, (s, m) in plan.items():
                args.mtbf = None if m is None else m * 60
                runs[name].append(run_one(s, k, args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = {name: summarize(runs[name], args, plan[name][1]) for name in plan}
    rep = {
        "bench": "goodput_e2e",
        "state_mb": args.state_mb,
        "step_ms": args.step_ms,
        "kills": kills,
        "disk_every": args.disk_every,
        "memory_every": args.memory_every,
        "hold_s": args.hold,
        "fail_every_min": args.minutes,
        "load_before_start": args.load_before_start,
        "load_average": os.getloadavg(),
        **bytecode,
        "rows": rows,
        "runs": runs,
    }
    rep["auto_vs_fixed"] = auto_vs_fixed(rep)
    print_table(rep)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "goodput_e2e.json").write_text(json.dumps(rep, indent=2) + "\n")
    if args.plot:
        plot(rep, args.out / "goodput_e2e.png")


def print_table(rep: dict) -> None:
    ms = rep["fail_every_min"]
    head = "| strategy | step ms (overhead) | start s | load s | first step s | kill -> training s "
    head += "| steps lost | " + " | ".join(f"goodput, M={m:g} min" for m in ms) + " |"
    print(head)
    print("|---" * (7 + len(ms)) + "|")
    for name, r in rep["rows"].items():
        cells = [
            name,
            f"{r['step_s'] * 1e3:.1f} ({r['overhead_pct']:+.1f}%)",
            f"{r['start_s']:.2f}",
            f"{r['load_s']:.2f}",
            f"{r['first_step_s']:.3f}",
            f"{r['restart_s']:.2f}",
            f"{r['steps_lost']:g}",
            *(f"{r['goodput'][str(m)]:.4f}" if str(m) in r["goodput"] else "-" for m in ms),
        ]
        print("| " + " | ".join(cells) + " |")
    for name, r in rep["rows"].items():
        if "warmup_s" in r:
            print(
                f"{name}: chose disk every {r['disk_every']}, memory every {r['memory_every']} "
                f"steps; warm-up {r['warmup_s']:.2f} s per failure; step on the whole first run "
                f"{r['step_s_run'] * 1e3:.1f} ms"
            )
    for m, c in rep.get("auto_vs_fixed", {}).items():
        fixed = ", ".join(f"{n} {g:.4f}" for n, g in c["fixed"].items())
        print(
            f"M={m}: best auto {c['best_auto']} {c['best_auto_goodput']:.4f} vs {fixed}: "
            f"{'met' if c['met'] else 'NOT met'} (>= every fixed row - 0.005)"
        )
    for name, runs in rep["runs"].items():
        for r in runs:
            print(
                f"{name}: kill at {r['kill_step']} (done {r['steps_done']}), resumed "
                f"{r['resumed_step']} from {r['source']}, bit for bit {r['bit_for_bit']}"
            )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The end-to-end options (``goodput.py`` takes them too)."""
    ap.add_argument("--step-ms", type=float, default=100.0, help="e2e: a step's compute time")
    ap.add_argument("--hold", type=float, default=60.0, help="e2e: memory+hot's hold_seconds")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument(
        "--auto",
        default=None,
        help="e2e: the auto strategies, one row per M (default: all; none with --quick)",
    )
    ap.add_argument("--fail-every-min", default="5,30,120", help="e2e: M, minutes per failure")
    ap.add_argument("--plot", action="store_true", help="e2e: goodput_e2e.png")
    ap.add_argument(
        "--load-before-start",
        action="store_true",
        help="e2e: the restart calls load_latest before entering the engine",
    )


def child_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", choices=STRATEGIES + AUTO)
    ap.add_argument("--resume", choices=STRATEGIES + AUTO)
    ap.add_argument("--mtbf", type=float, default=None)
    ap.add_argument("--root", required=True)
    ap.add_argument("--state-mb", type=int, required=True)
    ap.add_argument("--disk-every", type=int, required=True)
    ap.add_argument("--memory-every", type=int, required=True)
    add_arguments(ap)
    args = ap.parse_args()
    args.strategy = args.train or args.resume
    (train if args.train else resume)(args)


if __name__ == "__main__":
    child_main()

"""How fast a resume reads a checkpoint back (issue 34 items 2 and 3).

One committed checkpoint (default 1 GiB in 64 tensors) is read back, in rounds, by:

- ``asyncckpt``: a fresh ``SyncCheckpointEngine(root).load_latest(target)`` (checksums
  verified, in place into the target);
- ``asyncckpt in engine``: the same load called inside a running engine (``with engine:``,
  right after it started, its worker still starting), only ``load_latest`` timed: where loops
  and the Lightning plugin load;
- ``dcp.load``: plain ``torch.distributed.checkpoint.load`` of the same directory into a target
  of the same shapes;
- ``raw read``: every file of the checkpoint read sequentially (8 MiB reads into one buffer),
  and ``raw read xN``: the same bytes by N threads over ranges: what the disk gives.

Each round runs every method cold (the checkpoint's files dropped from the page cache with
``posix_fadvise(DONTNEED)`` before each) and warm (read once just before); the order of the
methods turns each round, and ratios are taken within a round, then the median over rounds.

The resume after a death (issue 34 item 1), in rounds of its own: a trainer process makes a
memory save of the same state and is SIGKILLed right after ``save()`` returned; its worker
writes it to disk. A new process then times ``SyncCheckpointEngine(root)`` to ``load_latest``
returned (imports and the target's allocation before the clock starts; ``load_latest`` before
the engine's ``start()``, which is timed after as ``start_seconds``; a step taken from memory
while the worker commits it is kept once ``load_latest`` found that commit done and checked,
so the wait for the commit is in ``load_latest``'s time), and checks the target bit for bit,
with
``MemoryTier(hold_seconds=60)`` in the dead trainer (``hot``: the worker offers the step from
its memory, while it commits it) and with ``hold_seconds=0`` (``disk``: the worker exits, the
step is read back from disk); each against a cold ``dcp.load`` of that step in the same round,
and against the median of those loads (the target's figure: ``resume_figures``).

Usage: ``python benchmarks/restore.py [--size-mb 1024] [--tensors 64] [--repeats 5]
[--device cuda] [--quick] [--no-resume]``; prints a table, writes ``results/restore.json`` and
``results/restore.png``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

C.quiet_spawned_children()

CHUNK = 8 * C.MiB
IN_ENGINE = "asyncckpt load_latest in engine"
PARALLEL = (2, 4)


def make_state(nbytes: int, tensors: int, device: str = "cpu") -> dict[str, Any]:
    numel = max(1, nbytes // 4 // tensors)
    g = torch.Generator().manual_seed(0)
    model = {f"layer{i}.w": torch.randn(numel, generator=g).to(device) for i in range(tensors)}
    return {"model": model, "step": 1}


def blank_like(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": -1}


def checkpoint_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def drop_page_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(files: list[Path]) -> None:
    buf = memoryview(bytearray(CHUNK))
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def raw_read_parallel(files: list[Path], threads: int) -> None:
    """The same bytes by ``threads`` threads, each a range of a file (8 MiB preads)."""
    jobs = []
    for f in files:
        size = f.stat().st_size
        step = max(CHUNK, -(-size // threads))
        jobs += [(f, start, min(size, start + step)) for start in range(0, size, step)]
    lock = threading.Lock()

    def worker() -> None:
        buf = memoryview(bytearray(CHUNK))
        while True:
            with lock:
                if not jobs:
                    return
                f, start, end = jobs.pop()
            fd = os.open(f, os.O_RDONLY)
            try:
                at = start
                while at < end:
                    got = os.preadv(fd, [buf[: min(CHUNK, end - at)]], at)
                    if got <= 0:
                        break
                    at += got
            finally:
                os.close(fd)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


#: The dead trainer of a resume round: a memory save, SIGKILLed once save() returned.
TRAINER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import restore as R
from asyncckpt import MemoryTier, SyncCheckpointEngine
root, size, tensors, hold = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
state = R.make_state(size, tensors, sys.argv[6])
engine = SyncCheckpointEngine(root, keep=None, memory=MemoryTier(hold_seconds=hold))
engine.__enter__()  # never left
engine.save(1, state, tier="memory")
os.kill(os.getpid(), signal.SIGKILL)
"""

#: The new process of a resume round: engine to load_latest returned, timed; then checked.
LOADER = """
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
import restore as R
# Imports before the clock. A load from disk imports DCP when it reads (the trainer does not
# import it with asyncckpt); a hot resume never does: goodput.py --e2e times the whole way.
import torch.distributed.checkpoint
from asyncckpt import SyncCheckpointEngine
root, size, tensors, device = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
target = R.blank_like(R.make_state(size, tensors, device))
t0 = time.perf_counter()
engine = SyncCheckpointEngine(root, keep=None)
# Before start(): a step the dead trainer's worker offers while committing it is taken
# without waiting for that commit; start() then waits for it and checks it committed.
step = engine.load_latest(target)
if device == "cuda":
    torch.cuda.synchronize()
seconds = time.perf_counter() - t0
report = engine.last_load_report
t1 = time.perf_counter()
engine.__enter__()
started = time.perf_counter() - t1
engine.__exit__(None, None, None)
want = R.make_state(size, tensors, device)["model"]
same = all(torch.equal(target["model"][k], v) for k, v in want.items())
print(json.dumps({"seconds": seconds, "start_seconds": started, "step": step,
                  "source": report.source,
                  "reason": report.source_reason, "bit_for_bit": same}))
"""


def resume_round(
    base: Path, size: int, tensors: int, hold: float, device: str = "cpu"
) -> tuple[dict, Path]:
    """A trainer killed after a memory save, then a new process's resume (its state and
    target on ``device``); its figures and the step's directory."""
    import json
    import subprocess

    root = base / f"resume-{hold:g}"
    C.rmtree(root)
    here = str(Path(__file__).resolve().parent)
    # The asyncckpt this script imports (a checkout's, not only an installed one).
    import asyncckpt

    repo = str(Path(asyncckpt.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    out = base / "resume.out"
    base.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as fh:  # a file: the orphaned worker inherits it
        code = subprocess.call(
            [sys.executable, "-c", TRAINER, here, str(root), str(size), str(tensors), str(hold)]
            + [device],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
        )
    if code != -9:
        raise SystemExit(f"the trainer of a resume round ended with {code}: {out.read_text()}")
    got = subprocess.run(
        [sys.executable, "-c", LOADER, here, str(root), str(size), str(tensors), device],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(got.stdout.strip().splitlines()[-1]), next(root.glob("global_step_*"))


def resume_rounds(base: Path, args: Any, target: dict[str, Any], dcp_load: Callable) -> dict:
    """``args.repeats`` rounds of a hot and a disk resume, each against a cold ``dcp.load`` of
    the step it resumed (in the same round)."""
    size = args.size_mb * C.MiB
    seconds: dict[str, list[float]] = {"hot": [], "disk": [], "dcp.load": []}
    ratios: dict[str, list[float]] = {"hot": [], "disk": []}
    runs = []
    for _ in range(args.repeats):
        for name, hold in (("hot", 60.0), ("disk", 0.0)):
            run, directory = resume_round(base, size, args.tensors, hold, args.device)
            files = checkpoint_files(directory)
            drop_page_cache(files)
            t0 = time.perf_counter()
            dcp_load(target, directory)
            cold = time.perf_counter() - t0
            seconds[name].append(run["seconds"])
            seconds["dcp.load"].append(cold)
            ratios[name].append(run["seconds"] / cold)
            runs.append({"name": name, **run, "cold_dcp_load_seconds": cold})
            C.rmtree(directory.parent)
    return resume_figures(seconds, ratios, runs)


def resume_figures(
    seconds: dict[str, list[float]], ratios: dict[str, list[float]], runs: list[dict]
) -> dict:
    """The resume rounds' figures. The target is taken against the median of every round's
    cold ``dcp.load`` (``*_vs_median_dcp_load``), the hot and the disk rounds' alike (the same
    state): one cold ``dcp.load`` ranged 0.86-1.28 s within an hour on a quiet VM, so a ratio
    over one round's load moved with its denominator. The per-round ratios stay beside it."""
    medians = {k: C.summary(v) for k, v in seconds.items()}  # (nan where no round ran)
    loads = medians["dcp.load"]["median"]
    return {
        "seconds": medians,
        "hot_vs_median_dcp_load": C.ratio(medians["hot"]["median"], loads),
        "disk_vs_median_dcp_load": C.ratio(medians["disk"]["median"], loads),
        "hot_vs_cold_dcp_load": C.summary(ratios["hot"]),
        "disk_vs_cold_dcp_load": C.summary(ratios["disk"]),
        "bit_for_bit": bool(runs) and all(r["bit_for_bit"] for r in runs),
        "runs": runs,
    }


def fresh_metadata_cache() -> None:
    """A fresh process has not read the checkpoint's ``.metadata`` yet: neither does a load
    here (asyncckpt keeps the last two in memory)."""
    from asyncckpt.formats import dcp as fdcp

    fdcp._METADATA_CACHE.clear()


def main() -> None:
    p = C.base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-resume", action="store_true", help="skip the resume-after-SIGKILL rounds")
    args = p.parse_args()
    C.apply_threads(args)
    if args.quick:
        args.size_mb, args.tensors, args.repeats = 16, 8, 2
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")

    import torch.distributed.checkpoint as dcp

    from asyncckpt import SyncCheckpointEngine

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    base = args.dir / "restore"
    C.rmtree(base)
    root = base / "ckpts"
    state = make_state(args.size_mb * C.MiB, args.tensors, device)
    with SyncCheckpointEngine(root) as engine:
        engine.save(1, state).committed_sync()
    directory = next(root.glob("global_step_*"))
    files = checkpoint_files(directory)
    nbytes = sum(f.stat().st_size for f in files)
    target = blank_like(state)
    del state

    def load_asyncckpt() -> None:
        fresh_metadata_cache()
        assert SyncCheckpointEngine(root).load_latest(target) == 1
        sync()

    def load_in_engine() -> float:
        fresh_metadata_cache()
        with SyncCheckpointEngine(root, keep=None) as engine:  # its worker starts meanwhile
            t0 = time.perf_counter()
            assert engine.load_latest(target) == 1
            sync()
            return time.perf_counter() - t0  # (not the start, nor the close)

    def load_dcp() -> None:
        dcp.load(target, checkpoint_id=str(directory), no_dist=True)
        sync()

    methods: dict[str, Callable[[], float | None]] = {
        "asyncckpt load_latest": load_asyncckpt,
        IN_ENGINE: load_in_engine,
        "dcp.load": load_dcp,
        "raw read": lambda: raw_read(files),
    }
    for n in PARALLEL:
        methods[f"raw read x{n}"] = lambda n=n: raw_read_parallel(files, n)
    times: dict[str, dict[str, list[float]]] = {
        mode: {m: [] for m in methods} for mode in ("cold", "warm")
    }
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for r in range(args.repeats):
            order = list(methods)
            order = order[r % len(order) :] + order[: r % len(order)]  # interleaved
            for mode in ("cold", "warm"):
                for name in order:
                    if mode == "cold":
                        drop_page_cache(files)
                    else:
                        raw_read(files)
                    t0 = time.perf_counter()
                    timed = methods[name]()
                    took = time.perf_counter() - t0 if timed is None else timed
                    times[mode][name].append(took)
    if args.no_resume:
        resume: dict[str, Any] = {"not measured": "--no-resume"}
    else:  # on CUDA: the dead trainer's state and the new process's target on the device
        resume = resume_rounds(
            base,
            args,
            target,
            lambda t, d: (dcp.load(t, checkpoint_id=str(d), no_dist=True), sync()),
        )
    C.rmtree(base)

    def ratios(mode: str, a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(times[mode][a], times[mode][b], strict=True)]

    ours = "asyncckpt load_latest"
    rows, result = [], {}
    for mode in ("cold", "warm"):
        vs_dcp = ratios(mode, ours, "dcp.load")
        vs_raw = ratios(mode, ours, "raw read")
        result[mode] = {
            "seconds": {m: C.summary(v) for m, v in times[mode].items()},
            "asyncckpt_vs_dcp_load": C.summary(vs_dcp),
            "in_engine_vs_dcp_load": C.summary(ratios(mode, IN_ENGINE, "dcp.load")),
            "asyncckpt_vs_raw_read": C.summary(vs_raw),
            "gb_per_s": {m: nbytes / C.med(v) / 1e9 for m, v in times[mode].items()},
        }
        for m in methods:
            s = result[mode]["seconds"][m]
            rows.append(
                [
                    f"{m} ({mode})",
                    s["median"],
                    s["min"],
                    s["max"],
                    C.med(ratios(mode, m, "dcp.load")),
                    C.med(ratios(mode, m, "raw read")),
                ]
            )
    for name, label in (
        ("hot", "new process, hot resume (memory)"),
        ("disk", "new process, resume from disk"),
    ):
        if name not in resume.get("seconds", {}):
            continue
        s = resume["seconds"][name]
        ratio = resume[f"{name}_vs_cold_dcp_load"]["median"]
        rows.append([f"{label} after SIGKILL", s["median"], s["min"], s["max"], ratio, ""])
    C.print_table(
        f"restore {nbytes / C.GiB:.2f} GiB, {args.tensors} tensors, {device}, "
        f"median of {args.repeats} (seconds)",
        ["method", "median", "min", "max", "x dcp.load", "x raw read"],
        rows,
    )
    targets = {
        "cold load_latest <= 1.0x cold dcp.load": {
            "target": "<= 1.0",
            "measured": result["cold"]["asyncckpt_vs_dcp_load"]["median"],
            "met": result["cold"]["asyncckpt_vs_dcp_load"]["median"] <= 1.0,
        },
        "cold load_latest inside the running engine <= 1.0x cold dcp.load": {
            "target": "<= 1.0",
            "measured": result["cold"]["in_engine_vs_dcp_load"]["median"],
            "met": result["cold"]["in_engine_vs_dcp_load"]["median"] <= 1.0,
        },
        "cold load_latest <= 1.1x raw sequential read": {
            "target": "<= 1.1",
            "measured": result["cold"]["asyncckpt_vs_raw_read"]["median"],
            "met": result["cold"]["asyncckpt_vs_raw_read"]["median"] <= 1.1,
        },
    }
    if "hot_vs_median_dcp_load" in resume:
        hot = resume["hot_vs_median_dcp_load"]
        targets["hot resume (new process) <= 0.35x cold dcp.load, bit for bit"] = {
            "target": "<= 0.35",
            "measured": hot,
            "met": hot <= 0.35 and resume["bit_for_bit"],
        }
    C.print_targets(targets, args.quick)
    tag = args.tag
    data = {
        "environment": C.environment(device),
        "bytes": nbytes,
        "tensors": args.tensors,
        "repeats": args.repeats,
        "device": device,
        "cold": result["cold"],
        "warm": result["warm"],
        "resume": resume,
        "targets": targets,
    }
    out = C.write_json(args.out, f"restore{tag}", data)
    print(f"written {out}")
    if not args.no_plot:
        labels = list(methods)
        panels = [
            (
                f"{mode} seconds (median)",
                labels,
                [result[mode]["seconds"][m]["median"] for m in labels],
                result[mode]["seconds"]["dcp.load"]["median"],
            )
            for mode in ("cold", "warm")
        ]
        if "seconds" in resume:
            names = ["hot", "disk", "dcp.load"]
            panels.append(
                (
                    "resume after SIGKILL, seconds (median)",
                    [
                        "asyncckpt hot (new process)",
                        "asyncckpt disk (new process)",
                        "dcp.load cold",
                    ],
                    [resume["seconds"][n]["median"] for n in names],
                    resume["seconds"]["dcp.load"]["median"],
                )
            )
        png = C.plot_bars(
            args.out / f"restore{tag}.png",
            f"restore of {nbytes / C.GiB:.2f} GiB ({device}); dashed: dcp.load",
            panels,
        )
        print(f"written {png}")


if __name__ == "__main__":
    main()

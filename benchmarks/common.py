"""Shared pieces of the benchmark suite: the state, the physical references, memory sampling,
multi-rank setup, and the output (rich table, JSON, PNG).

Every benchmark script imports this module by path (``benchmarks/`` is not a package), so keep
it free of side effects at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import json
import os
import platform
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCRATCH = HERE / ".scratch"
GiB = 1 << 30
MiB = 1 << 20


# ----------------------------------------------------------------------------- children
def quiet_spawned_children() -> None:
    """Drop INFO records in a process a benchmark spawned (call it at the script's top level).

    ``dcp.async_save``'s process executor sets the *root* logger to INFO and adds a handler of
    its own in its child (torch/distributed/checkpoint/logger.py ``_init_logger``), so every
    save printed several lines of torch's progress over the benchmark's table. The spawned
    child re-imports the script as ``__mp_main__``, so this runs there before torch's set-up;
    ``logging.disable`` is the public switch that a logger's own level cannot undo. The engine's
    worker never runs it (the engine hides ``__main__`` from its worker).
    """
    import logging
    import multiprocessing

    # parent_process() is still None while a spawned child imports its main module; its name
    # is already set.
    if multiprocessing.current_process().name != "MainProcess":
        logging.disable(logging.INFO)


# ----------------------------------------------------------------------------- arguments
def timing_row(label: str, seconds: dict[str, float], width: int) -> list:
    """A table row of median/min/max seconds, padded with empty cells to ``width`` columns."""
    row: list = [label, seconds["median"], seconds["min"], seconds["max"]]
    return row + [""] * (width - len(row))


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--dir",
        type=Path,
        default=SCRATCH,
        help="where checkpoints are written (deleted after each method); default %(default)s",
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON and PNG go here")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for the tests")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--tag", default="", help="suffix for the output file names")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    return p


def apply_threads(args: argparse.Namespace) -> None:
    """--threads, or 1 thread in --quick mode (tiny ops on a busy machine: no OpenMP waits)."""
    n = args.threads or (1 if args.quick else 0)
    if n:
        torch.set_num_threads(n)


# ----------------------------------------------------------------------------- multi-rank
@dataclass
class Rank:
    rank: int = 0
    world: int = 1
    distributed: bool = False

    @property
    def suffix(self) -> str:
        return f"_rank{self.rank}" if self.distributed else ""


def init_rank() -> Rank:
    """Under ``torchrun`` (RANK/WORLD_SIZE in the environment) join the gloo group.

    Each rank then benchmarks its own state into its own subdirectory and writes its own
    report; nothing is aggregated across ranks (keep it simple).
    """
    package_source()  # which code is measured: read now, before a long run, not at its end
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        r = Rank(dist.get_rank(), dist.get_world_size(), True)
        # Ranks share the cores: give each its share of intra-op threads.
        cores = len(psutil.Process().cpu_affinity() or [0])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", r.world))
        torch.set_num_threads(max(1, cores // local))
        return r
    return Rank()


def engine_kwargs(**kw: Any) -> dict[str, Any]:
    """CheckpointEngine arguments for a per-rank benchmark: each rank has its own root.

    Where the engine detects torch.distributed by itself, tell it to act as a world of one
    (the ranks do not share a checkpoint here; see "keep it simple" in the README).
    """
    import inspect

    from asyncckpt import CheckpointEngine, Preemption

    params = inspect.signature(CheckpointEngine.__init__).parameters
    kw.setdefault("preemption", Preemption(handle_sigterm=False))
    if "world_size" in params:
        kw.setdefault("world_size", 1)
    if "rank" in params:
        kw.setdefault("rank", 0)
    return kw


def barrier(rank: Rank) -> None:
    if rank.distributed:
        import torch.distributed as dist

        dist.barrier()


def shared_dir(args: argparse.Namespace, rank: Rank, name: str) -> Path:
    """The scratch folder every rank's checkpoints go under (one root per method, shared).

    A save of several ranks is one checkpoint: a root per rank is refused at the commit
    (``commit.every_rank_wrote``). Rank 0 empties the folder; the caller's next barrier orders
    that before any rank writes there.
    """
    path = args.dir / f"{name}_shared"
    if rank.rank == 0:
        rmtree(path)
    return path


def remove_shared(rank: Rank, root: Path) -> None:
    """Remove a shared root once every rank is done with it (barrier, then rank 0 deletes)."""
    barrier(rank)
    if rank.rank == 0:
        rmtree(root)


def ensure_single_rank_group(scratch: Path) -> None:
    """dcp.async_save's process executor needs an initialised process group (world of 1)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = scratch / f".pg-store-{os.getpid()}"
    store.unlink(missing_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


# ----------------------------------------------------------------------------- the state
def make_state(nbytes: int, device: str = "cpu", seed: int = 0) -> dict[str, Any]:
    """A model plus Adam state of about ``nbytes``: many tensors of mixed sizes.

    Transformer-like blocks (qkv, proj, fc1, fc2 matrices; biases and norms) and an embedding;
    the optimizer holds exp_avg, exp_avg_sq and a step per parameter, as ``Adam.state_dict()``
    does (plus param_groups, a non-tensor leaf).
    """
    g = torch.Generator().manual_seed(seed)
    h = 1024 if nbytes >= 512 * MiB else (256 if nbytes >= 16 * MiB else 64)
    shapes_per_block = [
        (3 * h, h),
        (3 * h,),
        (h, h),
        (h,),
        (h,),
        (h,),
        (4 * h, h),
        (4 * h,),
        (h, 4 * h),
        (h,),
        (h,),
        (h,),
    ]
    block = sum(_numel(s) for s in shapes_per_block) * 4 * 3  # param + 2 moments, fp32
    emb = (8 * h, h)
    n_blocks = max(1, round((nbytes - _numel(emb) * 12) / block))
    shapes = {"embed.weight": emb}
    names = ["qkv.w", "qkv.b", "proj.w", "proj.b", "ln1.w", "ln1.b"]
    names += ["fc1.w", "fc1.b", "fc2.w", "fc2.b", "ln2.w", "ln2.b"]
    for i in range(n_blocks):
        for name, s in zip(names, shapes_per_block, strict=True):
            shapes[f"blocks.{i}.{name}"] = s
    shapes["head.norm"] = (h,)

    # On a GPU the values are drawn there: 8 GiB of CPU randn took longer than the benchmark.
    if device != "cpu":
        g = torch.Generator(device=device).manual_seed(seed)

    def rnd(shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=g, device=device) * scale

    model = {k: rnd(s) for k, s in shapes.items()}
    optim_state = {}
    for i, (_k, s) in enumerate(shapes.items()):
        optim_state[i] = {
            "step": torch.tensor(float(seed + 1)),
            "exp_avg": rnd(s, 0.01),
            "exp_avg_sq": rnd(s, 0.001).abs_(),
        }
    param_groups = [
        {
            "lr": 1e-4,
            "betas": (0.9, 0.999),
            "eps": 1e-8,
            "weight_decay": 0.0,
            "amsgrad": False,
            "params": list(range(len(shapes))),
        }
    ]
    return {
        "model": model,
        "optim": {"state": optim_state, "param_groups": param_groups},
        "extra": {"step": 0, "rng": torch.get_rng_state()},
    }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def state_tensors(state: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(state)
    return out


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in state_tensors(state))


def bump_state(state: dict[str, Any], step: int) -> None:
    """Change every tensor between saves, as a training step does (in place, so the version
    counters move as an optimizer's do). With scalars alone changed, differential saves
    (``Staging(differential=)``) skipped copying and writing nearly every byte: the H200 run of
    2026-11-27 measured the device fingerprint instead of the copy, and links instead of the
    write (2.49x "the disk")."""
    state["extra"]["step"] = step
    tensors = [t for t in state_tensors(state) if t.numel()]
    with torch.no_grad():
        floats = [t for t in tensors if t.is_floating_point()]
        if floats:
            torch._foreach_add_(floats, 1.0)
        for t in tensors:
            if t.dtype == torch.bool:
                t.logical_not_()
            elif not t.is_floating_point():
                t.add_(1)
    for s in state["optim"]["state"].values():
        s["step"].fill_(float(step))


# ----------------------------------------------------------------------------- references
class CopyReference:
    """The physical reference for a stall: a copy of the same bytes into preallocated buffers.

    The buffers are allocated and touched once (warm), like staging arenas; on CUDA they are
    pinned and the copies are non-blocking device-to-host, synchronised once at the end.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.src = tensors
        cuda = any(t.is_cuda for t in tensors)
        self.cuda = cuda
        total = sum(t.numel() * t.element_size() for t in tensors)
        buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=cuda)
        buf.fill_(0)
        self.buf = buf
        self.views = []
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.views.append(buf[off : off + n].view(t.dtype).view(t.shape))
            off += n
        self.nbytes = total
        self.copy()  # warm

    def copy(self, threads: int | None = None) -> float:
        prev = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            t0 = time.perf_counter()
            for v, t in zip(self.views, self.src, strict=True):
                v.copy_(t, non_blocking=self.cuda)
            if self.cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(prev)

    def close(self) -> None:
        self.views, self.buf = [], None


def raw_write(buf: torch.Tensor, directory: Path, chunk: int = 8 * MiB) -> float:
    """Sequential write + fsync of ``buf``'s bytes to one file in ``directory``; seconds."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"raw-{os.getpid()}.bin"
    mv = memoryview(buf.numpy()).cast("B")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(mv), chunk):
            os.write(fd, mv[off : off + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def raw_write_parallel(buf: torch.Tensor, directory: Path, writers: int) -> float:
    """``buf``'s bytes cut in ``writers`` contiguous parts, each written + fsynced to a file of
    its own by a thread of its own (``os.write`` lets go of the GIL); seconds until all are
    durable. The disk's limit is the best of a few writer counts: one stream rarely fills an
    NVMe device or a striped filesystem, many may thrash a single disk."""
    import concurrent.futures as cf

    directory.mkdir(parents=True, exist_ok=True)
    mv = memoryview(buf.numpy()).cast("B")
    step = -(-len(mv) // writers)
    paths = [directory / f"raw-{os.getpid()}-{i}.bin" for i in range(writers)]

    def one(i: int) -> None:
        part = mv[i * step : (i + 1) * step]
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for off in range(0, len(part), 8 * MiB):
                os.write(fd, part[off : off + 8 * MiB])
            os.fsync(fd)
        finally:
            os.close(fd)

    with cf.ThreadPoolExecutor(writers) as pool:
        t0 = time.perf_counter()
        list(pool.map(one, range(writers)))
        dt = time.perf_counter() - t0
    for path in paths:
        path.unlink()
    return dt


# ----------------------------------------------------------------------------- memory
def system_used() -> int:
    vm = psutil.virtual_memory()
    return vm.total - vm.available


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    """(RSS of this process, RSS of its descendants); shared pages count in each mapping."""
    own = proc.memory_info().rss
    kids = 0
    for c in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            kids += c.memory_info().rss
    return own, kids


class Sampler:
    """Calls ``sample()`` every ``interval`` seconds in a thread while in its ``with`` block,
    and once more on leaving it (the subclasses keep the peaks)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> Any:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> Any:
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()
        self.sample()


class MemorySampler(Sampler):
    """Samples RSS (trainer, children) and system used memory in a thread; keeps the peaks.

    ``extra`` is the rise of system used memory (total - available) over the baseline taken at
    start: it counts shared-memory staging once and includes the workers' private memory.
    """

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(interval)
        self.proc = psutil.Process()
        self.base_used = system_used()
        self.base_rss = self.proc.memory_info().rss
        self.peak_rss = self.base_rss
        self.peak_children_rss = 0
        self.peak_used = self.base_used

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            own, kids = tree_rss(self.proc)
            self.peak_rss = max(self.peak_rss, own)
            self.peak_children_rss = max(self.peak_children_rss, kids)
            self.peak_used = max(self.peak_used, system_used())

    def report(self) -> dict[str, int]:
        return {
            "peak_rss_bytes": self.peak_rss,
            "peak_children_rss_bytes": self.peak_children_rss,
            "extra_memory_bytes": max(0, self.peak_used - self.base_used),
            "extra_rss_bytes": max(0, self.peak_rss - self.base_rss),
        }


# ----------------------------------------------------------------------------- misc
def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summary(xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": med(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratio(a: float, b: float) -> float:
    return a / b if b and b == b and a == a else float("nan")


def environment(device: str) -> dict[str, Any]:
    env = {
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_bytes": psutil.virtual_memory().total,
        "device": device,
        "load_avg": os.getloadavg(),
        **dict(package_source()),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
    return env


@functools.cache
def package_source() -> dict[str, Any]:
    """Which asyncckpt was measured: its path, and the repository commit if it is a checkout.

    ``asyncckpt_dirty`` lists uncommitted changes under asyncckpt/ in that checkout (figures for
    a clean commit: run with PYTHONPATH pointing at an export of it, e.g. ``git archive``).
    """
    import subprocess

    import asyncckpt

    pkg = Path(asyncckpt.__file__).resolve().parent
    out: dict[str, Any] = {"asyncckpt_path": str(pkg)}

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=pkg.parent, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    with contextlib.suppress(Exception):
        commit = git("rev-parse", "HEAD")
        if commit and (pkg.parent / ".git").exists():
            out["git_commit"] = commit
            out["asyncckpt_dirty"] = git("status", "--porcelain", "--", "asyncckpt").splitlines()
    return out


def compile_bytecode() -> dict[str, Any]:
    """Compile asyncckpt's bytecode as ``pip install`` does, before a benchmark times processes
    that import it.

    A checkout on ``PYTHONPATH`` or an editable install has no ``__pycache__`` until a first
    import writes it, and none at all where ``PYTHONDONTWRITEBYTECODE`` is set (it is on the
    project's build machines): every trainer and worker process then compiles the package's
    sources again, 0.3-0.4 s each on a 2-core machine, which an installed wheel never pays
    (torch's own bytecode is compiled at install). Returns what the report records.
    """
    import compileall

    import asyncckpt

    pkg = Path(asyncckpt.__file__).resolve().parent
    ok = bool(compileall.compile_dir(pkg, quiet=1, workers=1))
    return {
        "bytecode_compiled": ok,
        "dont_write_bytecode_env": bool(os.environ.get("PYTHONDONTWRITEBYTECODE")),
    }


def disk_free(path: Path) -> int:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free


def write_json(out: Path, name: str, data: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*[fmt(x) for x in r])
    Console(width=200).print(table)


def fmt_measured(x: Any) -> str:
    """A target's measured value as a person reads it: numbers rounded (``fmt``), lists and
    dicts of them likewise, booleans as yes/no."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (list, tuple)):
        return ", ".join(fmt_measured(v) for v in x)
    if isinstance(x, dict):
        return ", ".join(f"{k}={fmt_measured(v)}" for k, v in x.items())
    return fmt(x)


#: Under the targets table of a --quick run: its verdicts say nothing about the package.
QUICK_NOTE = (
    "--quick: tiny sizes on a busy machine, for the tests; the targets are judged on a full run "
    "(without --quick), so a 'no' here is expected and means nothing"
)


def print_targets(targets: dict[str, dict[str, Any]], quick: bool) -> None:
    """The targets table: goal, measured (rounded), met (yes/no); with the quick-run note."""
    print_table(
        "targets" + (" (--quick: not judged)" if quick else ""),
        ["target", "goal", "measured", "met"],
        [
            [k, v["target"], fmt_measured(v["measured"]), "yes" if v["met"] else "no"]
            for k, v in targets.items()
        ],
    )
    if quick:
        print(QUICK_NOTE)


def fmt(x: Any) -> str:
    if isinstance(x, float):
        if x != x:
            return "-"
        if abs(x) >= 100:
            return f"{x:.0f}"
        if abs(x) >= 1:
            return f"{x:.2f}"
        return f"{x:.3f}"
    return str(x)


def plot_bars(
    path: Path,
    title: str,
    panels: Sequence[tuple],
) -> Path:
    """One bar chart per panel: (ylabel, labels, values, reference line or None[, errors]).

    ``errors`` (one per bar, or None): the uncertainty the tables state beside the value, drawn
    as an error bar, so a difference within it does not read as a gain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6))
    if len(panels) == 1:
        axes = [axes]
    for ax, panel in zip(axes, panels, strict=True):
        ylabel, labels, values, ref = panel[:4]
        errors = panel[4] if len(panel) > 4 else None
        vals = [v if v == v else 0.0 for v in values]
        colors = ["tab:green" if lab.startswith("asyncckpt") else "tab:gray" for lab in labels]
        yerr = None if errors is None else [e if e == e else 0.0 for e in errors]
        ax.bar(range(len(vals)), vals, color=colors, yerr=yerr, capsize=4 if yerr else 0)
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        if ref is not None:
            ax.axhline(ref, color="tab:red", linestyle="--", linewidth=1)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@contextlib.contextmanager
def timed() -> Iterator[Callable[[], float]]:
    t0 = time.perf_counter()
    end: list[float] = []
    yield lambda: (end[0] if end else time.perf_counter()) - t0
    end.append(time.perf_counter())


@dataclass
class MethodResult:
    name: str
    kind: str  # "async" | "sync" | "reference"
    stalls: list[float] = field(default_factory=list)
    commits: list[float] = field(default_factory=list)
    throughputs: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

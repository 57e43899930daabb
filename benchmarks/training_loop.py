"""Step-time overhead of checkpointing in a real training loop.

    python benchmarks/training_loop.py [--saves 20] [--rounds 4] [--every N] [--trainer-threads T]
    torchrun --nproc-per-node 2 benchmarks/training_loop.py --quick

A small GPT-like transformer (larger on CUDA) trains on random tokens with AdamW and saves every
N steps. By default N comes from a measured asyncckpt write of the same state: one calibration
save (default throttle) while training steps run, N = ceil(--fit x (write + commit seconds) /
step seconds), at least --min-every, so that a write fits between saves; ``--every`` overrides.
The saves are split into ``--rounds`` rounds with the methods interleaved in each, so every
method is compared with a no-checkpoint run of the same minutes (the overhead is the mean of
the per-round ratios). For each method it reports the step-time overhead against a run without
checkpointing, and the slowdown of the steps that run while a write is in the background
against the steps of the same run that do not (the GIL and CPU dip users see with thread-based
async saves).
"""

from __future__ import annotations

import copy
import gc
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

C.quiet_spawned_children()

ALL_METHODS = [
    "none",
    "asyncckpt",
    "asyncckpt:offload",
    "asyncckpt:off",
    "dcp.async_save:thread",
    "dcp.async_save:process+shm-stager",
    "none:again",
]
#: Not run by default (pass --methods): the default throttle with the worker on the last core,
#: to separate the offload preset's levers (affinity vs nice 19 and idle I/O class).
EXTRA_METHODS = ["asyncckpt:background+last-core"]


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        layer = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        mask = torch.triu(torch.full((seq, seq), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def build(args: Any, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.d_model, args.layers, args.heads, args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


class Trainer:
    def __init__(self, args: Any, device: str) -> None:
        self.args = args
        self.device = device
        self.model, self.opt = build(args, device)
        g = torch.Generator().manual_seed(1)
        self.batches = [
            torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
            for _ in range(8)
        ]
        self.i = 0

    def step(self) -> float:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        t0 = time.perf_counter()
        logits = self.model(b[:, :-1])
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1)
        )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}

    def plain_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}


# ------------------------------------------------------------------------------ one run
def run_method(method: str, tr: Trainer, root: Path, args: Any) -> dict[str, Any]:
    """Train ``warmup + saves * every`` steps, saving every ``every`` steps after warmup.

    Each save opens its period (steps 0, every, 2 every, ...): every write, the last one too,
    has a full period of training steps running behind it, so its cost is in the figures.
    """
    if method.startswith("asyncckpt"):
        return _run_asyncckpt(method, tr, root, args)
    return _run_plain(method, tr, root, args)


def _record() -> dict[str, Any]:
    return {
        "step_seconds": [],
        "during_write": [],
        "save_step": [],
        "stalls": [],
        "rss_after_save": [],
        "worker_rss_after_save": [],
        "wait_seconds": [],
        "stage_seconds": [],
        "writes": [],
    }


def _run_asyncckpt(method: str, tr: Trainer, root: Path, args: Any) -> dict[str, Any]:
    import anyio

    from asyncckpt import CheckpointEngine

    kw = ASYNCCKPT_ENGINES[method]()
    rec = _record()
    rec["engine_kwargs"] = repr(kw)

    async def main() -> None:
        engine = CheckpointEngine(root, **C.engine_kwargs(**kw))
        async with engine:
            rec["throttle"] = repr(engine.throttle)
            await engine.prepare(tr.state())
            wproc = C.psutil.Process(engine.worker_pid)
            handle = None
            handles = []
            for _ in range(args.warmup):
                tr.step()
            for s in range(args.saves * args.every):
                busy = handle is not None and not handle.done()
                dt = tr.step()
                save = s % args.every == 0
                if save:
                    t0 = time.perf_counter()
                    handle = await engine.save(s, tr.state())
                    handles.append(handle)
                    stall = time.perf_counter() - t0
                    dt += stall
                    rec["stalls"].append(stall)
                    rec["wait_seconds"].append(handle.stats.wait_seconds)
                    rec["stage_seconds"].append(handle.stats.stage_seconds)
                    rec["rss_after_save"].append(C.psutil.Process().memory_info().rss)
                    rec["worker_rss_after_save"].append(wproc.memory_info().rss)
                rec["step_seconds"].append(dt)
                rec["during_write"].append(busy)
                rec["save_step"].append(save)
            await engine.wait()
            for h in handles:
                st = await h.committed()
                rec["writes"].append(st.write_seconds + st.commit_seconds)

    anyio.run(main)
    return rec


def _asyncckpt_engines() -> dict[str, Any]:
    def off() -> dict[str, Any]:
        from asyncckpt import ThrottleConfig

        return {"throttle": ThrottleConfig.off()}

    def last_core() -> dict[str, Any]:
        import dataclasses

        from asyncckpt import ThrottleConfig

        return {"throttle": dataclasses.replace(ThrottleConfig.background(), cpu_cores=1)}

    def offload() -> dict[str, Any]:
        from asyncckpt import ThrottleConfig

        return {"throttle": ThrottleConfig.for_optimizer_offload()}

    return {
        "asyncckpt": dict,  # the engine's default throttle (ThrottleConfig.background())
        "asyncckpt:offload": offload,
        "asyncckpt:off": off,  # no throttling (the default before ThrottleConfig.background)
        "asyncckpt:background+last-core": last_core,
    }


ASYNCCKPT_ENGINES = _asyncckpt_engines()


def calibrate_write(tr: Trainer, root: Path, rank: C.Rank) -> dict[str, Any]:
    """One asyncckpt save (default throttle) of the trainer's state while steps keep running.

    Returns the worker's write + commit seconds: the time a write needs in the conditions the
    benchmark saves in (training on the trainer's cores), which the save interval must cover.
    """
    import anyio

    from asyncckpt import CheckpointEngine

    out: dict[str, Any] = {}

    async def main() -> None:
        async with CheckpointEngine(root, **C.engine_kwargs()) as engine:
            await engine.prepare(tr.state())
            t0 = time.perf_counter()
            h = await engine.save(0, tr.state())
            steps = 0
            while not h.done():
                tr.step()
                steps += 1
            st = await h.committed()
            out.update(
                wall_seconds=time.perf_counter() - t0,
                write_seconds=st.write_seconds,
                commit_seconds=st.commit_seconds,
                steps_during=steps,
                throttle=repr(engine.throttle),
            )

    anyio.run(main)
    C.remove_shared(rank, root)
    return out


def rss_soak(
    tr: Trainer, root: Path, rank: C.Rank, saves: int, steps_between: int
) -> dict[str, Any]:
    """``saves`` saves on one engine (default throttle), a few training steps between each and
    every write committed before the next save: the RSS of the trainer and of the worker after
    each. Staging buffers are reused, so both must stay flat after the first save.
    """
    import anyio

    from asyncckpt import CheckpointEngine

    out: dict[str, Any] = {"trainer_rss": [], "worker_rss": []}

    async def main() -> None:
        async with CheckpointEngine(root, **C.engine_kwargs()) as engine:
            worker = C.psutil.Process(engine.worker_pid)
            for i in range(saves):
                for _ in range(steps_between):
                    tr.step()
                await (await engine.save(i, tr.state())).committed()
                out["trainer_rss"].append(C.psutil.Process().memory_info().rss)
                out["worker_rss"].append(worker.memory_info().rss)

    t0 = time.perf_counter()
    anyio.run(main)
    C.remove_shared(rank, root)
    tr_rss, w_rss = out["trainer_rss"], out["worker_rss"]
    out.update(
        saves=saves,
        seconds=time.perf_counter() - t0,
        # From the first save on: what the first save allocates (buffers, pools) is not growth.
        trainer_growth_bytes=tr_rss[-1] - tr_rss[0] if tr_rss else 0,
        worker_growth_bytes=w_rss[-1] - w_rss[0] if w_rss else 0,
    )
    return out


def _run_plain(method: str, tr: Trainer, root: Path, args: Any) -> dict[str, Any]:
    rec = _record()
    if method.startswith("none"):
        for _ in range(args.warmup):
            tr.step()
        for _ in range(args.saves * args.every):
            rec["step_seconds"].append(tr.step())
            rec["during_write"].append(False)
            rec["save_step"].append(False)
        return rec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    cuda = tr.device.startswith("cuda")
    process = "process" in method
    stager = None
    if process:
        C.ensure_single_rank_group(args.dir)
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=True,
                use_async_staging=False,
                use_non_blocking_copy=cuda,
            )
        )
    typ = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    import torch.distributed as dist

    no_dist = not dist.is_initialized()
    fut = None
    prev = root
    try:
        for _ in range(args.warmup):
            tr.step()
        for s in range(args.saves * args.every):
            busy = fut is not None and not fut.done()
            dt = tr.step()
            save = s % args.every == 0
            if save:
                if fut is not None:
                    t0 = time.perf_counter()
                    fut.result()  # back-pressure: one save in flight, like asyncckpt
                    dt += time.perf_counter() - t0
                    if no_dist or dist.get_rank() == 0:  # the shared checkpoint, once
                        C.rmtree(prev)
                t0 = time.perf_counter()
                prev = root / f"step{s}"
                fut = dcp.async_save(
                    tr.plain_state(),
                    checkpoint_id=str(prev),
                    async_checkpointer_type=typ,
                    async_stager=stager,
                    no_dist=no_dist,
                )
                if hasattr(fut, "upload_completion"):
                    fut = fut.upload_completion
                stall = time.perf_counter() - t0
                dt += stall
                rec["stalls"].append(stall)
                rec["rss_after_save"].append(C.psutil.Process().memory_info().rss)
            rec["step_seconds"].append(dt)
            rec["during_write"].append(busy)
            rec["save_step"].append(save)
        if fut is not None:
            fut.result()
    finally:
        if stager is not None:
            stager.close()
    return rec


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> dict:
    p = C.base_parser(__doc__.splitlines()[0])
    p.add_argument("--saves", type=int, default=20)
    p.add_argument(
        "--every",
        type=int,
        default=0,
        help="save every N steps (0: from a calibration save, see --fit and --min-every)",
    )
    p.add_argument(
        "--fit",
        type=float,
        default=1.5,
        help="auto N: the save interval covers this many measured writes (default %(default)s)",
    )
    p.add_argument("--min-every", type=int, default=10, help="auto N: at least this many steps")
    p.add_argument(
        "--trainer-threads",
        type=int,
        default=0,
        help="torch intra-op threads of the trainer (0: --threads, else 1 on CPU, torch's "
        "default on CUDA); recorded in the JSON",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="split the saves into this many rounds, methods interleaved per round "
        "(in reverse order every other round)",
    )
    p.add_argument("--d-model", type=int, default=0)
    p.add_argument("--layers", type=int, default=0)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--methods", default=",".join(ALL_METHODS))
    args = p.parse_args(argv)
    rank = C.init_rank()
    cuda = args.device == "cuda"
    args.trainer_threads = args.trainer_threads or args.threads or (0 if cuda else 1)
    if args.trainer_threads:
        torch.set_num_threads(args.trainer_threads)
    args.trainer_threads = torch.get_num_threads()
    if cuda:
        torch.cuda.set_device(rank.rank % torch.cuda.device_count())
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    defaults = (1024, 12, 16) if cuda else (384, 4, 4)
    if args.quick:
        defaults = (64, 2, 4)
        args.vocab, args.seq, args.saves, args.warmup = 512, 32, min(args.saves, 3), 2
        args.rounds = min(args.rounds, 2)
    args.d_model = args.d_model or defaults[0]
    args.layers = args.layers or defaults[1]
    args.batch = args.batch or defaults[2]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in ALL_METHODS + EXTRA_METHODS:
            p.error(f"unknown method {m!r}; expected some of {ALL_METHODS + EXTRA_METHODS}")

    base = args.dir / f"training_loop{rank.suffix or '_rank0'}"  # this rank's raw write
    C.rmtree(base)
    base.mkdir(parents=True)
    shared = C.shared_dir(args, rank, "training_loop")  # the checkpoints: one root per method
    C.barrier(rank)
    tr = Trainer(args, device)
    state_bytes = C.state_nbytes(tr.plain_state())
    for _ in range(args.warmup):
        tr.step()  # fills the AdamW state, so the state has its full size
    state_bytes = C.state_nbytes(tr.plain_state())
    step_s = C.med([tr.step() for _ in range(5)])
    host = torch.empty(state_bytes, dtype=torch.uint8)
    host.fill_(1)
    raw = C.raw_write(host, base)
    del host
    calib = calibrate_write(tr, shared / "calibration", rank)
    write_s = calib["write_seconds"] + calib["commit_seconds"]
    auto_every = max(args.min_every, math.ceil(args.fit * write_s / step_s))
    every_source = "--every" if args.every else "calibration"
    args.every = args.every or auto_every
    calib.update(
        write_plus_commit_seconds=write_s,
        auto_every=auto_every,
        rule=f"N = max({args.min_every}, ceil({args.fit} x write+commit / step))",
        every_source=every_source,
    )
    nparams = sum(p.numel() for p in tr.model.parameters())
    print(
        f"[rank {rank.rank}] model {nparams / 1e6:.1f}M params, state {state_bytes / 2**20:.0f} MiB, "
        f"{args.trainer_threads} trainer thread(s), step {step_s * 1e3:.0f} ms, raw write "
        f"{raw:.2f}s, calibration save: write+commit {write_s:.2f}s -> {calib['rule']} = "
        f"{auto_every}; save every {args.every} steps ({every_source})",
        flush=True,
    )
    # Rounds: every method runs saves/rounds saves per round, methods interleaved, so each
    # method's steps sit next to a no-checkpoint run of the same minutes (this VM drifts by
    # 5-10% over a few minutes, more than the 3% being measured).
    rounds = max(1, min(args.rounds, args.saves))
    per_round = math.ceil(args.saves / rounds)
    round_args = copy.copy(args)
    round_args.saves = per_round
    runs: dict[str, Any] = {}
    for r in range(rounds):
        # Every other round in reverse: a drift over a round weighs on no method's side.
        for m in methods if r % 2 == 0 else methods[::-1]:
            C.barrier(rank)
            root = shared / m.replace(":", "_").replace("+", "_")
            gc.collect()
            t0 = time.perf_counter()
            with C.MemorySampler() as mem:
                rec = run_method(m, tr, root, round_args)
            rec["method_seconds"] = time.perf_counter() - t0
            rec["memory"] = mem.report()
            C.remove_shared(rank, root)  # every rank's part committed before the root goes
            _merge_round(runs.setdefault(m, {"rounds": []}), rec)
            print(
                f"[rank {rank.rank}] round {r + 1}/{rounds} {m}: mean step "
                f"{C.statistics.fmean(rec['step_seconds']) * 1e3:.1f} ms",
                flush=True,
            )
    args.rounds, args.saves_per_round, args.saves = rounds, per_round, rounds * per_round
    soak = None
    if "asyncckpt" in methods:
        soak = rss_soak(tr, shared / "rss_soak", rank, args.saves, steps_between=2)
        print(
            f"[rank {rank.rank}] RSS over {args.saves} saves on one engine: trainer "
            f"{soak['trainer_growth_bytes'] / C.MiB:+.1f} MiB, worker "
            f"{soak['worker_growth_bytes'] / C.MiB:+.1f} MiB",
            flush=True,
        )
    C.rmtree(base)
    C.remove_shared(rank, shared)
    report = build_report(args, rank, nparams, state_bytes, step_s, raw, runs, soak)
    report["calibration"] = calib
    name = f"training_loop{args.tag}{rank.suffix}"
    path = C.write_json(args.out, name, report)
    print_report(report)
    if not args.no_plot:
        plot(report, args.out / f"{name}.png")
    print(f"wrote {path}")
    C.barrier(rank)
    return report


def _merge_round(run: dict[str, Any], rec: dict[str, Any]) -> None:
    """Append one round's record to a method's run (lists concatenated, memory per round)."""
    run["rounds"].append(
        {"mean_step_seconds": _mean(rec["step_seconds"]), "memory": rec.pop("memory")}
    )
    for k, v in rec.items():
        if isinstance(v, list):
            run.setdefault(k, []).extend(v)
        elif isinstance(v, (int, float)) and k.endswith("seconds"):
            run[k] = run.get(k, 0.0) + v
        else:
            run[k] = v
    run["memory"] = run["rounds"][0]["memory"] | {"per_round": [x["memory"] for x in run["rounds"]]}


def _rss_growth(rss: list[int], rounds: int) -> int:
    if not rss:
        return 0
    n = len(rss) // rounds
    parts = [rss[i * n : (i + 1) * n] for i in range(rounds)] if n else [rss]
    return max((p[-1] - p[0] for p in parts if p), key=abs)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def build_report(args, rank, nparams, state_bytes, step_s, raw, runs, soak=None) -> dict:
    base_runs = [r for m, r in runs.items() if m.startswith("none")]
    base_steps = [x for r in base_runs for x in r["step_seconds"]]
    base_mean = _mean(base_steps)
    n_rounds = len(next(iter(runs.values()))["rounds"])
    # Per round: the mean step of the no-checkpoint runs of that round.
    base_by_round = [
        _mean([r["rounds"][i]["mean_step_seconds"] for r in base_runs]) for i in range(n_rounds)
    ]
    methods = {}
    for m, r in runs.items():
        steps = r["step_seconds"]
        busy = [
            x
            for x, b, s in zip(steps, r["during_write"], r["save_step"], strict=True)
            if b and not s
        ]
        quiet = [
            x
            for x, b, s in zip(steps, r["during_write"], r["save_step"], strict=True)
            if not b and not s
        ]
        mean = _mean(steps)
        by_round = [
            100 * (x["mean_step_seconds"] / b - 1)
            for x, b in zip(r["rounds"], base_by_round, strict=True)
        ]
        e = {
            "steps": len(steps),
            "saves": len(r["stalls"]),
            "mean_step_seconds": mean,
            "median_step_seconds": C.med(steps),
            # Paired: each round against that round's no-checkpoint runs, then averaged.
            "overhead_pct": _mean(by_round),
            # Standard error of that mean: how far the rounds' spread leaves it uncertain.
            "overhead_sem_pct": C.statistics.stdev(by_round) / math.sqrt(len(by_round))
            if len(by_round) > 1
            else float("nan"),
            "overhead_pooled_pct": 100 * (mean / base_mean - 1),
            "overhead_by_round_pct": by_round,
            "overhead_vs_own_quiet_steps_pct": 100 * (mean / _mean(quiet) - 1)
            if quiet
            else float("nan"),
            "steps_during_write": len(busy),
            "mean_step_during_write_seconds": _mean(busy),
            "mean_step_quiet_seconds": _mean(quiet),
            "during_write_slowdown_pct": 100 * (_mean(busy) / _mean(quiet) - 1)
            if busy and quiet
            else float("nan"),
            "during_write_slowdown_vs_baseline_pct": 100 * (_mean(busy) / base_mean - 1)
            if busy
            else float("nan"),
            "stall_seconds": C.summary(r["stalls"]),
            "backpressure_wait_seconds": C.summary(r["wait_seconds"]),
            "stage_seconds": C.summary(r["stage_seconds"]),
            "write_commit_seconds": C.summary(r["writes"]),
            "memory": r["memory"],
            "rss_after_save": r["rss_after_save"],
            "worker_rss_after_save": r.get("worker_rss_after_save", []),
            # Within each engine's lifetime (a round); across rounds other methods run in the
            # same process and move its RSS. The largest growth of any round is reported.
            "rss_growth_bytes": _rss_growth(r["rss_after_save"], len(r["rounds"])),
            "method_seconds": r["method_seconds"],
            "step_seconds": steps,
            "during_write": r["during_write"],
        }
        if "throttle" in r:
            e["throttle"] = r["throttle"]
        methods[m] = e
    targets = {}
    # The issues' targets: on CUDA the trainer's CPU is mostly idle, so they are tighter.
    lim, lim_write = (2, 3) if str(args.device).startswith("cuda") else (3, 5)
    for m in ("asyncckpt", "asyncckpt:offload"):
        if m in methods:
            e = methods[m]
            paired = e["overhead_vs_own_quiet_steps_pct"]
            targets[m] = {
                # Paired: every step of the run against the same run's steps with no write in
                # flight, seconds apart; immune to the machine's drift between runs.
                "overhead_paired_pct": {
                    "target": f"<= {lim} (vs the same run's steps with no write in flight)",
                    "measured": paired,
                    "met": paired <= lim,
                },
                # A/B: against the no-checkpoint runs of the same round, minutes apart.
                "overhead_pct": {
                    "target": f"<= {lim} (vs the no-checkpoint runs of the same rounds)",
                    "measured": e["overhead_pct"],
                    "met": e["overhead_pct"] <= lim,
                },
                "during_write_slowdown_pct": {
                    "target": f"<= {lim_write}",
                    "measured": e["during_write_slowdown_pct"],
                    "met": e["during_write_slowdown_pct"] <= lim_write,
                },
            }
    if soak is not None and "asyncckpt" in targets:
        growth = max(soak["trainer_growth_bytes"], soak["worker_growth_bytes"], key=abs)
        targets["asyncckpt"]["rss_flat"] = {
            "target": f"RSS flat across {soak['saves']} saves on one engine (< 64 MiB growth, "
            "trainer and worker)",
            "measured": growth,
            "met": abs(growth) < 64 * C.MiB,
        }
    return {
        "benchmark": "training_loop",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rank": rank.rank,
        "world_size": rank.world,
        "environment": C.environment(args.device),
        "model_params": nparams,
        "state_bytes": state_bytes,
        "step_seconds_calibration": step_s,
        "raw_write_seconds": raw,
        "save_every_steps": args.every,
        "trainer_threads": args.trainer_threads,
        "baseline_mean_step_seconds": base_mean,
        "baseline_mean_step_seconds_by_round": base_by_round,
        "rounds": n_rounds,
        "rss_soak": soak,
        "methods": methods,
        "targets": targets,
    }


def print_report(rep: dict) -> None:
    cols = [
        "method",
        "mean step ms",
        "overhead %",
        "± sem",
        "steps in write",
        "step in write ms",
        "slowdown in write %",
        "stall med s",
        "RSS growth MiB",
    ]
    rows = []
    for m, e in rep["methods"].items():
        rows.append(
            [
                m,
                e["mean_step_seconds"] * 1e3,
                e["overhead_pct"],
                e["overhead_sem_pct"],
                e["steps_during_write"],
                e["mean_step_during_write_seconds"] * 1e3,
                e["during_write_slowdown_pct"],
                e["stall_seconds"]["median"],
                e["rss_growth_bytes"] / C.MiB,
            ]
        )
    C.print_table(
        f"training loop: {rep['model_params'] / 1e6:.1f}M params, {rep['state_bytes'] / C.MiB:.0f} MiB "
        f"state, save every {rep['save_every_steps']} steps, rank {rep['rank']}/{rep['world_size']}",
        cols,
        rows,
    )


def plot(rep: dict, path: Path) -> None:
    names = [m for m in rep["methods"] if not m.startswith("none")]
    C.plot_bars(
        path,
        f"Training-loop overhead ({rep['model_params'] / 1e6:.0f}M params, "
        f"{rep['state_bytes'] / C.MiB:.0f} MiB state, every {rep['save_every_steps']} steps)",
        [
            (
                "step-time overhead, A/B (%, ± 1 s.e.m.)",
                names,
                [rep["methods"][m]["overhead_pct"] for m in names],
                3.0,
                [rep["methods"][m]["overhead_sem_pct"] for m in names],
            ),
            (
                "step-time overhead, paired (%)",
                names,
                [rep["methods"][m]["overhead_vs_own_quiet_steps_pct"] for m in names],
                3.0,
            ),
            (
                "slowdown of steps during a write (%)",
                names,
                [rep["methods"][m]["during_write_slowdown_pct"] for m in names],
                5.0,
            ),
        ],
    )


if __name__ == "__main__":
    main()

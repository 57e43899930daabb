"""The background worker process: write, commit, prune — while training goes on.

One persistent process per rank, started by the engine with the ``spawn`` start method (no
forked copy of the trainer's memory). It receives the staging arenas once, then small job
messages naming an arena set, and answers with events. It ignores SIGINT and SIGTERM so that a
scheduler's preemption notice reaches the trainer, which drains the worker before stopping it;
it exits by itself if the trainer dies.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import faults
from . import layout as _layout
from .commit import remove_tree, rename_into_place, write_tracker
from .formats.dcp import Serialized
from .manifest import build_manifest, fsync_dir, fsync_file, write_manifest
from .staging import TensorSpec


@dataclass
class WorkerConfig:
    root: str
    layout: str
    fmt: str
    rank: int = 0
    run_id: str = ""
    throttle: Any = None  # throttle.ThrottleConfig
    parent_pid: int = 0


@dataclass
class SaveJob:
    job_id: int
    step: int
    arena_ids: list[int]
    specs: list[TensorSpec]
    objects: dict[str, bytes]  # {fqn: torch.save bytes}, serialised by the trainer
    paths: dict[str, list]
    metrics: dict[str, float]
    faults: dict = field(default_factory=dict)
    prune: Any = None  # a prune request, run after the commit


@dataclass(frozen=True)
class PruneRequest:
    """What the worker needs to prune after a commit (the policy is a picklable dataclass)."""

    policy: Any
    resumed_from: int | None = None
    pinned: tuple[int, ...] = ()
    run_id: str | None = None
    scope: str = "all"

    def run(self, root: Path, config: WorkerConfig) -> Any:
        from .prune import prune

        return prune(
            root,
            config.layout,
            self.policy,
            resumed_from=self.resumed_from,
            pinned=self.pinned,
            run_id=self.run_id,
            scope=self.scope,
        )


# ------------------------------------------------------------------------------ messages
# engine -> worker: ("arena", arena_id, tensor) | ("drop", arena_id) | ("save", SaveJob)
#                   | ("prune", request) | ("stop",)
# worker -> engine: ("ready", pid, throttle_report) | ("begin", job_id) | ("released", job_id)
#                   | ("committed", job_id, stats) | ("failed", job_id, error)
#                   | ("pruned", job_id, report)


def worker_view(arena: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A view of ``spec`` whose storage is exactly its bytes.

    DCP clones any tensor whose storage is larger than the tensor (torch.save writes whole
    storages); a frombuffer view over the arena slice avoids that copy.
    """
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    buf = memoryview(arena.numpy()).cast("B")[spec.offset : spec.offset + spec.nbytes]
    return torch.frombuffer(buf, dtype=torch.uint8).view(spec.dtype).view(spec.shape)


def root_cause(exc: BaseException) -> BaseException:
    """The error behind DCP's ``CheckpointException`` wrapper (it hides an OSError's errno)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], BaseException):
            return wrapped[0]
    return exc


def error_info(exc: BaseException) -> dict[str, Any]:
    exc = root_cause(exc)
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "errno": getattr(exc, "errno", None),
        "traceback": "".join(traceback.format_exception(exc)),
    }


class Worker:
    def __init__(self, config: WorkerConfig, jobs: Any, events: Any) -> None:
        self.config = config
        self.root = Path(config.root)
        self.jobs = jobs
        self.events = events
        self.arenas: dict[int, torch.Tensor] = {}
        self.io_threads = 1
        self.gate = None
        # DCP's extra writer threads drop their exceptions (the file is left short and the save
        # "succeeds"): collect them here and fail the save with them.
        self.thread_errors: list[BaseException] = []
        previous_hook = threading.excepthook

        def hook(args: Any) -> None:
            if args.exc_value is not None:
                self.thread_errors.append(args.exc_value)
            previous_hook(args)

        threading.excepthook = hook

    def run(self) -> None:
        report = self._apply_throttle()
        self.events.send(("ready", os.getpid(), report))
        while True:
            msg = self.jobs.recv()
            kind = msg[0]
            if kind == "arena":
                self.arenas[msg[1]] = msg[2]
            elif kind == "drop":
                self.arenas.pop(msg[1], None)
            elif kind == "save":
                self._save(msg[1])
            elif kind == "prune":
                self._prune(None, msg[1])
            elif kind == "stop":
                return

    def _apply_throttle(self) -> Any:
        cfg = self.config.throttle
        if cfg is None:
            torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
            return None
        from .throttle import RateLimiter, apply_throttle

        report = apply_throttle(cfg)
        self.io_threads = cfg.io_threads
        if cfg.write_rate_bytes_per_s:
            limiter = RateLimiter(cfg.write_rate_bytes_per_s)
            self.gate = limiter.acquire
        return report

    def _save(self, job: SaveJob) -> None:
        faults.install(job.faults)
        self.events.send(("begin", job.job_id))
        name = _layout.dir_name(self.config.layout, job.step)
        tmp = self.root / _layout.tmp_name(
            self.config.layout, job.step, f"{job.job_id}-{os.getpid()}"
        )
        final = self.root / name
        preexisting = final.exists()
        released = False
        t0 = time.perf_counter()
        try:
            tmp.mkdir()
            faults.point("before_shard_write")
            flat: dict[str, Any] = {k: Serialized(v) for k, v in job.objects.items()}
            for spec in job.specs:
                arena = self.arenas[job.arena_ids[spec.arena]]
                flat[spec.fqn] = worker_view(arena, spec)
            self.thread_errors.clear()
            crcs = self._write_format(flat, tmp, job)
            del flat
            if self.thread_errors:
                raise self.thread_errors[0]
            faults.point("after_shard_write")
            for p in tmp.rglob("*"):
                if p.is_file() and not p.is_symlink():
                    fsync_file(p)
            # The staging arena is free as soon as the bytes are in the files.
            self.events.send(("released", job.job_id))
            released = True
            t_written = time.perf_counter()
            faults.point("before_metadata")
            manifest = build_manifest(
                tmp,
                step=job.step,
                layout=self.config.layout,
                fmt=self.config.fmt,
                metrics=job.metrics,
                run_id=self.config.run_id,
                known_crcs=crcs,
                extra={"paths": job.paths},
            )
            write_manifest(tmp, manifest)
            rename_into_place(tmp, self.root / name)
            write_tracker(self.root, self.config.layout, job.step)
            t_done = time.perf_counter()
            stats = {
                "write_seconds": t_written - t0,
                "commit_seconds": t_done - t_written,
                "bytes": manifest["bytes"],
                "committed_at": manifest["committed_at"],
                "path": str(self.root / name),
            }
            self.events.send(("committed", job.job_id, stats))
        except BaseException as e:  # noqa: BLE001 - every failure must reach the trainer
            if tmp.exists():
                try:
                    remove_tree(tmp)
                    fsync_dir(self.root)
                except OSError:
                    pass  # the next start removes it
            elif not preexisting and final.exists() and _layout.read_tracker(self.root) != job.step:
                # Renamed into place, but the tracker was not updated (e.g. ENOSPC writing
                # it): a failed save must leave nothing behind, so take it out again (through
                # the trash, so that it is never seen half deleted).
                try:
                    from .prune import trash_and_delete

                    trash_and_delete(self.root, final)
                except OSError:
                    pass  # it is complete and verified, only the tracker lags it
            if not released:
                self.events.send(("released", job.job_id))
            self.events.send(("failed", job.job_id, error_info(e)))
            return
        faults.point("after_commit")
        if job.prune is not None:
            self._prune(job.job_id, job.prune)

    def _write_format(self, flat: dict[str, Any], tmp: Path, job: SaveJob) -> dict:
        from .formats import dcp

        if self.config.fmt == "torch_dist":
            from .formats import torch_dist

            return torch_dist.write_flat(flat, tmp, thread_count=self.io_threads, gate=self.gate)
        return dcp.write_flat(flat, tmp, thread_count=self.io_threads, gate=self.gate)

    def _prune(self, job_id: int | None, request: Any) -> None:
        try:
            report = request.run(self.root, self.config)
            self.events.send(("pruned", job_id, report, None))
        except BaseException as e:  # noqa: BLE001
            self.events.send(("pruned", job_id, None, error_info(e)))


def _watch_parent(parent_pid: int) -> None:
    # An orphaned worker must not linger: its trainer is gone, and so is the reason to write.
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.2)


def worker_main(config: WorkerConfig, jobs: Any, events: Any) -> None:
    """Entry point of the spawned worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(config.parent_pid,), daemon=True).start()
    # Held until this process exits: a new engine on the root waits for it before cleaning.
    lock_fd = os.open(
        Path(config.root) / f"{_layout.LOCK_NAME}.worker{config.rank}",
        os.O_RDWR | os.O_CREAT,
        0o644,
    )
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    # Faults come from the trainer with each job (it read $ASYNCCKPT_FAULTS); the copy this
    # process armed on import would fire a second time. Firing is reported back so that the
    # trainer disarms the point and a restarted worker does not fire it again.
    faults.clear()
    faults.set_reporter(lambda fault_id: events.send(("fault", fault_id)))
    try:
        Worker(config, jobs, events).run()
    except (EOFError, OSError):
        pass  # the trainer closed the pipe; temporaries are removed at the next start

"""The background worker process: write, commit, prune — while training goes on.

One persistent process per rank, started by the engine with the ``spawn`` start method (no
forked copy of the trainer's memory). It receives the staging arenas once, then small job
messages naming an arena set, and answers with events. It ignores SIGINT and SIGTERM so that a
scheduler's preemption notice reaches the trainer, which drains the worker before stopping it;
if the trainer dies, it finishes the saves already staged, then exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncckpt import faults
from asyncckpt.cluster.node_commit import commit_across_nodes, leads_node
from asyncckpt.cluster.peer_gone import meet_on_side_store
from asyncckpt.cluster.sidekeys import JobKeys
from asyncckpt.core import layout as _layout
from asyncckpt.core import messages as M
from asyncckpt.core.savejob import SaveJob
from asyncckpt.formats.dcp import Serialized
from asyncckpt.formats.differential import (
    KeepRule,
    LinkSource,
    Previous,
    about_new,
    known_digests,
    save_figures,
)
from asyncckpt.io.io_threads import IoThreads, local_workers
from asyncckpt.memory.hot_serve import Written
from asyncckpt.staging.arenas import TensorSpec
from asyncckpt.storage.commit import commit_step, every_rank_wrote, write_tracker
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.manifest import build_manifest, fsync_file
from asyncckpt.trainer.pins import WorkerPins

log = logging.getLogger("asyncckpt")


@dataclass
class WorkerConfig:
    root: str
    layout: str
    fmt: str
    rank: int = 0
    run_id: str = ""
    throttle: Any = None  # throttle.ThrottleConfig
    parent_pid: int = 0
    local_rank: int = 0  # which block of cores a throttle's cpu_cores count means
    dist: Any = None  # dist.DistConfig when several ranks save together
    remote: Any = None  # storage.RemoteTier: publish every commit to an object store
    export: Any = None  # export.HFExport: safetensors of a component every N steps
    # How long it may go on finishing staged saves after its trainer died (write_timeout).
    orphan_deadline_s: float = 600.0
    spool: bool = False  # root is a URL root's spool: record what was published in it
    # Rank 0 of several: the socket its trainer bound for the side store, served here so that
    # the commit's rendezvous outlives the trainer (dist.py).
    store_socket: Any = None
    # MemoryTier(replicas=1): whom this worker replicates its memory saves to and holds the
    # replicas of (replication.ReplicaConfig), or None.
    replication: Any = None
    # MemoryTier(hold_seconds=): how long to offer the newest step written to a new engine
    # once the trainer is gone (hot_serve.py); 0: exit at once.
    hot_hold_s: float = 0.0
    # Staging(differential=): link files unchanged since the last checkpoint (differential.py)
    differential: bool = False
    # What the prune after each commit keeps (every rank: only one prunes): a save links only
    # from a checkpoint that a kept step shares no file with (differential.link_source).
    keep: KeepRule | None = None


@dataclass(frozen=True)
class PruneRequest:
    """What the worker needs to prune after a commit (the policy is a picklable dataclass)."""

    policy: Any
    resumed_from: int | None = None
    pinned: tuple[int, ...] = ()
    run_id: str | None = None
    scope: str = "all"

    def run(self, root: Path, config: WorkerConfig, step: int, pinned: tuple[int, ...] = ()) -> Any:
        """``pinned``: steps protected after this request was made (pins.WorkerPins)."""
        from asyncckpt.storage.prune import prune

        # ``step`` is the checkpoint this worker has just committed, checksummed as it was
        # written: trusted, not read back at every save, and never pruned. (The tracker names
        # it only when steps go forward: with allow_older_steps it stays on a higher step.)
        # Warnings travel in the report; the engine shows them in the trainer's process.
        return prune(
            root,
            config.layout,
            self.policy,
            tracker_step=_layout.read_tracker(root),
            resumed_from=self.resumed_from,
            pinned=(*self.pinned, *pinned),
            run_id=self.run_id,
            scope=self.scope,
            trusted=(step,),
            warn=False,
            committed_step=step,
        )


# ------------------------------------------------------------------------------ messages
# Messages: asyncckpt/messages.py (trainer -> worker: Arena, Specs, Paths, Drop, Save, Stop;
# worker -> trainer: Ready, FaultFired, Begun, Released, Committed, Failed, Pruned).


def worker_view(arena: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A view of ``spec`` whose storage is exactly its bytes.

    DCP clones any tensor whose storage is larger than the tensor (torch.save writes whole
    storages); a frombuffer view over the arena slice avoids that copy.
    """
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    buf = memoryview(arena.numpy()).cast("B")[spec.offset : spec.offset + spec.nbytes]  # type: ignore[arg-type]
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


def _undo(root: Path, tmp: Path, final: Path, preexisting: bool, step: int) -> None:
    """A failed save leaves nothing behind: the temporary, or a commit the tracker missed."""
    if tmp.exists():
        try:
            LocalStore(root).discard(tmp)  # (and its writer note)
        except OSError:
            pass  # the next start removes it
    elif not preexisting and final.exists() and _layout.read_tracker(root) != step:
        # Renamed into place, but the tracker was not updated (e.g. ENOSPC writing it):
        # take it out again, through the trash so that it is never seen half deleted.
        try:
            from asyncckpt.storage.prune import trash_and_delete

            trash_and_delete(root, final)
        except OSError:
            pass  # complete and verified; only the tracker lags it


def job_tag(job: SaveJob) -> str:
    """What every rank's worker calls one save in the side store (its meeting and job group's
    keys) and in its shared temporary's name. A memory checkpoint persisted at the trainer's
    death has the step and attempt of the disk save its copy was staged for (memory_tier: one
    attempt for both), and that save may have failed, leaving its meeting's count whole and its
    group's keys behind (sidekeys: a failed group's stay): so the tier is in the name."""
    return f"{job.step}.{job.attempt}" + ("" if job.tier == "disk" else f".{job.tier}")


def _advance(root: Path, layout: str, step: int) -> dict[str, Any] | None:
    """A node's leader, once every node published ``step``: its tracker (node_commit.py)."""
    try:
        write_tracker(root, layout, step)
    except BaseException as e:  # noqa: BLE001 - reported on every rank
        return error_info(e)
    return None


def _written(holder: Any, job: SaveJob) -> None:
    """A disk save written from a memory slot (``held_as``): its holder may release that slot
    now (memory_hold.Holder.written, idempotent)."""
    if job.held_as is not None and holder is not None:
        holder.written(job.held_as)


class Worker:
    def __init__(
        self, config: WorkerConfig, jobs: Any, events: Any, pause: Any = None, holder: Any = None
    ) -> None:
        self.config = config
        self.holder = holder  # memory_tier.Holder: the newest memory checkpoint, or None
        self.replication: Any = None  # replication.Replication (replicas=1), or None
        self.stand_in = False  # a stand-in writing a gone rank's replica (replication.py)
        self.agreed = False  # took its rank's part in the exchange at the trainers' death
        self.pause = pause  # throttle.WritePause shared with the trainer, or None
        self.root = Path(config.root)
        self.records_fallbacks = 0  # of the last write (records.RecordWriter.fallbacks)
        # The newest step committed, offered to a new engine once the trainer is gone.
        self.last_written: Written | None = None
        self.trainer_gone = False
        self.early_offer: Any = None  # hot_serve.EarlyOffer: a step offered before written
        rank = config.dist.rank if config.dist is not None else 0  # (whose files it links)
        self.links = LinkSource(self.root, config.layout, config.differential, config.keep, rank)
        self.job_keys = JobKeys()  # the job groups; rank 0 frees their side-store keys
        self.jobs = jobs
        self.events = events
        self.arenas: dict[int, torch.Tensor] = {}
        self.received_all = threading.Event()  # the reader thread (_receive) has ended
        self.pins = WorkerPins()  # engine.protect() since the start: kept by every prune
        self.specs: dict[tuple[int, ...], list[TensorSpec]] = {}  # by the arenas they lay out
        self.last_paths: dict[str, list] | None = None
        self.store: Any = None  # storage.FsspecStore of config.remote, opened at first use
        self.io_threads = IoThreads(1)  # files written at once (throttle: io_threads.py)
        self.direct_io = False
        self.pacer: Any = None  # throttle.Pacer: rate cap + pause hint, before every piece
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
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        _start_receiving(self, inbox)
        report = self._apply_throttle()
        self.events.send(M.Ready(os.getpid(), report))
        _redo_exports(self.config, self.root)  # (jobs sent meanwhile wait in the inbox)
        while True:
            msg = inbox.get()
            if isinstance(msg, EOFError):
                # The trainer is gone without closing the engine: every staged save above is
                # written; now the memory checkpoint it held, if newer (offered before it is
                # written: _offer_early).
                self.trainer_gone = True
                _persist_held(self)
                raise msg
            if isinstance(msg, BaseException):
                if _trainer_gone(self.config.parent_pid):  # (its memory could not be mapped)
                    log.warning("the trainer is gone (%s): as at the end of its pipe", msg)
                    self.trainer_gone = True
                    _persist_held(self)
                raise msg
            if isinstance(msg, M.Arena):
                pass  # mapped by the reader thread (_receive)
            elif isinstance(msg, M.Specs):
                self.specs[msg.arena_ids] = msg.specs
            elif isinstance(msg, M.Paths):
                self.last_paths = msg.paths
            elif isinstance(msg, M.Drop):  # (unmapped by the reader thread: _receive)
                self.specs = {k: v for k, v in self.specs.items() if msg.arena_id not in k}
            elif isinstance(msg, M.Save):
                if msg.job.memory_job_id is not None and self.holder is not None:
                    self.holder.forget(msg.job.memory_job_id)  # the trainer persists it now
                self._save(msg.job)
            elif isinstance(msg, M.Stop):
                return
            else:
                raise TypeError(f"unknown message from the trainer: {msg!r}")

    def _apply_throttle(self) -> Any:
        from asyncckpt.io.throttle import Pacer, RateLimiter, apply_throttle, renicer

        cfg = self.config.throttle
        if cfg is None:
            torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
            return None
        report = apply_throttle(cfg, self.config.local_rank)
        self.io_threads = IoThreads(cfg.io_threads, local_workers(self.config.dist))
        self.direct_io = cfg.direct_io
        limiter = RateLimiter(cfg.write_rate_bytes_per_s) if cfg.write_rate_bytes_per_s else None
        paused = self.pause is not None and cfg.max_pause_seconds > 0
        if limiter is not None or paused or cfg.durable_within is not None:
            self.pacer = Pacer(
                limiter,
                self.pause,
                cfg.max_pause_seconds,
                durable_within=cfg.durable_within,
                renice=renicer(cfg, report) if cfg.durable_within is not None else None,
            )
        return report

    def _reset_paused(self, job: SaveJob) -> None:
        if self.pacer is not None:
            self.pacer.begin(job.saved_at)  # counted per save, reported with its commit

    def _pacer_figures(self) -> dict[str, Any]:
        if self.pacer is None:  # the throttle's figures, with the files written at once
            return {"io_threads": self.io_threads.used}
        self.pacer.end()
        return {**self.pacer.figures(), "io_threads": self.io_threads.used}

    def _paused_seconds(self) -> float:
        return self.pacer.paused_seconds if self.pacer is not None else 0.0

    def _save(self, job: SaveJob) -> None:
        """Write this rank's part of a save, agree with the other ranks, commit once.

        One path for one rank and many (the protocol is described in dist.py): every rank
        writes its own shards into one shared temporary directory; with several ranks their
        workers then agree over a side group, and only if every rank succeeded does rank 0
        commit (manifest of every rank's files, rename, tracker, and with a remote tier the
        upload) and tell the others. Any failure anywhere fails the save on every rank and
        commits nothing. One rank is the same path with a group of one and no messages.
        """
        faults.install(job.faults)
        if job.paths is None:  # the same as the last job's (engine: WorkerLink.paths)
            if self.last_paths is None:
                raise RuntimeError("a job without paths reached a worker that has none")
            job.paths = self.last_paths
        if job.tier == "disk":  # a memory checkpoint's paths are its own (memory_tier.Holder)
            self.last_paths = job.paths
        from asyncckpt.cluster import dist as _dist

        cfg = self.config.dist
        rank = cfg.rank if cfg is not None else 0
        self.events.send(M.Begun(job.job_id))
        final = self.root / _layout.dir_name(self.config.layout, job.step)
        # Several ranks share one temporary (named alike by every rank); one rank's is its own.
        tag = job_tag(job)  # names this save's meeting, job group and shared temporary
        token = f"{cfg.token}-{tag}" if cfg is not None else f"{job.job_id}-{os.getpid()}"
        tmp = self.root / _layout.tmp_name(self.config.layout, job.step, token)  # stage's name
        preexisting = final.exists()
        t0 = time.perf_counter()
        self._reset_paused(job)
        outcome: tuple[str, Any] | None = None  # ranks other than 0 get it from rank 0
        try:
            with _job_group(self.job_keys, cfg, tag) as pg:
                local_error: dict | None = None
                crcs: dict = {}
                try:
                    crcs = self._write_shards(job, final.name, token, pg, rank)
                except BaseException as e:  # noqa: BLE001 - reported to every rank
                    local_error = error_info(e)
                # The staging arena is free as soon as the bytes are in the files.
                self.events.send(M.Released(job.job_id))
                _written(self.holder, job)
                t_written = time.perf_counter()
                mine = (local_error, crcs, job.paths, _checksums(self._offered(job)))
                # The agreement: every rank's shards are durable, or nobody commits. Rank 0
                # alone decides (and commits): it gathers every rank's checksums, the others
                # learn the outcome from its broadcast (a gather: not N lists to all N ranks).
                results = [mine] if cfg is None else _dist.gather(pg, mine, cfg.world_size, rank)
                if results is not None:  # rank 0
                    failed = [(r, res[0]) for r, res in enumerate(results) if res[0] is not None]
                    if failed:
                        outcome = (
                            "failed",
                            local_error if cfg is None else _dist.ranks_error(failed),
                        )
                    elif cfg is None or not cfg.ranks_per_node:  # one root: rank 0 commits
                        outcome = self._commit_all(
                            job, tmp, final, dict(enumerate(results)), t0, t_written
                        )
                if cfg is not None:
                    outcome = _dist.broadcast(pg, outcome)
                if outcome is None:  # every rank wrote; on node-local roots every node commits
                    outcome = commit_across_nodes(
                        pg, cfg, tmp, results,
                        lambda res: self._commit_all(job, tmp, final, res, t0, t_written, False),
                        lambda: _advance(self.root, self.config.layout, job.step),
                    )  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - a broken group: a peer died or timed out
            info = error_info(e)
            info["message"] = f"rank {rank}: coordination with the other ranks failed: " + str(
                info["message"]
            )
            outcome = ("failed", info)
            if tmp.exists():
                with contextlib.suppress(OSError):
                    LocalStore(self.root).discard(tmp)  # (and its writer note)
        assert outcome is not None
        _written(self.holder, job)  # (again, if a broken group cut the write short)
        if outcome[0] != "committed":
            _dist.drop_group()  # (a group a save failed in may be broken: the next forms one)
            if self._offered(job) is not None:
                # (a new engine that took it fails its start)
                self.early_offer.withdraw(str(outcome[1].get("message")))
            if (rank == 0 or leads_node(cfg)) and not outcome[1].get("upload"):
                _undo(self.root, tmp, final, preexisting, job.step)
            self.events.send(M.Released(job.job_id))  # (again: the engine ignores a repeat)
            self.events.send(M.Failed(job.job_id, outcome[1]))
            return
        if rank == 0:  # every rank's shards are in the committed directory: rank 0 exports
            failed_export = _export(self.config, job, final, outcome[1])
            if failed_export is not None:
                self.events.send(M.Failed(job.job_id, failed_export))
                return
        self.links.committed(final)  # what the next save links unchanged files from
        self.events.send(M.Committed(job.job_id, outcome[1]))
        self.last_written = Written(job, tuple(crcs))  # its arenas still hold it, checked or not
        faults.point("after_commit")
        if job.prune is not None:
            self._prune(job.job_id, job.prune, job.step)

    def _write_shards(self, job: SaveJob, name: str, token: str, pg: Any, rank: int) -> dict:
        """This rank's files in the temporary of ``name``, durable; returns their checksums
        (name -> entry)."""
        # Several ranks share one temporary (same token): each may be the one that makes it.
        tmp = LocalStore(self.root).stage(
            name, token, exist_ok=self.config.dist is not None, writer=_writer(job, rank)
        )
        self._offer_early(job)  # before a byte is written: a new engine needs no file
        faults.point("before_shard_write")
        flat: dict[str, Any] = {k: Serialized(v) for k, v in job.objects.items()}
        for spec in self._specs(job):
            arena = self.arenas[job.arena_ids[spec.arena]]
            flat[spec.fqn] = worker_view(arena, spec)
        self.thread_errors.clear()
        from asyncckpt.formats.records import default_writer

        before = default_writer.fallbacks  # one save at a time: the difference is this one's
        crcs = self._write_format(flat, tmp, job, pg)
        self.records_fallbacks = default_writer.fallbacks - before
        del flat
        if self.thread_errors:
            raise self.thread_errors[0]
        faults.point("after_shard_write")
        if self._offered(job) is not None:
            self.early_offer.unchanged()  # the files hold the bytes offered, or no commit
        if self.config.dist is None:
            mine = list(tmp.rglob("*"))
        else:  # only this rank's files (the others fsync theirs); DCP's metadata is rank 0's
            mine = [tmp / n for n in crcs]
            if rank == 0:
                mine += list(tmp.rglob(_layout.DCP_METADATA))
        for p in mine:
            if p.is_file() and not p.is_symlink():
                fsync_file(p)
        return crcs

    def _offer_early(self, job: SaveJob) -> None:
        """Offer a step persisted after the trainer's death before writing it (offer_staged):
        plain DCP tensors staged whole, ranks of one root (not node-local nor a recovery)."""
        cfg = self.config
        one_root = cfg.dist is None or not (cfg.dist.ranks_per_node or cfg.dist.recovery_store)
        if not self.trainer_gone or cfg.hot_hold_s <= 0 or not one_root:
            return
        plain = cfg.fmt == "dcp" and job.chunks is None and not (job.extra or {}).get("shards")
        if self.early_offer is None and plain:
            from asyncckpt.memory.hot_serve import offer_staged

            self.early_offer = offer_staged(self, job)

    def _offered(self, job: SaveJob) -> Any:
        """The early offer of ``job``'s step, or None."""
        early = self.early_offer
        return early if early is not None and early.offer.step == job.step else None

    def _specs(self, job: SaveJob) -> list[TensorSpec]:
        return job.specs if job.specs is not None else self.specs[tuple(job.arena_ids)]

    def _write_format(
        self, flat: dict[str, Any], tmp: Path, job: SaveJob, process_group: Any = None
    ) -> dict:
        from asyncckpt.formats import staged

        if job.chunks is not None:  # written chunk by chunk as the trainer copies them
            from asyncckpt.worker.chunked_write import write_chunked

            return write_chunked(self, job, flat, tmp, process_group)
        objects = {k: v for k, v in flat.items() if isinstance(v, Serialized)}
        views = {k: v for k, v in flat.items() if not isinstance(v, Serialized)}
        return staged.write(
            self.config.fmt,
            views,
            objects,
            job.extra,
            tmp,
            rank=self.config.dist.rank if self.config.dist is not None else 0,
            process_group=process_group,
            **self.io_threads.write_options(),
            pace=self.pacer,
            direct_io=self.direct_io,
            step=job.step,
            world_size=self.config.dist.world_size if self.config.dist is not None else 1,
            plan_cache="save",  # one persistent worker: DCP's plans are reused while they hold
            paths=job.paths,
            differential=_link_from(self.links, self.config, job, tmp, views),
        )

    def _commit_all(
        self,
        job: SaveJob,
        tmp: Path,
        final: Path,
        results: dict[int, tuple],
        t0: float,
        t_written: float,
        tracker: bool = True,
    ) -> tuple[str, Any]:
        """Rank 0 (or a node's leader, ``results`` its node's ranks', node_commit.py), after
        every rank agreed: manifest of those ranks' files, rename, tracker (unless
        ``tracker`` is False), and with a remote tier the upload. Returns the outcome."""
        known: dict = {}
        paths: dict = {}
        for _, crcs, rank_paths, *_ in results.values():
            known.update(crcs)
            for k, v in rank_paths.items():
                paths.setdefault(k, v)
        cfg = self.config.dist
        # The run's token (shared by every rank) names this commit for the other ranks' engines.
        extra = {} if cfg is None else {"world_size": cfg.world_size, "dist_token": cfg.token}
        extra.update(_offered_by_rank(results) if cfg is not None else {})
        where = "" if cfg is None else f"rank {cfg.rank} ({{}}): "
        try:
            every_rank_wrote(tmp, {r: res[1] for r, res in results.items()}, min(results))
            stats = self._commit(job, tmp, final, known, paths, extra, t0, t_written, tracker)
        except BaseException as e:  # noqa: BLE001 - reported on every rank
            info = error_info(e)
            info["message"] = where.format("commit") + info["message"]
            return ("failed", info)
        failed = self._publish(job, stats)
        if failed is not None:
            failed["message"] = where.format("upload") + failed["message"]
            return ("failed", failed)
        return ("committed", stats)

    def _publish(self, job: SaveJob, stats: dict[str, Any]) -> dict[str, Any] | None:
        """With a remote tier: publish the step just committed here, then prune the store.

        Returns None (and adds the upload's figures to ``stats``) or the failure's info, marked
        as an upload failure: the step stays committed locally, and the next save retries it.
        """
        tier = self.config.remote
        if tier is None:
            return None
        from asyncckpt.storage.remote import publish_after_commit

        try:
            if self.store is None:
                self.store = tier.open()
            figures = publish_after_commit(
                self.store,
                tier,
                self.root,
                self.config.layout,
                job.step,
                pinned=(*(job.prune.pinned if job.prune is not None else ()), *self.pins.kept()),
                resumed_from=job.prune.resumed_from if job.prune is not None else None,
            )
        except BaseException as e:  # noqa: BLE001 - reported on the save's handle
            info = error_info(e)
            info["upload"] = True
            return info
        # A spool's record (and any root's: `ls` shows the steps not in it as pending uploads).
        from asyncckpt.storage.remote import mark_published

        try:
            mark_published(
                self.root, tier, self.config.layout, [job.step, *figures["uploaded_steps"]]
            )
        except OSError:
            pass  # in the store all the same; a restart finds it there and records it
        stats.update(figures)
        stats["remote_path"] = f"{tier.url}/{_layout.dir_name(self.config.layout, job.step)}"
        return None

    def _commit(
        self,
        job: SaveJob,
        tmp: Path,
        final: Path,
        known_crcs: dict,
        paths: dict,
        extra: dict,
        t0: float,
        t_written: float,
        tracker: bool = True,
    ) -> dict[str, Any]:
        """Manifest (checksums of every file), atomic rename, tracker: the commit proper."""
        faults.point("before_metadata")
        diff = save_figures(tmp)  # every rank's sidecars: bytes linked and written
        manifest = build_manifest(
            tmp,
            step=job.step,
            layout=self.config.layout,
            fmt=self.config.fmt,
            metrics=job.metrics,
            run_id=self.config.run_id,
            known_crcs=known_crcs,
            # Which job wrote it: a trainer whose worker died after the rename can tell its
            # own commit from an older one (engine._committed_on_disk).
            # (A format's own fields, e.g. the components it was written with, come first.)
            extra={
                **((job.extra or {}).get("manifest") or {}),
                "paths": paths,
                "job_id": job.job_id,
                "attempt": job.attempt,
                **({"metadata": job.metadata} if job.metadata else {}),
                **(
                    {"tier": "memory", "persisted_because": job.persisted_because}
                    if job.tier == "memory"
                    else {}
                ),
                **_export_wanted(self.config, job.step),
                # Offered before written: what a new engine checked (hot.py; ranks: _commit_all)
                **_offered_alone(self._offered(job) if self.config.dist is None else None),
                **extra,
            },
            figures={
                **job.figures,
                "write_seconds": t_written - t0,
                "paused_seconds": self._paused_seconds(),
                **diff,
            },
        )
        commit_step(self.root, self.config.layout, job.step, tmp, final, manifest, tracker)
        return {
            **diff,
            **self._pacer_figures(),
            "paused_seconds": self._paused_seconds(),
            "write_seconds": t_written - t0,
            "commit_seconds": time.perf_counter() - t_written,
            "records_fallbacks": self.records_fallbacks,
            "bytes": manifest["bytes"],
            "committed_at": manifest["committed_at"],
            "path": str(final),
        }

    def _prune(self, job_id: int | None, request: Any, step: int) -> None:
        try:
            with self.pins.pruning() as pinned:  # (protect() since the request was made)
                report = request.run(self.root, self.config, step, pinned)
            self.events.send(M.Pruned(job_id, report, None))
        except BaseException as e:  # noqa: BLE001
            self.events.send(M.Pruned(job_id, None, error_info(e)))


def _link_from(
    links: LinkSource, config: WorkerConfig, job: SaveJob, tmp: Path, views: dict[str, Any]
) -> Previous | None:
    """What ``job``'s save (written into ``tmp``, of staged ``views``) may link from."""
    new = about_new(job.step, job.metrics, config.run_id, job.metadata, job.tier)
    known = known_digests(views, job.digests)
    return links.previous(tmp, config.fmt, job.extra, known, new=new)


def _export(
    config: WorkerConfig, job: SaveJob, final: Path, stats: dict[str, Any]
) -> dict[str, Any] | None:
    """Every ``export.every_steps``: the component as Hugging Face safetensors, from the
    committed directory (shards of every rank consolidated here, never in the trainer),
    then the export's own retention. Returns None or the failure's info, marked as an
    export failure (the step stays committed)."""
    export = config.export
    if export is None or not export.due(job.step):
        return None
    from asyncckpt.worker.export import export_step, prune_exports

    t0 = time.perf_counter()
    try:
        path = export_step(export, final, job.step)
        prune_exports(export, job.step)  # (just written and checksummed: trusted)
    except BaseException as e:  # noqa: BLE001 - reported on the save's handle
        info = error_info(e)
        info["export"] = True
        return info
    stats["export_seconds"] = time.perf_counter() - t0
    stats["export_path"] = str(path)
    return None


def _persist_held(worker: Worker) -> None:
    """The trainer died: write the memory checkpoint it left (memory_hold.py), with the
    stand-ins for gone peers whose replicas this worker holds (replication.py)."""
    from asyncckpt.memory.hold import persist_held
    from asyncckpt.memory.replication import recovering, recovery_over, standing_in

    worker.config = recovering(worker.config, worker.replication)
    with standing_in(worker.replication, worker.config):
        persist_held(worker)
    recovery_over(worker)


def _writer(job: SaveJob, rank: int) -> dict[str, Any]:
    """Who writes ``job``'s temporary, noted beside it: ``ls`` shows the write in progress
    while this process lives (pid and its start time: a reused pid is not it)."""
    import socket

    import psutil

    return {
        "pid": os.getpid(),
        "pid_started_at": psutil.Process().create_time(),
        "host": socket.gethostname(),
        "rank": rank,
        "step": job.step,
        "started_at": time.time(),
        "tier": job.tier,
        "persisted_because": job.persisted_because,
    }


def _start_receiving(worker: Worker, inbox: queue.SimpleQueue) -> None:
    """Start ``worker``'s reader thread (``_receive``), its messages into ``inbox``."""
    if worker.holder is not None:  # a Hold counts once its slot's memory is mapped here
        worker.holder.watch_arenas(worker.arenas, worker.received_all)
    threading.Thread(
        target=_receive,
        args=(worker.jobs, worker.events, inbox, worker.replication, worker.arenas),
        kwargs={
            "parent_pid": worker.config.parent_pid,
            "ended": worker.received_all,
            "pins": worker.pins,
        },
        name="asyncckpt-receive",
        daemon=True,
    ).start()


def _trainer_gone(parent_pid: int) -> bool:
    """Whether the trainer that started this worker is gone (0: no trainer to watch)."""
    from asyncckpt.worker.chunked_write import trainer_alive

    return not trainer_alive(parent_pid)()


def _receive(
    jobs: Any,
    events: Any,
    inbox: queue.SimpleQueue,
    replication: Any = None,
    arenas: dict[int, torch.Tensor] | None = None,
    *,
    parent_pid: int = 0,
    ended: threading.Event | None = None,
    pins: WorkerPins | None = None,
) -> None:
    """The worker's reader thread: the trainer's messages as they come, also while a save is
    being written. An arena's shared memory is mapped by receiving it, which needs its trainer
    alive (the descriptor is fetched from it), so the trainer waits for ``Mapped`` before a
    save that sent one returns. ``arenas`` (the worker's) are kept here: an arena goes in
    before any job staged in it is queued, and out (``Dropped``) as soon as the trainer
    drops it (a slot re-laid out: its jobs were written), so its memory comes back while
    a save is written. The main loop handles the messages in order.

    The trainer's death ends the pipe, unless a process it forked keeps its end open (a
    forked logger, a data-loading process): then, once the pipe holds nothing more, the
    trainer's being gone ends it the same way (else the memory checkpoint it held was never
    written: ``Worker.run`` writes it at the pipe's end)."""
    try:
        while True:
            while parent_pid and not jobs.poll(RECEIVE_POLL_S):
                if _trainer_gone(parent_pid):
                    raise EOFError("the trainer is gone (another process holds its pipe open)")
            msg = jobs.recv()
            if replication is not None:  # its sender reads the arenas beside the main loop
                replication.registry.note(msg)
            if isinstance(msg, M.Arena):
                if arenas is not None:
                    arenas[msg.arena_id] = msg.tensor
                    msg = M.Arena(msg.arena_id, None)  # (the inbox holds no reference to it)
                events.send(M.Mapped(msg.arena_id))
            if isinstance(msg, M.Drop) and arenas is not None:
                arenas.pop(msg.arena_id, None)
                events.send(M.Dropped(msg.arena_id))
            if isinstance(msg, (M.Protect, M.Unprotect)):  # not behind the save written now
                if pins is not None:
                    pins.submit(msg, events)
                elif isinstance(msg, M.Protect):
                    events.send(M.Protected(msg.step))
                continue
            inbox.put(msg)
    except BaseException as e:  # noqa: BLE001 - EOFError: the trainer is gone
        if ended is not None:
            ended.set()
        inbox.put(e)


#: Seconds the reader thread waits for a message before it looks whether the trainer lives.
RECEIVE_POLL_S = 0.5


def _job_group(keys: JobKeys, cfg: Any, tag: str) -> Any:
    """The save's group of every rank's worker (none for one rank), once the workers have
    met: failing at once when a peer's worker is said to have died with its trainer, and
    reusing the group kept from the last save when every rank still holds it (peer_gone.py,
    dist.job_group)."""
    if cfg is None:
        return contextlib.nullcontext(None)
    from asyncckpt.cluster import dist as _dist

    faults.point("before_job_group")
    try:
        fresh = meet_on_side_store(cfg, tag, not _dist.holds_group(cfg))
    except BaseException:
        _dist.drop_group()  # (at once: a peer that met after the timeout must not wait in it)
        raise
    return keys.group(cfg, tag, reuse=not fresh)


def _watch_parent(parent_pid: int, deadline_s: float) -> None:
    """Bound the life of a worker whose trainer died.

    A save whose ``save()`` returned is fully staged here (the job is sent only after the
    copy), so the worker goes on after its trainer's death: it finishes every job that
    reached it whole, commits, writes the tracker and prunes; then the pipe's end of file
    ends its loop (a job cut off mid-message never starts). It must never linger, so after
    ``deadline_s`` it exits whatever it is doing (temporaries are removed at the next start).
    """
    while os.getppid() == parent_pid:
        time.sleep(0.2)
    log.warning(
        "the trainer (pid %d) is gone: finishing the saves it staged (at most %.0fs)",
        parent_pid,
        deadline_s,
    )
    time.sleep(deadline_s)
    os._exit(3)


class _ToTrainer:
    """The worker's side of the events pipe. Once the trainer is gone nobody listens: what
    would have been reported is dropped and the staged saves are finished all the same."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.gone = False
        # The main loop and the memory tier's Holder thread both report: whole messages only.
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        if self.gone:
            return
        try:
            with self.lock:
                self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.gone = True


def _export_wanted(config: WorkerConfig, step: int) -> dict[str, Any]:
    """The manifest's record of the export due at ``step``: a worker killed before the
    export was published leaves a checkpoint that says so (``_redo_exports``)."""
    export = config.export
    if export is None or not export.due(step):
        return {}
    from asyncckpt.worker.export import wanted_record

    return {"hf_export": wanted_record(export)}


def _redo_exports(config: WorkerConfig, root: Path) -> None:
    """At start (rank 0): the exports that committed checkpoints record as wanted and that
    are not there (the worker before this one died, or its trainer was killed, mid-export),
    written now, before any job; then crashed exports' leftovers removed."""
    export = config.export
    if export is None or (config.dist is not None and config.dist.rank != 0):
        return
    from asyncckpt.worker.export import export_step, missing_exports, prune_exports

    try:
        for step, path in missing_exports(export, root, config.layout):
            log.warning("asyncckpt: step %d's export was not completed; exporting it", step)
            export_step(export, path, step)
        prune_exports(export)
    except Exception as e:  # noqa: BLE001 - the next start tries again; saves go on
        log.warning("asyncckpt: redoing an interrupted export failed: %s", e)


def skip_torch_save_crc() -> None:
    # torch.save computes a crc32 of every record it writes; the manifest already checksums
    # every byte of every file (and is what load verifies), so that pass is pure CPU cost.
    # Readers do not need it: torch.load accepts archives written without it.
    torch.serialization.set_crc32_options(False)


def worker_main(
    config: WorkerConfig, jobs: Any, events: Any, pause: Any = None, memory: Any = None
) -> None:
    """Entry point of the spawned worker process (``memory``: the memory tier's pipe)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    events = _ToTrainer(events)
    threading.Thread(
        target=_watch_parent, args=(config.parent_pid, config.orphan_deadline_s), daemon=True
    ).start()
    # Held until this process exits: a new engine on the root waits for it before cleaning.
    lock_fd = LocalStore(config.root).lock(f"worker{config.rank}", wait=True)
    if config.dist is not None and not config.dist.ranks_per_node:  # one shared root
        from asyncckpt.cluster.peer_gone import note_worker

        note_worker(config.root, config.rank, config.dist.token)
    skip_torch_save_crc()
    # Faults come from the trainer with each job (it read $ASYNCCKPT_FAULTS); the copy this
    # process armed on import would fire a second time. Firing is reported back so that the
    # trainer disarms the point and a restarted worker does not fire it again.
    faults.clear()
    faults.set_reporter(lambda fault_id: events.send(M.FaultFired(fault_id)))
    side_store = None
    if config.store_socket is not None:
        from asyncckpt.cluster import dist as _dist

        side_store = _dist.serve(config.dist, config.store_socket)  # noqa: F841 - kept alive
    if config.dist is not None and config.dist.ranks_per_node:  # node-local roots
        from asyncckpt.formats.dcp import _PassThroughPlanner

        _PassThroughPlanner.replicated_on_rank0 = True  # whose files every node gets
    replication = None
    if config.replication is not None and config.dist is not None:
        from asyncckpt.memory.replication import Replication

        replication = Replication(config.dist, config.replication, events)
    holder = None
    if memory is not None:
        from asyncckpt.memory.hold import Holder

        holder = Holder(memory, events, replication.sender if replication else None)
    worker = Worker(config, jobs, events, pause, holder)
    worker.replication = replication
    try:
        worker.run()
    except (EOFError, OSError):
        pass  # the trainer closed the pipe; temporaries are removed at the next start
    if worker.trainer_gone and config.hot_hold_s > 0:
        from asyncckpt.memory.hot_serve import serve
        from asyncckpt.storage.localfs import unlock

        # What it wrote stays in memory a while for a new engine (a hot resume).
        serve(worker, config.hot_hold_s, lambda: unlock(lock_fd) if lock_fd is not None else None)


def _checksums(early: Any) -> dict[str, int] | None:
    """The checksums of a step offered before it was written (``EarlyOffer``), or None."""
    return early.checksums() if early is not None else None


def _offered_alone(early: Any) -> dict[str, Any]:
    """One rank: the manifest's ``offered``, the checksums of a step offered before it was
    written (hot.py checks them at the new engine's start)."""
    return {"offered": early.checksums()} if early is not None else {}


def _offered_by_rank(results: dict[int, tuple]) -> dict[str, Any]:
    """Several ranks: ``offered_ranks``, each rank's checksums of its part offered before it
    was written (each rank's new engine checks its own at start)."""
    offered = {str(r): res[3] for r, res in results.items() if len(res) > 3 and res[3]}
    return {"offered_ranks": offered} if offered else {}

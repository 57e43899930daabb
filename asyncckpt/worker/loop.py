"""The background worker process: write, commit, prune — while training goes on.

One persistent process per rank, started by the engine with the ``spawn`` start method (no
forked copy of the trainer's memory; its start: main.py). It receives the staging arenas once,
then small job messages naming an arena set, and answers with events. It ignores SIGINT and
SIGTERM so that a scheduler's preemption notice reaches the trainer, which drains the worker
before stopping it; if the trainer dies, it finishes the saves already staged, then exits.
What it does beside its write (the memory hold, a hot resume's offer, replication, the export,
the pins) are its services (memory/service.py), called through their hooks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import torch

from asyncckpt import faults
from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster.dist import DistConfig
from asyncckpt.cluster.node_commit import commit_across_nodes, leads_node
from asyncckpt.cluster.peer_gone import meet_on_side_store
from asyncckpt.cluster.sidekeys import JobKeys
from asyncckpt.core import layout as _layout
from asyncckpt.core import messages as M
from asyncckpt.core.savejob import SaveJob, TensorSpec
from asyncckpt.formats import staged
from asyncckpt.formats.dcp import Serialized
from asyncckpt.formats.differential import (
    LinkSource,
    Previous,
    about_new,
    known_digests,
    save_figures,
)
from asyncckpt.formats.records import default_writer
from asyncckpt.io.io_threads import IoThreads, local_workers
from asyncckpt.io.throttle import Pacer, RateLimiter, apply_throttle, renicer
from asyncckpt.memory.hot_serve import HotServe
from asyncckpt.memory.replication import Replication, recovering
from asyncckpt.memory.service import WorkerService, Written
from asyncckpt.storage.commit import commit_step, every_rank_wrote, write_tracker
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.manifest import build_manifest, fsync_file
from asyncckpt.storage.prune import trash_and_delete
from asyncckpt.storage.remote import (
    UploadQueue,
    mark_published,
    pending_uploads,
    publish_after_commit,
)
from asyncckpt.worker.chunked_write import trainer_alive, write_chunked
from asyncckpt.worker.config import PruneRequest, WorkerConfig
from asyncckpt.worker.pins import WorkerPins
from asyncckpt.worker.report import collect_thread_errors, error_info

__all__ = ["PruneRequest", "SaveJob", "Worker", "WorkerConfig", "job_tag", "worker_view"]

log = logging.getLogger("asyncckpt")

# ------------------------------------------------------------------------------ messages
# Messages: asyncckpt/core/messages.py (trainer -> worker: Arena, Specs, Paths, Drop, Save,
# Stop; worker -> trainer: Ready, FaultFired, Begun, Released, Committed, Failed, Pruned).


def worker_view(arena: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """A view of ``spec`` whose storage is exactly its bytes.

    DCP clones any tensor whose storage is larger than the tensor (torch.save writes whole
    storages); a frombuffer view over the arena slice avoids that copy.
    """
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    buf = memoryview(arena.numpy()).cast("B")[spec.offset : spec.offset + spec.nbytes]  # type: ignore[arg-type]
    return torch.frombuffer(buf, dtype=torch.uint8).view(spec.dtype).view(spec.shape)


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


class Worker:
    """One rank's worker: its loop over the trainer's messages, each save written, agreed and
    committed, and its services (``services``, composed by ``worker_main``) called beside."""

    def __init__(self, config: WorkerConfig, jobs: Any, events: Any, pause: Any = None) -> None:
        self.config = config
        self.pause = pause  # throttle.WritePause shared with the trainer, or None
        self.root = Path(config.root)
        self.records_fallbacks = 0  # of the last write (records.RecordWriter.fallbacks)
        # The newest step committed, offered to a new engine once the trainer is gone.
        self.last_written: Written | None = None
        self.trainer_gone = False
        # What it runs beside its write, hooks called in this order (worker_main composes them).
        self.services: Sequence[WorkerService] = ()
        self.hot = HotServe(self)  # a hot resume's offer (one of ``services`` when composed)
        self.replication: Replication | None = None  # replicas=1: its sender and receiver
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
        self.publisher = Publisher(self)  # with a remote tier: each commit to the store
        self.uploads = self.publisher.queue  # one rank's steps waiting to upload, or None
        self.io_threads = IoThreads(1)  # files written at once (throttle: io_threads.py)
        self.direct_io = False
        self.pacer: Pacer | None = None  # rate cap + pause hint, before every piece
        # DCP's extra writer threads drop their exceptions (the file is left short and the save
        # "succeeds"): collect them here and fail the save with them.
        self.thread_errors = collect_thread_errors()

    def run(self) -> None:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._start_receiving(inbox)
        report = self._apply_throttle()
        self.events.send(M.Ready(os.getpid(), report))
        for service in self.services:  # (jobs sent meanwhile wait in the inbox)
            service.on_start()
        while True:
            msg = inbox.get()
            if isinstance(msg, EOFError):
                # The trainer is gone without closing the engine: every staged save above is
                # written; now the memory checkpoint it held, if newer (offered before it is
                # written: hot_serve.HotServe.before_write).
                self._trainer_died()
                self.publisher.drain()
                raise msg
            if isinstance(msg, BaseException):
                if _trainer_gone(self.config.parent_pid):  # (its memory could not be mapped)
                    log.warning("the trainer is gone (%s): as at the end of its pipe", msg)
                    self._trainer_died()
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
                for service in self.services:  # (the memory hold: a save the trainer persists)
                    service.on_job(msg.job)
                self.save(msg.job)
            elif isinstance(msg, M.Stop):
                self.publisher.drain()
                return
            else:
                raise TypeError(f"unknown message from the trainer: {msg!r}")

    def _trainer_died(self) -> None:
        """The trainer is gone: the recovery's config (replication.recovering: every rank
        switches at its trainer's death), then each service's part (the memory hold writes
        the memory checkpoint it left, with stand-ins for gone peers)."""
        self.trainer_gone = True
        self.config = recovering(self.config, self.replication)
        for service in self.services:
            service.trainer_gone()

    def _start_receiving(self, inbox: queue.SimpleQueue) -> None:
        """Start the reader thread (``_receive``), its messages into ``inbox``."""
        threading.Thread(
            target=_receive,
            args=(self.jobs, self.events, inbox, self.arenas),
            kwargs={
                "parent_pid": self.config.parent_pid,
                "ended": self.received_all,
                "services": self.services,
            },
            name="asyncckpt-receive",
            daemon=True,
        ).start()

    def _apply_throttle(self) -> Any:
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

    def save(self, job: SaveJob) -> None:
        """Write this rank's part of a save, agree with the other ranks, commit once.

        One path for one rank and many (the protocol is described in dist.py): every rank
        writes its own shards into one shared temporary directory; with several ranks their
        workers then agree over a side group, and only if every rank succeeded does rank 0
        commit (manifest of every rank's files, rename, tracker, and with a remote tier the
        upload) and tell the others. Any failure anywhere fails the save on every rank and
        commits nothing. One rank is the same path with a group of one and no messages.
        """
        faults.install(self.publisher.faults_for(job))
        if job.paths is None:  # the same as the last job's (engine: WorkerLink.paths)
            if self.last_paths is None:
                raise RuntimeError("a job without paths reached a worker that has none")
            job.paths = self.last_paths
        if job.tier == "disk":  # a memory checkpoint's paths are its own (memory_tier.Holder)
            self.last_paths = job.paths
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
                self._released(job)
                t_written = time.perf_counter()
                mine = (local_error, crcs, job.paths, self.hot.checksums(job))
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
                    assert cfg is not None  # (one rank: rank 0's outcome above)
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
        self._released(job)  # (again, if a broken group cut the write short)
        if outcome[0] != "committed":
            _dist.drop_group()  # (a group a save failed in may be broken: the next forms one)
            for service in self.services:  # (a hot resume's offer: withdrawn)
                service.failed(job, str(outcome[1].get("message")))
            if (rank == 0 or leads_node(cfg)) and not outcome[1].get("upload"):
                _undo(self.root, tmp, final, preexisting, job.step)
            self.events.send(M.Released(job.job_id))  # (again: the engine ignores a repeat)
            self.events.send(M.Failed(job.job_id, outcome[1]))
            return
        for service in self.services:  # (rank 0 exports: every rank's shards are committed)
            after = service.after_commit(job, final, outcome[1])
            if after is not None:
                self.events.send(M.Failed(job.job_id, after))
                return
        self.links.committed(final)  # what the next save links unchanged files from
        if self.uploads is None:
            self.events.send(M.Committed(job.job_id, outcome[1]))
        else:  # committed here; the handle resolves once it is in the store too
            self.publisher.queued(job, outcome[1])
        self.last_written = Written(job, tuple(crcs))  # its arenas still hold it, checked or not
        if self.uploads is None:  # (else after the upload: committed means in the store)
            faults.point("after_commit")
            if job.prune is not None:
                self._prune(job.job_id, job.prune, job.step)

    def _released(self, job: SaveJob) -> None:
        """``job``'s arenas are free (the trainer was told; may come twice for one save)."""
        for service in self.services:
            service.released(job)

    def _write_shards(self, job: SaveJob, name: str, token: str, pg: Any, rank: int) -> dict:
        """This rank's files in the temporary of ``name``, durable; returns their checksums
        (name -> entry)."""
        # Several ranks share one temporary (same token): each may be the one that makes it.
        tmp = LocalStore(self.root).stage(
            name, token, exist_ok=self.config.dist is not None, writer=_writer(job, rank)
        )
        for service in self.services:  # (a hot resume's offer: a new engine needs no file)
            service.before_write(job)
        faults.point("before_shard_write")
        flat: dict[str, Any] = {k: Serialized(v) for k, v in job.objects.items()}
        for spec in self.job_specs(job):
            arena = self.arenas[job.arena_ids[spec.arena]]
            flat[spec.fqn] = worker_view(arena, spec)
        self.thread_errors.clear()
        before = default_writer.fallbacks  # one save at a time: the difference is this one's
        crcs = self._write_format(flat, tmp, job, pg)
        self.records_fallbacks = default_writer.fallbacks - before
        del flat
        if self.thread_errors:
            raise self.thread_errors[0]
        faults.point("after_shard_write")
        for service in self.services:  # (a hot resume's offer: the memory is unchanged)
            service.after_write(job)
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

    def job_specs(self, job: SaveJob) -> list[TensorSpec]:
        """Where ``job``'s tensors lie in its arenas."""
        return job.specs if job.specs is not None else self.specs[tuple(job.arena_ids)]

    def _write_format(
        self, flat: dict[str, Any], tmp: Path, job: SaveJob, process_group: Any = None
    ) -> dict:
        if job.chunks is not None:  # written chunk by chunk as the trainer copies them
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
        failed = self.publisher.publish(job, stats) if self.uploads is None else None
        if failed is not None:
            failed["message"] = where.format("upload") + failed["message"]
            return ("failed", failed)
        return ("committed", stats)

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
                # The services' (the export wanted; offered before written: what a new engine
                # checked, hot_serve.py; several ranks: _commit_all)
                **self._manifest_fields(job),
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

    def _manifest_fields(self, job: SaveJob) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for service in self.services:
            fields.update(service.manifest(job))
        return fields

    def _prune(self, job_id: int | None, request: PruneRequest, step: int) -> None:
        try:
            with self.pins.pruning() as pinned:  # (protect() since the request was made)
                pinned = (*pinned, *self.publisher.waiting())  # (kept until uploaded)
                report = request.run(self.root, self.config, step, pinned)
            self.events.send(M.Pruned(job_id, report, None))
        except BaseException as e:  # noqa: BLE001
            self.events.send(M.Pruned(job_id, None, error_info(e)))


class Publisher:
    """With a remote tier, each step committed here published to the store and its store
    pruned. One rank: through ``queue`` (committed steps waiting to upload, uploaded in order
    on its thread, the save's ``Committed`` or ``Failed`` sent after), so that the next save is
    written while the upload runs. Several ranks: in rank 0's commit, as before."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.store: Any = None  # storage.FsspecStore of the tier, opened at first use
        self.armed: dict[int, dict[str, Any]] = {}  # queued uploads' object-store fault points
        tier = worker.config.remote
        self.queue = (
            UploadQueue(tier.max_queued_uploads, tier.url)
            if tier is not None and worker.config.dist is None
            else None
        )

    def queued(self, job: SaveJob, stats: dict[str, Any]) -> None:
        """``job`` is committed here: its upload joins the queue (waits for room at the bound)."""
        assert self.queue is not None
        self.armed[job.job_id] = {p: f for p, f in job.faults.items() if p in faults.REMOTE_POINTS}
        self.queue.put(job.step, lambda: self.upload(job, stats))

    def waiting(self) -> set[int]:
        """The steps committed here and not yet in the store (queued, or left by a failed or
        cut upload for the next one to publish): a local prune keeps them."""
        if self.queue is None:
            return set()
        pending = pending_uploads(self.worker.root, self.worker.config.layout)
        return self.queue.steps() | set(pending["steps"] if pending is not None else ())

    def faults_for(self, job: SaveJob) -> dict[str, Any]:
        """``job``'s armed fault points, and the object-store points armed for the saves whose
        upload runs beside its write (a test's point reaches the upload it was armed for)."""
        snap = dict(job.faults)
        for armed in list(self.armed.values()):
            for p, f in armed.items():
                snap.setdefault(p, f)
        return snap

    def upload(self, job: SaveJob, stats: dict[str, Any]) -> None:
        """The upload queue's work for ``job`` (committed here): publish, then report. Its
        fault points fire as armed for ``job`` (the main loop arms the next save's meanwhile)."""
        with faults.armed_for(job.faults):
            try:
                failed = self.publish(job, stats)
            finally:
                self.armed.pop(job.job_id, None)
            if failed is not None:
                self.worker.events.send(M.Failed(job.job_id, failed))
            else:  # then the local prune, as after a commit without a store (a failed one: none)
                self.worker.events.send(M.Committed(job.job_id, stats))
                faults.point("after_commit")  # a URL root's step is committed once in the store
                if job.prune is not None:
                    self.worker._prune(job.job_id, job.prune, job.step)

    def drain(self) -> None:
        """Every queued upload done (the trainer stops the worker, or is gone)."""
        if self.queue is not None:
            self.queue.drain()

    def publish(self, job: SaveJob, stats: dict[str, Any]) -> dict[str, Any] | None:
        """With a remote tier: publish the step just committed here, then prune the store.

        Returns None (and adds the upload's figures to ``stats``) or the failure's info, marked
        as an upload failure: the step stays committed locally, and the next save retries it.
        """
        tier = self.worker.config.remote
        if tier is None:
            return None
        try:
            if self.store is None:
                self.store = tier.open()
            figures = publish_after_commit(
                self.store,
                tier,
                self.worker.root,
                self.worker.config.layout,
                job.step,
                pinned=(
                    *(job.prune.pinned if job.prune is not None else ()),
                    *self.worker.pins.kept(),
                ),
                resumed_from=job.prune.resumed_from if job.prune is not None else None,
            )
        except BaseException as e:  # noqa: BLE001 - reported on the save's handle
            info = error_info(e)
            info["upload"] = True
            return info
        # A spool's record (and any root's: `ls` shows the steps not in it as pending uploads).
        try:
            mark_published(
                self.worker.root,
                tier,
                self.worker.config.layout,
                [job.step, *figures["uploaded_steps"]],
            )
        except OSError:
            pass  # in the store all the same; a restart finds it there and records it
        stats.update(figures)
        stats["remote_path"] = f"{tier.url}/{_layout.dir_name(self.worker.config.layout, job.step)}"
        return None


def _link_from(
    links: LinkSource, config: WorkerConfig, job: SaveJob, tmp: Path, views: dict[str, Any]
) -> Previous | None:
    """What ``job``'s save (written into ``tmp``, of staged ``views``) may link from."""
    new = about_new(job.step, job.metrics, config.run_id, job.metadata, job.tier)
    known = known_digests(views, job.digests)
    return links.previous(tmp, config.fmt, job.extra, known, new=new)


def _writer(job: SaveJob, rank: int) -> dict[str, Any]:
    """Who writes ``job``'s temporary, noted beside it: ``ls`` shows the write in progress
    while this process lives (pid and its start time: a reused pid is not it)."""
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


def _trainer_gone(parent_pid: int) -> bool:
    """Whether the trainer that started this worker is gone (0: no trainer to watch)."""
    return not trainer_alive(parent_pid)()


def _receive(
    jobs: Connection,
    events: Any,
    inbox: queue.SimpleQueue,
    arenas: dict[int, torch.Tensor] | None = None,
    *,
    parent_pid: int = 0,
    ended: threading.Event | None = None,
    services: Sequence[WorkerService] = (),
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
    written: ``Worker.run`` writes it at the pipe's end). Each message goes to the services
    first (``on_message``: replication notes the arenas for its sender, the pins apply a
    ``Protect`` at once, not behind the save written now)."""
    try:
        while True:
            while parent_pid and not jobs.poll(RECEIVE_POLL_S):
                if _trainer_gone(parent_pid):
                    raise EOFError("the trainer is gone (another process holds its pipe open)")
            msg = jobs.recv()
            taken = False
            for service in services:
                taken = service.on_message(msg) or taken
            if isinstance(msg, M.Arena):
                if arenas is not None:
                    arenas[msg.arena_id] = msg.tensor
                    msg = M.Arena(msg.arena_id, None)  # (the inbox holds no reference to it)
                events.send(M.Mapped(msg.arena_id))
            if isinstance(msg, M.Drop) and arenas is not None:
                arenas.pop(msg.arena_id, None)
                events.send(M.Dropped(msg.arena_id))
            if taken:
                continue
            if isinstance(msg, (M.Protect, M.Unprotect)):  # no pins here: nothing to keep
                if isinstance(msg, M.Protect):
                    events.send(M.Protected(msg.step))
                continue
            inbox.put(msg)
    except BaseException as e:  # noqa: BLE001 - EOFError: the trainer is gone
        if ended is not None:
            ended.set()
        inbox.put(e)


#: Seconds the reader thread waits for a message before it looks whether the trainer lives.
RECEIVE_POLL_S = 0.5


def _job_group(keys: JobKeys, cfg: DistConfig | None, tag: str) -> Any:
    """The save's group of every rank's worker (none for one rank), once the workers have
    met: failing at once when a peer's worker is said to have died with its trainer, and
    reusing the group kept from the last save when every rank still holds it (peer_gone.py,
    dist.job_group)."""
    if cfg is None:
        return contextlib.nullcontext(None)
    faults.point("before_job_group")
    try:
        fresh = meet_on_side_store(cfg, tag, not _dist.holds_group(cfg))
    except BaseException:
        _dist.drop_group()  # (at once: a peer that met after the timeout must not wait in it)
        raise
    return keys.group(cfg, tag, reuse=not fresh)


def _offered_by_rank(results: dict[int, tuple]) -> dict[str, Any]:
    """Several ranks: ``offered_ranks``, each rank's checksums of its part offered before it
    was written (each rank's new engine checks its own at start)."""
    offered = {str(r): res[3] for r, res in results.items() if len(res) > 3 and res[3]}
    return {"offered_ranks": offered} if offered else {}

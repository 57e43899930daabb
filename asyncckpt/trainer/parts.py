"""``EngineParts``: one engine composed of its parts, and its lifecycle (``start``/``stop``/
``drain``/``close``).

The parts have explicit interfaces: a ``Saver`` (saving.py: validation, staging slots,
back-pressure, the hand-off), the ``JobTable`` (jobs.py: saves in flight, commits and
failures), a ``WorkerSupervisor`` (supervisor.py: the worker's process, events, death and
restarts), a ``Restorer`` (restore.py: loading) and a ``SigtermHandler`` (preemption.py). It
is synchronous and thread-safe; the facades (engine.py, sync.py) wrap it.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.multiprocessing as tmp

from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster import peer_gone
from asyncckpt.cluster.local_recovery import clean_local_root
from asyncckpt.core import layout as _layout
from asyncckpt.errors import CheckpointError
from asyncckpt.formats import check_format, default_format, staged
from asyncckpt.formats.components import COMPONENTS, Component, check_spec
from asyncckpt.formats.differential import KeepRule
from asyncckpt.io.throttle import ThrottleConfig, WritePause
from asyncckpt.memory import hot_serve
from asyncckpt.memory import tier as memory_tier
from asyncckpt.options import EngineOptions
from asyncckpt.retention import RetentionPolicy, should_prune
from asyncckpt.staging.arenas import check_memory
from asyncckpt.storage.remote import mark_published, reconcile_spool
from asyncckpt.trainer.checks import check_export, check_picklable
from asyncckpt.trainer.earlier_worker import EarlierWorker, holds_root
from asyncckpt.trainer.jobs import CommitContext, JobTable, log_unraised
from asyncckpt.trainer.ledger import GoodputMeter, auto_schedule
from asyncckpt.trainer.local_load import StepAgreement
from asyncckpt.trainer.preemption import SigtermHandler
from asyncckpt.trainer.ranks import Ranks, check_node_local, node_local, replication
from asyncckpt.trainer.restore import Restorer
from asyncckpt.trainer.roots import resolve_root
from asyncckpt.trainer.saving import Saver, SaveRules
from asyncckpt.trainer.supervisor import WorkerSupervisor, lock_root
from asyncckpt.worker.config import WorkerConfig

__all__ = ["EngineParts", "left_by"]

log = logging.getLogger("asyncckpt")


class EngineParts:
    """One engine's parts and its lifecycle (``start``/``stop``/``drain``); see the module."""

    def __init__(self, root: str | os.PathLike, opts: EngineOptions) -> None:
        self.opts = opts
        self.root, self.remote, self.local_keep = resolve_root(root, opts)
        # A URL root: self.root is its spool, a local copy of what the store holds.
        self.spooled = isinstance(root, str) and self.remote is not None and opts.remote is None
        check_export(opts.export, self.root)
        self.layout = _layout.check_layout(opts.layout)
        self.components: dict[str, Component] | None = None
        if opts.components is not None:
            if opts.format is not None:
                raise ValueError(
                    "pass format= or components= (each component has its own format), not both"
                )
            self.components = check_spec(opts.components)
            self.fmt = COMPONENTS
        else:
            # Built-in or registered (formats.register_format); aliases resolved.
            self.fmt = check_format(opts.format or default_format(self.layout))
        if opts.keep is not None and not isinstance(opts.keep, RetentionPolicy):
            raise TypeError(
                f"keep must be a retention policy (e.g. KeepLast(3)), not {opts.keep!r}"
            )
        check_picklable(keep=self.local_keep, remote=self.remote, export=opts.export)
        assert opts.throttle is not None  # resolve_options fills it in
        self.throttle: ThrottleConfig = opts.throttle
        # The trainer's "hold the writes" hint; outlives worker restarts (handed to each one).
        self.write_pause = WritePause(tmp.get_context("spawn"))
        d = opts.distributed
        rank, world_size, local_rank = _dist.detect(d.rank, d.world_size, d.local_rank)
        node = _dist.detect_node(rank, world_size, local_rank, d.node_rank, d.ranks_per_node)
        self.ranks = Ranks(rank, world_size, local_rank, node)
        self.replication = replication(self.ranks, opts)
        check_node_local(self.ranks, opts, self.remote)
        rank = self.ranks.rank
        prunes_here = should_prune(rank, self.ranks.local_rank, d.storage)
        legacy = staged.legacy_ranks(rank, self.ranks.world_size, d.legacy_ranks)
        self.run_id = uuid.uuid4().hex[:16]
        self.schedule = opts.schedule.make()
        self.goodput = GoodputMeter(
            self.root,
            self.run_id,
            writes=rank == 0,
            load_seconds=lambda: self.restorer.load_seconds,
        )
        self.jobs = JobTable(
            opts.staging.max_in_flight,
            CommitContext(
                self.root,
                self.layout,
                rank,
                self.run_id,
                export=opts.export,
                remote=self.remote,
                on_commit=self.goodput.then(opts.on_commit),
                keep_resumed=opts.retention.keep_resumed,
            ),
        )
        self.restorer = Restorer(
            self.root,
            self.layout,
            self.fmt,
            self.components,
            verify_on_load=opts.verify_on_load,
            legacy=legacy,
            rank=rank,
            world_size=self.ranks.world_size,
            remote=self.remote,
            on_loaded=self._on_loaded,
            quarantine=prunes_here,  # one rank moves a corrupt checkpoint aside
        )
        self.rendezvous = _dist.Rendezvous()
        self.dist_cfg: _dist.DistConfig | None = None  # once started, when world_size > 1
        self.supervisor = WorkerSupervisor(
            self.jobs,
            self._worker_config,
            self.write_pause,
            write_timeout=opts.write_timeout,
            # Nobody serves the side store then: refuse the other ranks' workers rather than
            # leave them waiting on a socket that no process answers.
            on_start_failed=self.rendezvous.close,
            on_worker_lost=lambda link, pid: self.saver.tier.worker_lost(link, pid),
        )
        # SIGTERM: drain, then one last save (preemption.py).
        self.sigterm = SigtermHandler(
            self.schedule,
            enabled=opts.preemption.handle_sigterm,
            final_save=opts.preemption.final_save,
            drain=lambda timeout: self.drain(timeout=timeout),
            stop=lambda: self.stop(drain=False),
            in_flight=lambda: len(self.jobs),
            before_drain=lambda: self.saver.tier.persist(memory_tier.PREEMPTION),
        )
        self.saver = Saver(
            SaveRules(
                root=self.root,
                layout=self.layout,
                fmt=self.fmt,
                components=self.components,
                legacy=legacy,
                rank=rank,
                run_id=self.run_id,
                max_in_flight=opts.staging.max_in_flight,
                max_host_bytes=opts.staging.max_host_bytes,
                allow_older_steps=opts.retention.allow_older_steps,
                export=opts.export,
                keep=self.local_keep,
                prunes_here=prunes_here,
                prune_scope=opts.retention.scope,
                keep_resumed=opts.retention.keep_resumed,
                differential=opts.staging.differential,
            ),
            jobs=self.jobs,
            worker=self.supervisor,
            restorer=self.restorer,
            schedule=self.schedule,
            sigterm=self.sigterm,
            is_started=lambda: self.started,
        )
        self.saver.memory.every_steps = opts.schedule.memory_every_steps
        self.saver.memory.persist_on_close = opts.memory.persist_on_close
        self.saver.memory.replicas = opts.memory.replicas
        self.saver.after_save = self.goodput.saved
        if opts.schedule.mtbf is not None:
            self.goodput.auto = auto_schedule(
                opts.schedule, self.goodput, self.schedule, self.saver.memory
            )
        self.restorer.kept_while_read = self.saver.pins.kept_while_read
        self.started = False
        self.lock_fd: int | None = None
        self.clean_in_worker = False  # the next worker cleans the root (earlier_worker.py)
        self.goodput.built()

    def _worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            root=str(self.root),
            layout=self.layout,
            fmt=self.fmt,
            rank=self.ranks.rank,
            run_id=self.run_id,
            throttle=self.throttle,
            parent_pid=os.getpid(),
            local_rank=self.ranks.local_rank,
            dist=self.dist_cfg,
            remote=self.remote,
            export=self.opts.export,
            orphan_deadline_s=self.opts.write_timeout or WorkerConfig.orphan_deadline_s,
            spool=self.spooled,
            store_socket=self.rendezvous.listener,
            replication=self.replication,
            hot_hold_s=hot_serve.hold_for(self.opts.memory.hold_seconds),
            hot_hold_auto=self.opts.memory.hold_seconds is None,  # (room checked at the death)
            differential=self.opts.staging.differential,
            keep=KeepRule(self.local_keep, self.opts.retention.scope, self.run_id),
            clean_root=self._clean_once(),
        )

    def _clean_once(self) -> bool:
        """Whether the worker about to start cleans the root (the first one after a start
        that did not wait for an earlier trainer's worker; a replacement finds only what its
        predecessor left, which the next start removes)."""
        clean, self.clean_in_worker = self.clean_in_worker, False
        return clean

    def _on_loaded(self, step: int) -> None:
        self.jobs.resumed_from = step
        self.goodput.resumed(step)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.started:
            raise CheckpointError("engine already started")
        t0 = time.monotonic()
        budget = self.opts.staging.max_host_bytes
        if budget is not None:
            # The budget is what staging will take at most: refused now if the machine does
            # not have it, not at the first save after a step of training.
            check_memory(budget)
        rank, world_size = self.ranks.rank, self.ranks.world_size
        if world_size > 1:
            # Before joining this run: the other workers of this rank's last run may wait for
            # its worker, which died (peer_gone.py); rank 0's start may wait for them in turn.
            peer_gone.announce_if_gone(self.root, rank)
            # Rank 0 cleans, then publishes the side store's address (dist.py): the other
            # ranks touch the root only after that, so the cleanup never races them.
            self.dist_cfg = self.rendezvous.setup(
                rank,
                world_size,
                self.ranks.local_rank,
                store=self.opts.distributed.store,
                timeout=self.opts.distributed.timeout,
                before_publish=self._open_and_clean if rank == 0 else None,
            )
            if node_local(self.ranks, self.opts):
                # Every node's local rank 0 commits its node's directory (node_commit.py).
                assert self.ranks.node is not None
                per = self.ranks.node.ranks_per_node
                self.dist_cfg = replace(self.dist_cfg, ranks_per_node=per)
                # Which step loads, and the fetch of a node's replica where its disk lacks it.
                self.restorer.agreement = StepAgreement(self.dist_cfg, self.root, self.layout)
                self.restorer.hot.together = True  # every rank loads: its vote waits for all
            self.jobs.dist_token = self.dist_cfg.token
            if rank == 0 and not node_local(self.ranks, self.opts):
                # For a later run's engines: where to say a rank's worker died (peer_gone.py).
                c = self.dist_cfg
                peer_gone.record_run(self.root, c.host, c.port, c.token)
            self.saver.memory.dist = self.dist_cfg  # the ranks agree on common memory steps
            self.restorer.hot.vote_cfg = self.dist_cfg  # ... and on a hot resume (hot_resume.py)
            if rank != 0:
                self._after_node_leader(self._open_and_clean)
        else:
            self._open_and_clean()
        self.supervisor.start()
        # Not waiting for the worker's Ready here: its start (a spawned interpreter importing
        # torch, seconds) overlaps the trainer's own; a save stages, then waits for it only
        # if it is not ready yet, and a failed start fails that save.
        self.started = True
        self.goodput.started(time.monotonic() - t0)
        # Ours runs before multiprocessing's own exit hook, which would join the worker (it
        # ignores SIGTERM and waits on its pipe) forever if the engine was never closed.
        atexit.register(self._at_exit)

    def _after_node_leader(self, open_and_clean: Callable[[], None]) -> None:
        """Node-local roots of several nodes: the local rank 0 of node n > 0 cleans its root
        first, and says so in the side store; its node's other ranks open the root only then
        (a cleanup racing their start removed their write probe). Node 0's rank 0 cleaned
        before it published the side store's address, which the others waited for."""
        node = self.ranks.node
        if not node_local(self.ranks, self.opts) or node is None or node.node_rank == 0:
            open_and_clean()
            return
        assert self.dist_cfg is not None
        store = _dist.side_store(self.dist_cfg)
        key = f"asyncckpt/{self.dist_cfg.token}/cleaned/{node.node_rank}"
        if self.ranks.local_rank == 0:
            try:
                open_and_clean()
            except BaseException as e:
                store.set(key, f"error:{type(e).__name__}: {e}")  # its node fails with it
                raise
            store.set(key, "ok")
            return
        store.wait([key])
        said = store.get(key).decode()
        if said != "ok":
            raise _dist.relayed_failure(
                f"node {node.node_rank}'s local rank 0 could not start", said[6:]
            )
        open_and_clean()

    def _open_and_clean(self) -> None:
        rank = self.ranks.rank
        if self.remote is not None and rank == 0:
            # A missing or read-only bucket: refused now, as a local root is, not at the
            # first upload after steps have committed locally.
            self.remote.open().probe()
        # One rank on a local root: the start does not wait for a worker an earlier trainer
        # left finishing its saves; the loads that must read what it commits wait for it, and
        # this engine's worker cleans the root once it follows it (earlier_worker.py).
        alone = self.ranks.world_size == 1 and self.remote is None
        self.lock_fd = lock_root(
            self.root, rank, self.opts.write_timeout, wait_for_orphan=not alone
        )
        self.restorer.root_locked = True  # ours; lock_root waited for an orphaned worker, or:
        if alone and holds_root(self.root, rank):
            bound = self.opts.write_timeout or WorkerConfig.orphan_deadline_s
            self.restorer.orphans.earlier = EarlierWorker(
                self.root, rank, bound, self.supervisor.was_ready
            )
            self.clean_in_worker = True
        if self.saver.pinned:  # protect() before the start: other processes see it now
            self.saver.pins.publish()
        try:  # a step loaded while the earlier worker committed it: committed? (hot_resume.py)
            self.restorer.hot.check_committed(self.layout)
        except BaseException:
            os.close(self.lock_fd)  # not started: the root is not ours
            self.lock_fd = None
            raise
        # One cleaner per root: rank 0, and on node-local roots each node's local rank 0
        # (its node's other ranks touch the root only in a save, which waits for it).
        if rank != 0 and not (node_local(self.ranks, self.opts) and self.ranks.local_rank == 0):
            return
        if self.clean_in_worker:  # (after the earlier worker: it may still write temporaries)
            return
        clean_local_root(self.root)
        if self.remote is not None:  # uploads cut by a crash: prefixes with no marker
            store = self.remote.open()
            removed = store.clean_leftovers(self.layout)
            if removed:
                log.warning("removed uncommitted uploads in %s: %s", self.remote.url, removed)
            if self.spooled:  # the store says what exists (remote.reconcile_spool)
                reconcile_spool(self.root, self.remote, store, self.layout)
            else:  # the record `ls` reads pending uploads from, before the first one
                mark_published(self.root, self.remote, self.layout, [])

    def _at_exit(self) -> None:
        if self.started:
            try:
                # Staged saves commit first (bounded by the worker's liveness).
                self.close(raise_failure=False, why="the engine was never closed")
            except BaseException:  # noqa: BLE001 - exiting anyway
                log.exception("stopping the checkpoint engine at exit failed")

    def close(self, *, raise_failure: bool, why: str = "") -> None:
        """``stop()``, then the first failed save no caller saw: raised when the caller can
        take it (``raise_failure``: the block was left normally, ``close()``), so a job that
        checks its exit code does not believe in a checkpoint that does not exist; else logged
        as an error with ``why`` (an exception of the user's is already on its way)."""
        try:
            self.stop()
        except BaseException:
            # The stop's own error goes up; an unseen failure is not lost beside it.
            err = self.jobs.take_pending_error()
            if err is not None:
                log_unraised(err, "not raised: stopping the engine failed")
            raise
        err = self.jobs.take_pending_error()
        if err is None:
            return
        if raise_failure:
            raise err
        log_unraised(err, f"not raised: {why}")

    def stop(self, *, drain: bool = True) -> None:
        """Wait for staged saves to commit (``drain``), then stop the worker."""
        if not self.started:
            return
        try:
            if drain and self.saver.memory.persist_on_close:
                self.saver.tier.persist(memory_tier.CLOSE)
            if drain:
                self.drain(progress=True)
        finally:
            self.supervisor.stop()
            self.saver.release_slots()
            if self.lock_fd is not None:
                self.saver.pins.withdraw()  # (before the lock: the pins end with it)
                os.close(self.lock_fd)
                self.lock_fd = None
            self.rendezvous.close()
            if self.dist_cfg is not None and self.ranks.rank == 0:
                peer_gone.forget_run(self.root, self.dist_cfg.token)
            self.started = False
            atexit.unregister(self._at_exit)
            self.goodput.closed()

    def drain(self, timeout: float | None = None, *, progress: bool = False) -> None:
        """Block until nothing is in flight (committed or failed); ``progress``: a bar on a
        terminal once the wait passes ``progress.DRAIN_BAR_AFTER_S`` (``stop``: a person waits)."""
        # An overlapped save still copying is not in flight yet: it will be.
        if not self.saver.wait_staged(timeout):
            raise TimeoutError("an overlapped save is still staging")
        self.jobs.drain(self.supervisor.watching, timeout, progress)

    def raise_pending_error(self) -> None:
        """Raise the last failure, once, unless the caller already saw it on its handle."""
        err = self.jobs.take_pending_error()
        if err is not None:
            raise err

    def resume(
        self, state: Any, mode: str, path: str | os.PathLike | None, strict: bool = True
    ) -> int | None:
        """SkyRL's resume modes: "latest", "from_path" (needs ``path``) or "none"."""
        if mode == "none":
            return None
        if mode == "latest":
            return self.restorer.load_latest(state, strict)
        if mode == "from_path":
            if path is None:
                raise ValueError('resume mode "from_path" needs path=')
            return self.restorer.load(state, path=path, strict=strict)
        raise ValueError(f'resume mode must be "latest", "from_path" or "none", not {mode!r}')


def left_by(exc_type: type[BaseException] | None) -> str:
    """Why a failed save was not raised on leaving an engine's block: what left it."""
    return f"the engine's block was left by {getattr(exc_type, '__name__', exc_type)}"

"""The front door: ``save`` / ``wait`` / ``load``, and the engine's lifecycle.

``EngineParts`` composes one engine from objects with explicit interfaces: a ``Saver``
(saving.py: validation, staging slots, back-pressure, the hand-off), the ``JobTable`` (jobs.py:
saves in flight, commits and failures), a ``WorkerSupervisor`` (supervisor.py: the worker's
process, events, death and restarts), a ``Restorer`` (restore.py: loading) and a
``SigtermHandler`` (preemption.py). It is synchronous and thread-safe; ``CheckpointEngine``
(async, anyio: asyncio and trio) and ``SyncCheckpointEngine`` (sync.py) are facades over it that
share every method that does not wait (``EngineBase``). Options: options.py.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import uuid
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import torch.multiprocessing as tmp
from typing_extensions import Unpack

from asyncckpt.cluster import peer_gone
from asyncckpt.core import layout as _layout
from asyncckpt.errors import CheckpointError
from asyncckpt.formats import check_format, default_format
from asyncckpt.formats.components import COMPONENTS, Component, check_spec
from asyncckpt.formats.differential import KeepRule
from asyncckpt.formats.loadcheck import LoadReport
from asyncckpt.io.throttle import AppliedThrottle, ThrottleConfig, WritePause
from asyncckpt.memory import tier as memory_tier
from asyncckpt.options import (
    Distributed,
    EngineOptions,
    MemoryTier,
    ObjectStore,
    Preemption,
    Retention,
    Schedule,
    Staging,
    resolve_options,
)
from asyncckpt.retention import CheckpointInfo, RetentionPolicy
from asyncckpt.staging.arenas import check_memory
from asyncckpt.stats import EngineStats, SaveStats
from asyncckpt.storage import RemoteTier
from asyncckpt.trainer import pins
from asyncckpt.trainer.jobs import CommitContext, JobTable, SaveHandle, log_unraised
from asyncckpt.trainer.preemption import SigtermHandler
from asyncckpt.trainer.restore import Restorer
from asyncckpt.trainer.restore import check_step as _check_step
from asyncckpt.trainer.saving import SaveOptions, Saver, SaveRules
from asyncckpt.trainer.supervisor import WorkerSupervisor, lock_root
from asyncckpt.worker.loop import WorkerConfig

if TYPE_CHECKING:
    from asyncckpt.cluster.dist import Node
    from asyncckpt.storage.prune import PruneResult
    from asyncckpt.worker.export import HFExport

__all__ = ["CheckpointEngine", "EngineBase", "EngineParts", "PauseHooks", "Ranks", "SaveHandle"]

log = logging.getLogger("asyncckpt")

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """Where this engine sits in the job: the one source of its rank and node (``dist.detect``,
    ``dist.detect_node``)."""

    rank: int
    world_size: int
    local_rank: int
    node: Node | None = None  # None: several nodes of a size nobody said

    @property
    def nodes(self) -> int | None:
        return None if self.node is None else self.world_size // self.node.ranks_per_node


def _replication(ranks: Ranks, opts: EngineOptions) -> Any:
    """``MemoryTier(replicas=1)``: whom this rank's worker sends its memory saves to and whose
    it holds (replication.py); refused where there is no other node to hold them."""
    if not opts.memory.replicas:
        return None
    from asyncckpt.memory.replication import ReplicaConfig, peer_rank, source_rank

    nodes = ranks.nodes
    if ranks.node is None or nodes is None or nodes < 2:
        raise ValueError(
            "memory=MemoryTier(replicas=1) keeps each memory save on another node too, and "
            + (
                "this job runs on one node"
                if nodes is not None
                else "this job's node layout is unknown (LOCAL_RANK differs from the rank but "
                "no LOCAL_WORLD_SIZE/GROUP_RANK or Distributed(node_rank=, ranks_per_node=) "
                "says how many ranks each node runs)"
            )
            + ": use replicas=0 here"
        )
    node, per = ranks.node.node_rank, ranks.node.ranks_per_node
    return ReplicaConfig(
        peer=peer_rank(ranks.rank, node, per, nodes),
        source=source_rank(ranks.rank, node, per, nodes),
    )


def _node_local(ranks: Ranks, opts: EngineOptions) -> bool:
    """Node-local roots on several nodes: each node's local rank 0 commits (node_commit.py)."""
    nodes = ranks.nodes
    return opts.distributed.storage == "local" and nodes is not None and nodes > 1


def _check_node_local(ranks: Ranks, opts: EngineOptions, remote: Any) -> None:
    """What needs every rank's files in one root is refused on node-local roots, before
    anything is written: an upload (each node would publish its own part under the step's
    name) and an export (rank 0's node holds only its ranks' shards)."""
    if not _node_local(ranks, opts):
        return
    for what, given in (("a remote tier (remote=, a URL root)", remote), ("export=", opts.export)):
        if given is not None:
            raise ValueError(
                f'{what} is not supported with Distributed(storage="local") on several nodes: '
                "each node's root holds only its own ranks' files (and rank 0's); save to one "
                'root every node writes (storage="shared") for it'
            )


class EngineParts:
    """One engine's parts and its lifecycle (``start``/``stop``/``drain``); see the module."""

    def __init__(self, root: str | os.PathLike, opts: EngineOptions) -> None:
        from asyncckpt.cluster import dist as _dist
        from asyncckpt.formats import staged
        from asyncckpt.retention import should_prune

        self.opts = opts
        self.root, self.remote, self.local_keep = _resolve_root(root, opts)
        # A URL root: self.root is its spool, a local copy of what the store holds.
        self.spooled = isinstance(root, str) and self.remote is not None and opts.remote is None
        _check_export(opts.export, self.root)
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
        _check_picklable(keep=self.local_keep, remote=self.remote, export=opts.export)
        assert opts.throttle is not None  # resolve_options fills it in
        self.throttle: ThrottleConfig = opts.throttle
        # The trainer's "hold the writes" hint; outlives worker restarts (handed to each one).
        self.write_pause = WritePause(tmp.get_context("spawn"))
        d = opts.distributed
        rank, world_size, local_rank = _dist.detect(d.rank, d.world_size, d.local_rank)
        node = _dist.detect_node(rank, world_size, local_rank, d.node_rank, d.ranks_per_node)
        self.ranks = Ranks(rank, world_size, local_rank, node)
        self.replication = _replication(self.ranks, opts)
        _check_node_local(self.ranks, opts, self.remote)
        rank = self.ranks.rank
        prunes_here = should_prune(rank, self.ranks.local_rank, d.storage)
        legacy = staged.legacy_ranks(rank, self.ranks.world_size, d.legacy_ranks)
        self.run_id = uuid.uuid4().hex[:16]
        self.schedule = opts.schedule.make()
        self.jobs = JobTable(
            opts.staging.max_in_flight,
            CommitContext(
                self.root,
                self.layout,
                rank,
                self.run_id,
                export=opts.export,
                remote=self.remote,
                on_commit=opts.on_commit,
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
        self.dist_cfg: Any = None  # dist.DistConfig once started, when world_size > 1
        self.supervisor = WorkerSupervisor(
            self.jobs,
            self._worker_config,
            self.write_pause,
            write_timeout=opts.write_timeout,
            # Nobody serves the side store then: refuse the other ranks' workers rather than
            # leave them waiting on a socket that no process answers.
            on_start_failed=self.rendezvous.close,
            on_worker_lost=lambda link, pid: memory_tier.worker_lost(self.saver, link, pid),
        )
        # SIGTERM: drain, then one last save (preemption.py).
        self.sigterm = SigtermHandler(
            self.schedule,
            enabled=opts.preemption.handle_sigterm,
            final_save=opts.preemption.final_save,
            drain=lambda timeout: self.drain(timeout=timeout),
            stop=lambda: self.stop(drain=False),
            in_flight=lambda: len(self.jobs),
            before_drain=lambda: memory_tier.persist(self.saver, memory_tier.PREEMPTION),
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
        self.restorer.kept_while_read = functools.partial(pins.kept_while_read, self.saver)
        self.started = False
        self.lock_fd: int | None = None

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
            hot_hold_s=float(self.opts.memory.hold_seconds),
            differential=self.opts.staging.differential,
            keep=KeepRule(self.local_keep, self.opts.retention.scope, self.run_id),
        )

    def _on_loaded(self, step: int) -> None:
        self.jobs.resumed_from = step

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.started:
            raise CheckpointError("engine already started")
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
            if _node_local(self.ranks, self.opts):
                # Every node's local rank 0 commits its node's directory (node_commit.py).
                assert self.ranks.node is not None
                per = self.ranks.node.ranks_per_node
                self.dist_cfg = replace(self.dist_cfg, ranks_per_node=per)
                from asyncckpt.trainer.local_load import StepAgreement

                # Which step loads, and the fetch of a node's replica where its disk lacks it.
                self.restorer.agreement = StepAgreement(self.dist_cfg, self.root, self.layout)
                self.restorer.hot.together = True  # every rank loads: its vote waits for all
            self.jobs.dist_token = self.dist_cfg.token
            if rank == 0 and not _node_local(self.ranks, self.opts):
                # For a later run's engines: where to say a rank's worker died (peer_gone.py).
                c = self.dist_cfg
                peer_gone.record_run(self.root, c.host, c.port, c.token)
            self.saver.memory.dist = self.dist_cfg  # the ranks agree on common memory steps
            self.restorer.hot.vote_cfg = self.dist_cfg  # ... and on a hot resume (hot.py)
            if rank != 0:
                self._after_node_leader(self._open_and_clean)
        else:
            self._open_and_clean()
        self.supervisor.start()
        # Not waiting for the worker's Ready here: its start (a spawned interpreter importing
        # torch, seconds) overlaps the trainer's own; a save stages, then waits for it only
        # if it is not ready yet, and a failed start fails that save.
        self.started = True
        # Ours runs before multiprocessing's own exit hook, which would join the worker (it
        # ignores SIGTERM and waits on its pipe) forever if the engine was never closed.
        atexit.register(self._at_exit)

    def _after_node_leader(self, open_and_clean: Callable[[], None]) -> None:
        """Node-local roots of several nodes: the local rank 0 of node n > 0 cleans its root
        first, and says so in the side store; its node's other ranks open the root only then
        (a cleanup racing their start removed their write probe). Node 0's rank 0 cleaned
        before it published the side store's address, which the others waited for."""
        node = self.ranks.node
        if not _node_local(self.ranks, self.opts) or node is None or node.node_rank == 0:
            open_and_clean()
            return
        from asyncckpt.cluster.dist import relayed_failure, side_store

        assert self.dist_cfg is not None
        store = side_store(self.dist_cfg)
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
            raise relayed_failure(f"node {node.node_rank}'s local rank 0 could not start", said[6:])
        open_and_clean()

    def _open_and_clean(self) -> None:
        from asyncckpt.cluster.local_recovery import clean_replica_leftovers
        from asyncckpt.storage.prune import clean_leftovers

        rank = self.ranks.rank
        if self.remote is not None and rank == 0:
            # A missing or read-only bucket: refused now, as a local root is, not at the
            # first upload after steps have committed locally.
            self.remote.open().probe()
        self.lock_fd = lock_root(self.root, rank, self.opts.write_timeout)
        self.restorer.root_locked = True  # lock_root waited for an orphaned worker
        if self.saver.pinned:  # protect() before the start: other processes see it now
            pins.publish_pins(self.saver)
        try:  # a step loaded while the earlier worker committed it: committed? (hot.py)
            self.restorer.hot.check_committed(self.layout)
        except BaseException:
            os.close(self.lock_fd)  # not started: the root is not ours
            self.lock_fd = None
            raise
        # One cleaner per root: rank 0, and on node-local roots each node's local rank 0
        # (its node's other ranks touch the root only in a save, which waits for it).
        if rank != 0 and not (_node_local(self.ranks, self.opts) and self.ranks.local_rank == 0):
            return
        removed = clean_leftovers(self.root)
        # A stand-in's write cut short, a dropped replica not yet removed (local_recovery.py).
        removed += clean_replica_leftovers(self.root)
        if removed:
            log.warning("removed leftovers of an interrupted run in %s: %s", self.root, removed)
        if self.remote is not None:  # uploads cut by a crash: prefixes with no marker
            store = self.remote.open()
            removed = store.clean_leftovers(self.layout)
            if removed:
                log.warning("removed uncommitted uploads in %s: %s", self.remote.url, removed)
            if self.spooled:  # the store says what exists (remote.reconcile_spool)
                from asyncckpt.storage.remote import reconcile_spool

                reconcile_spool(self.root, self.remote, store, self.layout)
            else:  # the record `ls` reads pending uploads from, before the first one
                from asyncckpt.storage.remote import mark_published

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
                memory_tier.persist(self.saver, memory_tier.CLOSE)
            if drain:
                self.drain(progress=True)
        finally:
            self.supervisor.stop()
            self.saver.release_slots()
            if self.lock_fd is not None:
                pins.withdraw_pins(self.saver)  # (before the lock: the pins end with it)
                os.close(self.lock_fd)
                self.lock_fd = None
            self.rendezvous.close()
            if self.dist_cfg is not None and self.ranks.rank == 0:
                peer_gone.forget_run(self.root, self.dist_cfg.token)
            self.started = False
            atexit.unregister(self._at_exit)

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


def run_steps(steps: Generator[Callable[[], Any], None, T]) -> T:
    """Run a ``Saver.save_steps``-like generator in place (the sync facade)."""
    try:
        call = next(steps)
        while True:
            try:
                call()
            except BaseException as e:  # (KeyboardInterrupt): the steps undo what they hold
                steps.throw(e)
                raise
            call = steps.send(None)
    except StopIteration as done:
        return done.value


async def run_steps_async(steps: Generator[Callable[[], Any], None, T]) -> T:
    """The same, each blocking call in a worker thread (the async facade)."""
    try:
        call = next(steps)
        while True:
            try:
                await anyio.to_thread.run_sync(call)
            except BaseException as e:  # cancelled: the steps undo what they hold
                steps.throw(e)
                raise
            call = steps.send(None)
    except StopIteration as done:
        return done.value


def _check_export(export: Any, root: Path) -> None:
    if export is None:
        return
    from asyncckpt.worker.export import HFExport, _require_safetensors

    if not isinstance(export, HFExport):
        raise TypeError(f"export must be an HFExport, not {export!r}")
    # The export's own steps, tracker and pruning in the checkpoint root would write into
    # committed checkpoints and delete them by the export's keep.
    if os.path.realpath(export.path) == os.path.realpath(root):
        raise ValueError(
            f"HFExport(path={os.fspath(export.path)!r}) is the checkpoint root: the export "
            "needs a directory of its own (its steps, tracker and pruning are its own)"
        )
    _require_safetensors()  # here, not in the worker after the first due step has committed


def _check_picklable(**options: Any) -> None:
    """What travels to the worker process must pickle: refused here, not at the first save."""
    import pickle

    for name, value in options.items():
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            raise TypeError(
                f"{name}= must be picklable (it runs in the checkpoint worker process): "
                f"{type(e).__name__}: {e}; define it at module level, with no lambdas"
            ) from e


def _resolve_root(
    root: str | os.PathLike, opts: EngineOptions
) -> tuple[Path, RemoteTier | None, RetentionPolicy | None]:
    """(local root, remote tier, local retention) of an engine.

    A path: that root, ``opts.remote`` as its tier (if any) and ``opts.keep`` on disk. A URL
    (``s3://bucket/run``): the store is where checkpoints live, with ``opts.keep``; they are
    written and committed first in a local spool directory, which keeps only the newest (a
    warm copy for a fast resume on the same machine).
    """
    from asyncckpt.core.paths import check_local_root, is_url
    from asyncckpt.retention import KeepLast

    store = opts.object_store
    if isinstance(root, str) and is_url(root):
        if opts.remote is not None:
            raise ValueError(
                f"{root} is already the remote tier; pass remote= only with a local root"
            )
        tier = RemoteTier(root, keep=opts.keep, storage_options=dict(store.storage_options or {}))
        spool = Path(store.spool) if store.spool is not None else _default_spool(tier)
        return check_local_root(spool), tier, KeepLast(1)
    if store.storage_options is not None or store.spool is not None:
        raise ValueError(
            "object_store= (storage_options, spool) is for a URL root (s3://...); for a local "
            "root with an object-store copy pass remote=RemoteTier(url, storage_options=...)"
        )
    if opts.remote is not None and not isinstance(opts.remote, RemoteTier):
        raise TypeError(f"remote must be a RemoteTier, not {opts.remote!r}")
    return check_local_root(root), opts.remote, opts.keep


def _default_spool(tier: RemoteTier) -> Path:
    """``$ASYNCCKPT_SPOOL`` (or the temp dir)/asyncckpt-spool/<scheme>/<bucket>/<path>-<key>.

    ``key`` hashes everything that identifies the store (``RemoteTier.identity``: protocol,
    endpoint, bucket, prefix): two stores with the same bucket and prefix at two endpoints (a
    staging and a production S3, two test servers) never share a spool."""
    import tempfile

    base = Path(
        os.environ.get("ASYNCCKPT_SPOOL") or Path(tempfile.gettempdir()) / "asyncckpt-spool"
    )
    scheme, rest = tier.url.split("://", 1)
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")] or ["root"]
    return base.joinpath(scheme, *parts[:-1], f"{parts[-1]}-{tier.spool_key()}")


def left_by(exc_type: Any) -> str:
    """Why a failed save was not raised on leaving an engine's block: what left it."""
    return f"the engine's block was left by {getattr(exc_type, '__name__', exc_type)}"


async def _load_in_thread(fn: Callable[[], Any]) -> Any:
    """``fn`` (a load) in a worker thread; its warnings are re-emitted here, where
    ``stacklevel`` reaches the awaiting caller's line (from the thread it named anyio's code)."""
    from asyncckpt.trainer.restore import deferring_warnings

    caught: list[str] = []
    try:
        return await anyio.to_thread.run_sync(deferring_warnings(fn, caught))
    finally:
        for msg in caught:
            # 1: here, 2: the facade's method, 3: the user's await.
            warnings.warn(msg, stacklevel=3)


class PauseHooks:
    """Step pre/post hooks on an optimizer that open and close a ``pause_writes`` region."""

    def __init__(self, pause: WritePause, optimizer: Any) -> None:
        self._pause = pause
        self._open = False
        self._handles = [
            optimizer.register_step_pre_hook(self._enter),
            optimizer.register_step_post_hook(self._exit),
        ]

    def _enter(self, *_: Any) -> None:
        if self._open:  # the previous step raised before its post hook: close that region
            self._pause.exit()
        self._pause.enter()
        self._open = True

    def _exit(self, *_: Any) -> None:
        if self._open:
            self._open = False
            self._pause.exit()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._exit()


class EngineBase:
    """What both facades share: construction, and every method that does not wait.

    ``CheckpointEngine`` (async) and ``SyncCheckpointEngine`` (sync.py) add the methods that
    wait (``save``, ``wait``, ``load``...), each in its own style, over the same ``EngineParts``.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        layout: str = "global_step",
        *,
        format: str | None = None,
        keep: RetentionPolicy | None = None,
        throttle: ThrottleConfig | None = None,
        on_commit: Callable[[SaveStats], None] | None = None,
        verify_on_load: bool = True,
        schedule: Schedule | None = None,
        retention: Retention | None = None,
        distributed: Distributed | None = None,
        preemption: Preemption | None = None,
        components: Mapping[str, Component | str | Mapping[str, Component | str]] | None = None,
        remote: RemoteTier | None = None,
        object_store: ObjectStore | None = None,
        export: HFExport | None = None,
        memory: MemoryTier | None = None,
        staging: Staging | None = None,
        **deprecated: Any,
    ) -> None:
        opts = resolve_options(
            {
                "layout": layout,
                "format": format,
                "keep": keep,
                "throttle": throttle,
                "on_commit": on_commit,
                "verify_on_load": verify_on_load,
                "schedule": schedule,
                "retention": retention,
                "distributed": distributed,
                "preemption": preemption,
                "components": components,
                "remote": remote,
                "object_store": object_store,
                "export": export,
                "memory": memory,
                "staging": staging,
            },
            deprecated,
        )
        self._engine = EngineParts(root, opts)

    # -------------------------------------------------------------- what it is
    @property
    def root(self) -> Path:
        return self._engine.root

    @property
    def layout(self) -> str:
        return self._engine.layout

    @property
    def rank(self) -> int:
        """This engine's rank (``Distributed(rank=)``, else torch.distributed's, else 0)."""
        return self._engine.ranks.rank

    @property
    def world_size(self) -> int:
        return self._engine.ranks.world_size

    @property
    def node_rank(self) -> int | None:
        """This rank's node (``Distributed(node_rank=)``, else torchrun's ``$GROUP_RANK``, else
        0 on one node); None when the local rank says there are several nodes but not how many
        ranks each runs (``Distributed(ranks_per_node=)``)."""
        node = self._engine.ranks.node
        return None if node is None else node.node_rank

    @property
    def nodes(self) -> int | None:
        """How many nodes the job runs on (None: unknown, see ``node_rank``)."""
        return self._engine.ranks.nodes

    @property
    def throttle(self) -> ThrottleConfig:
        """The throttle handed to the worker (``throttle=``, else ``ThrottleConfig.background()``)."""
        return self._engine.throttle

    # -------------------------------------------------------------- the worker
    @property
    def worker_pid(self) -> int | None:
        return self._engine.supervisor.pid

    @property
    def worker_restarts(self) -> int:
        """How many workers died (or were killed for ``write_timeout``) and were replaced."""
        return self._engine.supervisor.restarts

    @property
    def worker_ready(self) -> bool:
        """True once the current worker reported ready (it starts in the background)."""
        return self._engine.supervisor.ready.is_set()

    @property
    def worker_throttle(self) -> AppliedThrottle | None:
        """What the current worker applied of ``throttle`` (levers in effect, and those the OS
        refused, with why); None until it is ready."""
        return self._engine.supervisor.report

    @property
    def stats(self) -> EngineStats:
        """The engine's figures across saves, as of now (``EngineStats``): memory saves lost
        with a dead worker, and the step left unprotected until the next memory save."""
        mem = self._engine.saver.memory
        with self._engine.jobs.cond:
            return EngineStats(mem.lost, mem.unprotected_step, mem.shared, mem.unshared)

    @property
    def last_prune(self) -> PruneResult | None:
        """What the worker's last prune (after a commit) kept and deleted; None before any."""
        return self._engine.jobs.last_prune

    # -------------------------------------------------------------- preemption
    @property
    def preempted(self) -> bool:
        """True once SIGTERM (or ``request_preemption_save``) arrived: save once more and stop."""
        return self._engine.sigterm.preempted

    def request_preemption_save(self) -> None:
        """The user-set preemption flag: the next ``should_save`` answers yes."""
        self._engine.sigterm.request()

    # -------------------------------------------------------------- saving, no wait
    def should_save(self, step: int, *, force: bool = False) -> bool:
        """True when the schedule (every N steps / H seconds / preemption) says to save."""
        return self._engine.schedule.should_save(step, force=force)

    def due(self, step: int, *, force: bool = False) -> str | None:
        """Which save is due at ``step``: ``"disk"`` when ``should_save`` says so (it is asked,
        with its effects), else ``"memory"`` every ``Schedule(memory_every_steps=)``, else
        None. ``tier = engine.due(step); if tier: engine.save(step, state, tier=tier)``."""
        if self._engine.schedule.should_save(step, force=force):
            return "disk"
        return "memory" if self._engine.saver.memory.due(step) else None

    def protect(self, step: int) -> None:
        """Never prune ``step``, whatever the retention policy; saves already handed to the
        worker included (it returns once the worker said so)."""
        step = _check_step(step)
        pins.protect(self._engine.saver, step)

    @contextlib.contextmanager
    def pause_writes(self) -> Iterator[None]:
        """Hold the background write while the block runs (an optimizer step on the CPU, say).

        The worker finishes the piece it is writing (at most 1 MiB) and waits until the block
        ends, but no longer than the throttle's ``max_pause_seconds`` per block, so a
        checkpoint always completes. Cheap (two counters in shared memory), nestable, usable
        from any thread, and a no-op with ``ThrottleConfig(max_pause_seconds=0)``.
        """
        pause = self._engine.write_pause
        pause.enter()
        try:
            yield
        finally:
            pause.exit()

    def stage_before_step(self, optimizer: Any) -> Any:
        """Make every ``optimizer.step()`` first wait for an overlapped save's copy.

        A step pre-hook (``register_step_pre_hook``): the step, which mutates the parameters
        and the optimizer's state in place, waits until the copy is over; forward and backward
        before it overlap the copy. Returns torch's hook handle (``remove()`` takes it off).
        Other in-place writes to saved tensors (a BatchNorm's running statistics in a forward
        pass, an EMA of the weights) are not held: ``await handle.staged()``
        before them, or the save fails as torn.
        """
        if not hasattr(optimizer, "register_step_pre_hook"):
            raise TypeError(
                f"stage_before_step needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        saver = self._engine.saver

        def wait_for_copy(*_: Any) -> None:
            h = saver.staging
            if h is not None:
                h.staged_sync()

        return optimizer.register_step_pre_hook(wait_for_copy)

    def pause_writes_during(self, optimizer: Any) -> PauseHooks:
        """``pause_writes`` around every ``optimizer.step()``, via the optimizer's step hooks.

        For optimizer offload: ``engine.pause_writes_during(optimizer)`` once, after creating
        both. Returns a handle whose ``remove()`` takes the hooks off again.
        """
        if not (
            hasattr(optimizer, "register_step_pre_hook")
            and hasattr(optimizer, "register_step_post_hook")
        ):
            raise TypeError(
                f"pause_writes_during needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        return PauseHooks(self._engine.write_pause, optimizer)

    # -------------------------------------------------------------- reading, no wait
    @property
    def last_load_report(self) -> LoadReport | None:
        """What the last successful load did not restore one to one (``LoadReport``: step,
        path, ``missing``, ``unexpected`` and ``missing_objects`` keys); None before any."""
        return self._engine.restorer.last_load_report

    def latest_step(self) -> int | None:
        dirs = self._engine.restorer.committed()
        return dirs[-1].step if dirs else None

    def list_checkpoints(self) -> list[CheckpointInfo]:
        return self._engine.restorer.list_checkpoints()

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The step of the best committed checkpoint by ``metric`` (``save(metrics=...)``):
        lowest for ``mode="min"``, highest for ``"max"``; ties go to the newer, NaN is never
        best. None before any checkpoint; ``ValueError`` if none reports ``metric``."""
        from asyncckpt.retention import best_step

        return best_step(self.list_checkpoints(), metric, mode)

    def disk_usage(self) -> dict[str, int]:
        """Measured bytes of committed checkpoints and leftovers, and the disk's free space.

        Peak use while saving is (kept + in flight) checkpoints: pruning runs only after the
        new checkpoint committed.
        """
        from asyncckpt.storage.prune import disk_usage

        return disk_usage(self.root, self.layout)


class CheckpointEngine(EngineBase):
    """Asynchronous checkpointing for a training loop (asyncio or trio, via anyio).

    >>> engine = CheckpointEngine("ckpts", keep=KeepLast(3))
    >>> async with engine:
    ...     handle = await engine.save(step, {"model": model, "optim": optim})

    Formats: ``"dcp"`` (default for ``layout="global_step"``), ``"torch_dist"`` (Megatron
    dist_checkpointing; default for ``layout="megatron"``; megatron ``ShardedTensor`` /
    ``ShardedObject`` state dicts are accepted as they are) and ``"megatron_legacy"`` (alias
    ``"torch"``: Megatron-LM's per-rank ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files, with
    ``distrib_optim.pt`` for a ``"distrib_optim"`` entry; ``Distributed(legacy_ranks=)`` gives
    tp/pp ranks, else megatron's parallel_state or one directory per rank).

    Options with several knobs are one object each (options.py): ``schedule=Schedule(
    every_steps=, every_seconds=)`` (what ``should_save`` answers), ``retention=Retention(
    scope=, keep_resumed=)`` (how ``keep=`` applies), ``distributed=Distributed(...)``,
    ``preemption=Preemption(handle_sigterm=, final_save=)``, ``throttle=ThrottleConfig...``
    (``ThrottleConfig.for_optimizer_offload()`` for optimizer offload;
    ``ThrottleConfig.background(durable_within=60)`` for a bound on the time to durable),
    ``object_store=ObjectStore(storage_options=, spool=)`` for a URL root,
    ``staging=Staging(max_in_flight=, max_host_bytes=)`` for the host memory saves stage into
    (``ThrottleConfig(write_timeout=)`` fails a save whose worker hangs). The flat keywords
    they replaced (``save_every_steps=``, ``rank=``, ``optimizer_offload=``...) still work for
    one release, with a ``DeprecationWarning`` naming the replacement.

    Multi-rank: under ``torch.distributed`` (or with ``Distributed(rank=, world_size=)``) every
    rank makes its own engine on the same root and calls ``save`` for the same steps. Each rank
    stages and writes only its own shards (DTensor and megatron shards: the local piece); the
    workers agree over their own gloo group and rank 0 commits once every rank's shards are
    durable; any failure fails every rank's handle and commits nothing. ``start`` is the only
    moment the ranks wait for each other on the trainer side (rank 0 publishes its side store's
    address under one key of the training group's store; no collective).
    ``Distributed(store=(host, port))`` replaces that without an initialised group; its
    ``timeout`` bounds how long workers wait for each other per save; its ``storage``
    (``"shared"``, or ``"local"`` for node-local disks) picks the rank(s) that prune.

    Steps go forward: a save of a step lower than the newest committed or in-flight one is
    refused, since the tracker would name an older checkpoint than the newest on disk.
    ``Retention(allow_older_steps=True)`` writes and commits it anyway, and the tracker keeps naming the
    newest step (it never moves backwards).

    ``on_commit(stats: SaveStats)`` is called once per committed save, before its handle
    completes, on the engine's reader thread (``asyncckpt-reader``), never on the training
    thread or the event loop: keep it quick (while it runs, no other event of the worker is
    handled: later commits wait, and so do the handles awaiting them) and thread-safe. An
    exception it raises is logged (logger ``asyncckpt``) and dropped; the save stays committed.
    ``asyncckpt.tensorboard.TensorBoardLogger(log_dir)`` is a ready one. Every manifest also
    records the figures (``python -m asyncckpt stats ROOT``).

    ``components``: a step made of parts, each in its own format at its own path inside the
    step directory, committed together (SkyRL's ``policy/``, ``critic/``, ``data.pt``,
    ``trainer_state.pt``; RLinf's ``actor/iter_NNNNNNN/`` and ``data/data.pt``): a dict of
    name -> ``Component(format, path, tracker)`` (or a format name), and the state passed to
    ``save`` is a dict of name -> that component's state. ``asyncckpt.frameworks`` has the
    specs of SkyRL and RLinf. A load may name only some components (the policy, to evaluate).

    ``ThrottleConfig(durable_within=D)``: seconds within which a save should be durable
    (committed) even when the training keeps every core busy. The worker stays throttled
    (gentle) for the first half of it, then escalates: no rate cap, no pauses, its threads back
    to normal priority and I/O class (where the OS allows). ``SaveStats`` reports
    ``durable_seconds``, ``throttled_seconds``, ``escalated_after_seconds`` and
    ``escalations``. A bound aimed at, not a guarantee: a disk slower than the state's size
    allows still takes its time.

    ``Retention(keep_resumed=)``: the checkpoint this engine loaded (resumed from) is never
    pruned until a newer one commits (``"until_newer"``, default), or for as long as this engine
    runs (``"run"``, Lightning's behaviour: the run's starting point survives
    ``keep=KeepLast(1)``).
    """

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        await anyio.to_thread.run_sync(self._engine.start)
        self._engine.sigterm.install()

    async def aclose(self) -> None:
        """Wait for every staged save to commit, then stop the worker; raise the first save
        that failed unseen (``SaveFailed``: not on its handle, not by ``wait()`` or a save)."""
        await self._close(raise_failure=True)

    async def _close(self, *, raise_failure: bool, why: str = "") -> None:
        self._engine.sigterm.uninstall()
        await anyio.to_thread.run_sync(
            functools.partial(self._engine.close, raise_failure=raise_failure, why=why)
        )

    async def __aenter__(self) -> CheckpointEngine:
        await self.start()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Staged data is never thrown away, also when the block raises; a failed save is
        # raised only when the block ended normally (else the user's exception goes on).
        with anyio.CancelScope(shield=True):
            await self._close(
                raise_failure=exc_type is None,
                why=left_by(exc_type),
            )

    def __enter__(self) -> CheckpointEngine:
        # A plain `with` would otherwise fail with a bare AttributeError (or, worse, run the
        # loop without a worker): say which engine a sync loop wants.
        raise TypeError(
            "CheckpointEngine is async: use `async with engine:`; a loop that is not async "
            "uses SyncCheckpointEngine (same arguments): `with SyncCheckpointEngine(root) as "
            "engine: engine.save(step, state)`"
        )

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:  # pragma: no cover
        pass

    # -------------------------------------------------------------- saving
    async def save(
        self,
        step: int,
        state: Any,
        metrics: Mapping[str, float] | None = None,
        metadata: dict[str, Any] | None = None,
        **options: Unpack[SaveOptions],
    ) -> SaveHandle:
        """Stage ``state`` and return once it is safe to mutate; the write goes on behind.

        ``metadata``: a small JSON object (<= 64 KiB) stored in the checkpoint's manifest and
        shown by ``list_checkpoints`` and ``python -m asyncckpt ls``.

        ``options`` (``saving.SaveOptions``): ``overlap=True``: return at once and copy in the
        background (a thread; on a GPU, a side stream) while the loop goes on; ``await
        handle.staged()`` (or an optimizer hooked with ``stage_before_step``) before the state
        is next mutated. A tensor modified in place before the copy ended fails the save
        (``SaveFailed``), in either mode.
        """
        steps = self._engine.saver.save_steps(step, state, metrics, metadata, **options)
        return await run_steps_async(steps)

    async def wait(self) -> None:
        """Wait until everything in flight has committed; raise if a save failed."""
        await anyio.to_thread.run_sync(self._engine.drain, abandon_on_cancel=True)
        self._engine.raise_pending_error()

    async def prepare(self, state: Any) -> None:
        """Allocate the staging arenas now, so the first save stalls no longer than later ones."""
        self._engine.saver.prepare(state)

    # -------------------------------------------------------------- loading
    async def load_latest(self, state: Any, *, strict: bool = True) -> int | None:
        """Restore the newest good checkpoint into ``state`` in place; None if there is none.

        The whole target is checked against the checkpoint first: a shape or dtype that
        differs, or (``strict=True``) a tensor missing from the checkpoint or one the target
        does not declare, raises ``StateMismatch`` naming the keys, with nothing changed and
        no fallback to an older checkpoint (that is the caller's mistake, not damage). With
        ``strict=False`` the matching keys are loaded and the others skipped; what was skipped
        is logged and kept in ``last_load_report``. Empty containers in the target (a fresh
        optimizer's state) take whatever the checkpoint has under them.

        A damaged checkpoint falls back to the next older one, loudly; one pruned by another
        process while it is read is skipped quietly. A root that does not exist warns and
        returns None (a fresh job's first start); a path that is a checkpoint directory, or a
        root of the other layout, raises ``NotACheckpointRoot``.
        """
        return await _load_in_thread(lambda: self._engine.restorer.load_latest(state, strict))

    async def load(
        self,
        state: Any,
        step: int | None = None,
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int:
        """Restore a given checkpoint (by step, or by directory) into ``state`` in place.

        Checked first like ``load_latest``; raises asyncckpt's errors (``StateMismatch``,
        ``CorruptCheckpoint``: all ``CheckpointError``) with torch's error as the cause.
        """
        return await _load_in_thread(
            lambda: self._engine.restorer.load(state, step=step, path=path, strict=strict)
        )

    async def resume(
        self,
        state: Any,
        mode: str = "latest",
        path: str | os.PathLike | None = None,
        *,
        strict: bool = True,
    ) -> int | None:
        """SkyRL's resume modes: "latest", "from_path" (needs ``path``) or "none"."""
        return await _load_in_thread(lambda: self._engine.resume(state, mode, path, strict))

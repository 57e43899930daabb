"""The front door: ``save`` / ``wait`` / ``load``, and the engine's lifecycle.

``CheckpointEngine`` (async, anyio: asyncio and trio) and ``SyncCheckpointEngine`` (sync.py)
are facades over one ``EngineParts`` (trainer/parts.py: the saver, the job table, the worker's
supervisor, the restorer, the SIGTERM handler) that share every method that does not wait
(``EngineBase``). Options: options.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
from typing_extensions import Unpack

from asyncckpt.formats.components import Component
from asyncckpt.formats.loadcheck import LoadReport
from asyncckpt.io.throttle import AppliedThrottle, ThrottleConfig
from asyncckpt.options import (
    Distributed,
    MemoryTier,
    ObjectStore,
    Preemption,
    Retention,
    Schedule,
    Staging,
    resolve_options,
)
from asyncckpt.retention import CheckpointInfo, RetentionPolicy, best_step
from asyncckpt.stats import EngineStats, SaveStats
from asyncckpt.storage import RemoteTier
from asyncckpt.storage.prune import PruneResult, disk_usage
from asyncckpt.trainer.jobs import SaveHandle
from asyncckpt.trainer.parts import EngineParts, left_by
from asyncckpt.trainer.pause import PauseHooks
from asyncckpt.trainer.ranks import Ranks
from asyncckpt.trainer.restore import check_step as _check_step
from asyncckpt.trainer.saving import SaveOptions
from asyncckpt.trainer.steps import load_in_thread, run_steps_async
from asyncckpt.worker.export import HFExport

__all__ = ["CheckpointEngine", "EngineBase", "EngineParts", "PauseHooks", "Ranks", "SaveHandle"]


class EngineBase:
    """What both facades share: construction, and every method that does not wait.

    ``CheckpointEngine`` (async) and ``SyncCheckpointEngine`` add the methods that wait
    (``save``, ``wait``, ``load``...), each in its own style, over the same engine.
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
        run, total = self._engine.goodput.totals()
        auto = self._engine.goodput.auto
        with self._engine.jobs.cond:
            return EngineStats(
                mem.lost, mem.unprotected_step, mem.shared, mem.unshared,
                self._engine.schedule.every_steps, mem.every_steps,
                auto is not None and auto.chosen, run, total, memory_saves_skipped=mem.skipped,
            )  # fmt: skip

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
        self._engine.goodput.seen(step)
        return self._engine.schedule.should_save(step, force=force)

    def due(self, step: int, *, force: bool = False) -> str | None:
        """Which save is due at ``step``: ``"disk"`` when ``should_save`` says so (it is asked,
        with its effects), else ``"memory"`` every ``Schedule(memory_every_steps=)``, else
        None. ``tier = engine.due(step); if tier: engine.save(step, state, tier=tier)``."""
        self._engine.goodput.seen(step)
        if self._engine.schedule.should_save(step, force=force):
            return "disk"
        return "memory" if self._engine.saver.memory.due(step) else None

    def protect(self, step: int) -> None:
        """Never prune ``step``, whatever the retention policy; saves already handed to the
        worker included (it returns once the worker said so)."""
        step = _check_step(step)
        self._engine.saver.pins.protect(step)

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
        self._engine.restorer.orphans.before_listing()
        dirs = self._engine.restorer.committed()
        return dirs[-1].step if dirs else None

    def list_checkpoints(self) -> list[CheckpointInfo]:
        return self._engine.restorer.list_checkpoints()

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The step of the best committed checkpoint by ``metric`` (``save(metrics=...)``):
        lowest for ``mode="min"``, highest for ``"max"``; ties go to the newer, NaN is never
        best. None before any checkpoint; ``ValueError`` if none reports ``metric``."""
        return best_step(self.list_checkpoints(), metric, mode)

    def disk_usage(self) -> dict[str, int]:
        """Measured bytes of committed checkpoints and leftovers, and the disk's free space.

        Peak use while saving is (kept + in flight) checkpoints: pruning runs only after the
        new checkpoint committed.
        """
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

    Options with several knobs are one object each (see the options reference): ``schedule=Schedule(
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

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
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
        process while it is read is skipped quietly. A root that does not exist or holds no
        checkpoint returns None (a fresh job's first start) and logs one warning naming its
        absolute path (a mistyped root shows there); a path that is a checkpoint directory, or a
        root of the other layout, raises ``NotACheckpointRoot``.
        """
        return await load_in_thread(lambda: self._engine.restorer.load_latest(state, strict))

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
        return await load_in_thread(
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
        return await load_in_thread(lambda: self._engine.resume(state, mode, path, strict))

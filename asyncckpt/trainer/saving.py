"""Saving: validation, staging slots and back-pressure, the hand-off to the worker.

``Saver`` takes a save from the caller's arguments to a job in the worker's pipe: every error
about the input is raised before a byte is written (invariant 8), a slot is reserved (waiting
when ``max_in_flight`` saves hold them all: back-pressure, invariant 6), the state is copied
into the slot's shared arenas, checked for torn tensors (invariant 13), and only then handed to
the worker (invariant 12 holds from there). Its collaborators are explicit: the ``JobTable``
(jobs.py) that completes what was handed over, a ``WorkerPort`` (the supervisor: the current
worker's pipe) and the engine's ``SigtermHandler`` (a SIGTERM during a hand-off waits for it).

How a save is staged is a ``Stager``'s (staging/stager.py, after DCP's ``AsyncStager``): the
saver asks the memory tier (memory/tier.py), the chunked budget (staging/chunked.py) and the disk
slots (stagers.py), in that order, and the first that claims the save stages it; the saver is
their ``Handover`` (the job, its arenas and its hand-off to the worker). Its ``Pins`` (pins.py)
are ``engine.protect``'s.

``save_steps`` is the one implementation of ``save``: a generator that yields the calls that
may block, which the async facade runs in a thread and the sync facade runs in place.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

from typing_extensions import Unpack

from asyncckpt import faults
from asyncckpt.core import layout as _layout
from asyncckpt.core import messages as M
from asyncckpt.core.savejob import SaveJob
from asyncckpt.errors import CheckpointError, SaveFailed, WorkerDied
from asyncckpt.formats import components, staged
from asyncckpt.memory.tier import MemoryStager, MemoryTier, check_tier
from asyncckpt.retention import RetentionPolicy, SaveSchedule
from asyncckpt.staging import chunked
from asyncckpt.staging.arenas import HostBudget, Marks, StagingSlot, any_cuda, layout_key
from asyncckpt.staging.flatplan import FlattenCache
from asyncckpt.staging.stager import Link, PendingSave, SaveHandle, Stager
from asyncckpt.staging.unchanged import CopySkipper
from asyncckpt.stats import SaveStats
from asyncckpt.storage.manifest import check_metadata
from asyncckpt.trainer.jobs import JobTable
from asyncckpt.trainer.pins import Pins
from asyncckpt.trainer.preemption import SigtermHandler
from asyncckpt.trainer.restore import Restorer
from asyncckpt.trainer.restore import check_step as _check_step
from asyncckpt.trainer.stagers import DiskSlots
from asyncckpt.trainer.supervisor import WorkerLink
from asyncckpt.worker.config import PruneRequest
from asyncckpt.worker.export import check_source

__all__ = ["PendingSave", "SaveOptions", "SaveRules", "Saver", "WorkerPort"]

log = logging.getLogger("asyncckpt")


class SaveOptions(TypedDict, total=False):
    """``save()``'s keyword-only options: the one list both facades accept (``**options``).

    ``overlap``: return at once and copy in the background (see ``CheckpointEngine.save``).
    """

    overlap: bool
    tier: str  # "disk" (default) or "memory" (memory/tier.py)


def check_save_options(options: Mapping[str, Any]) -> SaveOptions:
    """``options`` checked and completed with the defaults (the facades' ``**options``)."""
    unknown = set(options) - set(SaveOptions.__annotations__)
    if unknown:
        raise TypeError(
            f"save() got unexpected keyword argument(s) {sorted(unknown)}; {_hint(unknown)}"
        )
    overlap = options.get("overlap", False)
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, not {overlap!r}")
    tier = check_tier(options.get("tier", "disk"))
    if tier == "memory" and overlap:
        raise ValueError("a memory save copies while save() blocks: overlap=True is for disk")
    return SaveOptions(overlap=overlap, tier=tier)


#: Every keyword ``save()`` takes, in its signature's order (the did-you-mean's choices).
SAVE_KEYWORDS = ("step", "state", "metrics", "metadata", *SaveOptions.__annotations__)


def _hint(unknown: Iterable[str]) -> str:
    """The closest keyword to each of ``unknown`` (``metric``: ``metrics``), then all of them."""
    close = {
        name: match[0]
        for name in sorted(unknown)
        if (match := difflib.get_close_matches(name, SAVE_KEYWORDS, n=1))
    }
    said = "; ".join(f"did you mean {m!r} (not {n!r})?" for n, m in close.items())
    return (said + " " if said else "") + f"save() takes {', '.join(SAVE_KEYWORDS)}"


class WorkerPort(Protocol):
    """What the saver needs of the worker's supervisor."""

    @property
    def link(self) -> WorkerLink: ...

    @property
    def reader(self) -> Any: ...  # the thread that reads its events (pins.py)

    @property
    def start_error(self) -> str | None: ...  # why no worker came up (memory/tier.py)

    def wait_ready(self) -> None: ...

    def sending(self) -> contextlib.AbstractContextManager[None]: ...


@dataclass(frozen=True)
class SaveRules:
    """The engine's options that shape a save (fixed at construction)."""

    root: Path
    layout: str
    fmt: str
    components: dict[str, Any] | None
    legacy: Any  # formats.staged's legacy ranks
    rank: int
    run_id: str
    max_in_flight: int
    max_host_bytes: int | None  # Staging(max_host_bytes=): the disk slots' arenas, together
    allow_older_steps: bool
    export: Any  # export.HFExport | None
    keep: RetentionPolicy | None  # the local retention (None: prune nothing here)
    prunes_here: bool  # this rank prunes (retention.should_prune)
    prune_scope: str
    keep_resumed: str
    differential: bool = True  # Staging(differential=): skip copying what a slot holds


class Saver:
    """The save path of one engine (see the module's docstring)."""

    def __init__(
        self,
        rules: SaveRules,
        *,
        jobs: JobTable,
        worker: WorkerPort,
        restorer: Restorer,
        schedule: SaveSchedule,
        sigterm: SigtermHandler,
        is_started: Callable[[], bool],
    ) -> None:
        self.rules = rules
        self.jobs = jobs
        self.worker = worker
        self.restorer = restorer
        self.schedule = schedule
        self.sigterm = sigterm
        self.is_started = is_started
        # The disk slots, then (at the memory tier's first save) its two: one list, shared.
        self.slots = [StagingSlot(i, not rules.max_host_bytes) for i in range(rules.max_in_flight)]
        self.budget = (
            HostBudget(rules.max_host_bytes, rules.max_in_flight)
            if rules.max_host_bytes is not None
            else None
        )
        self.let_go = None if self.budget is None else functools.partial(let_worker_go, self)
        # The last state's flattening, replayed while its structure holds (flatplan.py).
        self.flatten_cache = FlattenCache()
        # Which tensors a slot holds already, byte for byte, need no copy (unchanged.py).
        self.skipper = CopySkipper(rules.differential)
        self.words = M.WordWait(jobs.cond, lambda: self.worker.link, is_started)
        # (A pin needs the worker's word only after a job: pins.py. Every job's id is one.)
        self.pins = Pins(
            rules.root, rules.rank, worker, self.words, is_started, lambda: jobs.next_job > 0
        )
        self.pinned = self.pins.steps  # engine.protect(step): never pruned
        # The memory tier's bookkeeping (MemoryTier: the engine sets its options).
        self.memory = MemoryTier()
        # How a save is staged, asked in this order (staging/stager.py): the memory tier,
        # the chunked budget, the disk slots (which claim every save).
        self.tier = MemoryStager(
            self.memory,
            slots=self.slots,
            jobs=jobs,
            worker=worker,
            host=self,
            sigterm=sigterm,
            skipper=self.skipper,
            budget=self.budget,
            root=rules.root,
            layout=rules.layout,
            committed=restorer.committed,
            is_started=is_started,
        )
        self.chunks = chunked.ChunkedStager(
            self.budget,
            fmt=rules.fmt,
            components=rules.components is not None,
            slots=self.slots,
            jobs=jobs,
            handover=self,
            sigterm=sigterm,
            let_go=self.let_go,
            whole_states=self.memory.active,
        )
        self.disk = DiskSlots(
            slots=self.slots,
            jobs=jobs,
            handover=self,
            skipper=self.skipper,
            budget=self.budget,
            let_go=self.let_go,
            check_can_save=self.check_can_save,
        )
        self.stagers: tuple[Stager, ...] = (self.tier, self.chunks, self.disk)
        # Told of every save (step, tier, seconds it held the loop): the goodput meter.
        self.after_save: Callable[[int, str, float], None] = lambda step, tier, s: None

    # ------------------------------------------------------------------ save()
    def save_steps(
        self,
        step: Any,
        state: Any,
        metrics: Mapping[str, float] | None,
        metadata: dict[str, Any] | None,
        **options: Unpack[SaveOptions],
    ) -> Generator[Callable[[], Any], None, SaveHandle]:
        """``save`` as steps: yields each call that may block (the facade runs it), returns
        the handle."""
        t0 = time.perf_counter()
        opts = check_save_options(options)  # before a slot is reserved
        if self.staging_busy():  # one copy at a time: the previous overlapped save's first
            yield self.wait_staged
        pending = self.begin_save(step, state, metrics, metadata)
        pending.tier = opts["tier"]
        overlap = opts["overlap"]
        # The first that claims it stages it (the disk slots claim every save).
        stager = next(s for s in self.stagers if s.claims(pending, overlap))
        if stager.uses_disk_slot and not self.take_slot(pending, block=False):
            # Other code runs while it waits (the async facade's other tasks, other threads).
            pending.guard = True
            try:
                yield lambda: self.take_slot(pending)
            except BaseException:  # cancelled as it waited (a timeout around save)
                self.disk.give_back_slot(pending)
                raise
        try:
            handle = stager.stage(pending, overlap)
        except BaseException:
            if pending.slot is not None:  # a disk slot it reserved, unused
                self.jobs.unreserve(pending.slot)
            raise
        if pending.tier == "disk":
            self.schedule.mark_saved(pending.step)
        if not handle.skipped:  # (a memory save not taken costs nothing a schedule learns from)
            self.after_save(pending.step, pending.tier, time.perf_counter() - t0)  # (ledger.py)
        return handle

    def check_can_save(self, step: Any) -> int:
        step = _check_step(step)
        if not self.is_started():
            raise CheckpointError(
                "the engine is not started: use `async with engine:` / `with engine:`"
            )
        err = self.jobs.take_pending_error()
        if err is not None:
            raise SaveFailed(f"an earlier save failed: {err}") from err.__cause__
        final = self.rules.root / _layout.dir_name(self.rules.layout, step)
        if final.exists() or step in self.jobs.steps():
            raise CheckpointError(f"step {step} is already committed or in flight at {final}")
        if not self.rules.allow_older_steps:
            self._check_forward(step)
        return step

    def _check_forward(self, step: int) -> None:
        """Refuse a step below the newest committed or in-flight one (the tracker would lag).

        A step this engine found corrupt does not count (it is quarantined, or another rank
        does that). One without asyncckpt's manifest (plain DCP, Megatron: loadable, so it
        counts) is named as such in the refusal: often it is no checkpoint of this run at all.
        """
        known_corrupt = self.restorer.known_corrupt
        dirs = [d for d in self.restorer.committed() if d.step not in known_corrupt]
        newest = dirs[-1].step if dirs else None
        if dirs and step < dirs[-1].step and not (dirs[-1].path / _layout.MANIFEST).exists():
            raise CheckpointError(
                f"step {step} is older than step {newest}: {dirs[-1].path} is not an asyncckpt "
                f"checkpoint (it has no {_layout.MANIFEST}; written by another tool, or by "
                "hand) but holds DCP's .metadata, so it loads and counts as the newest step. "
                "Steps must increase (the tracker names the newest checkpoint and never moves "
                "back): move it out of the root if it is not a checkpoint of this run, or pass "
                "allow_older_steps=True to write older steps anyway"
            )
        flying = max(self.jobs.steps(), default=None)
        for other, what in ((newest, "committed"), (flying, "in flight")):
            if other is not None and step < other:
                raise CheckpointError(
                    f"step {step} is older than step {other}, {what} in {self.rules.root}: "
                    "steps must increase (the tracker names the newest checkpoint and never "
                    "moves back). Resuming an older run? Delete the newer checkpoints, or pass "
                    "allow_older_steps=True to write it anyway (the tracker keeps naming "
                    f"step {other})"
                )

    def begin_save(
        self,
        step: Any,
        state: Any,
        metrics: Mapping[str, float] | None,
        metadata: dict[str, Any] | None = None,
    ) -> PendingSave:
        """Validate and flatten: every error about the input is raised here, before any write."""
        step = self.check_can_save(step)
        clean = check_metrics(metrics)
        meta = check_metadata(metadata)
        export = self.rules.export
        if export is not None and export.due(step):
            check_source(state, export.component)
        flat = self.prepare_state(state)
        key = flat.key if flat.key is not None else layout_key(flat.tensors)
        stats = SaveStats(step, saved_at=time.time())
        return PendingSave(
            step,
            flat,
            key,
            clean,
            stats,
            time.perf_counter(),
            SaveHandle(step, stats),
            Marks.of(flat.tensors),
            metadata=meta,
        )

    def take_slot(self, pending: PendingSave, block: bool = True) -> bool:
        """Reserve a disk staging slot (back-pressure); False only if ``block`` is False and
        none is free (``DiskSlots.take_slot``)."""
        return self.disk.take_slot(pending, block)

    @property
    def staging(self) -> SaveHandle | None:
        """The last overlapped save (staged or not)."""
        return self.disk.staging

    def staging_busy(self) -> bool:
        """True while an overlapped save is still copying."""
        return self.disk.staging_busy()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the overlapped save under way (if any) has copied the state."""
        return self.disk.wait_staged(timeout)

    def send_job(
        self, pending: PendingSave, slot: StagingSlot, job_id: int, job: SaveJob
    ) -> Link | None:
        """Hand ``job``, staged (or, chunked.py, its first chunk) in ``slot``, to the worker;
        the link it went down once the worker mapped the arenas, or None if the job ended
        first (its handle says why)."""
        step, flat = pending.step, pending.flat
        sending = False
        try:
            with self.sigterm.handing_off():
                self.worker.wait_ready()
                if not self.jobs.in_flight(job_id):
                    # The worker it waited for died meanwhile and its handle failed ("nothing
                    # was committed"): the replacement must not commit it after all.
                    return None
                # After the wait: a fault that fired in a worker that died is disarmed by now.
                job.faults = faults.snapshot()
                # One worker's link throughout: if a new worker replaces it meanwhile, this
                # job goes to the dead one (and fails), and the new one gets everything.
                link = self.worker.link
                # A replayed plan hands out the same paths object: the worker keeps the
                # last paths it got (20,000 of them pickled into every job add up).
                if link.paths is flat.paths:
                    job.paths = None
                payload = _encode_job(job)  # before the pipe: a pickling error cuts nothing
                sending = True
                with self.worker.sending():
                    _send_arenas(slot, link)
                    M.send(link.conn, payload)
                    link.paths = flat.paths
        except OSError as e:
            self.jobs.fail(job_id, WorkerDied(f"could not hand step {step} to the worker: {e}"))
            return None
        except BaseException as e:
            # Interrupted (Ctrl-C), or no worker came up. Unsent, the job must not stay in
            # flight: close() and a SIGTERM's drain would wait for it forever. (Interrupted
            # mid-send, the worker is being replaced and its death settles the job.)
            pending.handle._observed = True  # the caller sees this very exception instead
            if not sending:
                self.jobs.fail(
                    job_id,
                    SaveFailed(
                        f"step {step} was not handed to the worker ({e!r}); nothing was written"
                    ),
                )
            raise
        finally:
            # Only now (the job sent, or failed): a SIGTERM's drain would wait for it.
            self.sigterm.run_deferred()
        self.wait_mapped(slot, link)
        return link

    def wait_mapped(self, slot: StagingSlot, link: Link) -> None:
        """Until the worker has received (mapped) the slot's arenas: it fetches their shared
        memory from this process, so a save must not return before (invariant 12). Once per
        slot layout; a worker that dies meanwhile fails the save its own way."""
        with self.jobs.cond:
            while set(slot.arena_ids) & link.unmapped:
                if link is not self.worker.link or not self.is_started():
                    return
                self.jobs.cond.wait(0.5)

    def job_for(
        self,
        pending: PendingSave,
        slot: StagingSlot,
        job_id: int,
        attempt: int,
        tier: str = "disk",
        digests: dict[str, bytes] | None = None,
    ) -> SaveJob:
        """The worker's job for ``pending``, staged in ``slot`` (a disk or a memory save);
        ``digests``: the staged bytes' fingerprints the trainer took (``worker_digests``)."""
        flat, stats = pending.flat, pending.stats
        return SaveJob(
            job_id=job_id,
            step=pending.step,
            arena_ids=list(slot.arena_ids),
            specs=None,  # the worker has them for these arenas (_send_arenas)
            objects=flat.objects,
            paths=flat.paths,  # set to None by the caller when the worker has them already
            metrics=dict(pending.metrics),
            metadata=pending.metadata,
            prune=prune_request(self.rules, pending.step, self.jobs.resumed_from, self.pinned),
            extra=flat.extra,
            attempt=attempt,
            saved_at=stats.saved_at,
            # Recorded in the manifest ("stats"), for `python -m asyncckpt stats`.
            figures={
                "stage_seconds": stats.stage_seconds,
                "wait_seconds": stats.wait_seconds,
                "alloc_seconds": stats.alloc_seconds,
                "staged_bytes": stats.staged_bytes,
                "copy_skipped_bytes": stats.copy_skipped_bytes,
                "copy_fingerprint_seconds": stats.copy_fingerprint_seconds,
            },
            tier=tier,
            digests=digests,
        )

    # ------------------------------------------------------------------ prepare()
    def prepare(self, state: Any) -> None:
        """Allocate (and hand to the worker) every staging slot for this state's layout."""
        flat = self.prepare_state(state)
        pin = any_cuda(flat.tensors.values())
        if pin:
            self.skipper.warm(flat.tensors)
        key = flat.key if flat.key is not None else layout_key(flat.tensors)
        # Disk saves are staged into the memory tier's slots while it is on (the budget
        # caps the disk saves' own slots: the memory tier's are outside it).
        if self.memory.active():
            slots, budget = self.tier.free_slots(flat, key), None
        else:
            slots, budget = self.jobs.free_slots(), self.budget
        plan = self.chunks.plan(flat, key) if budget is not None else None
        for i in slots[:1] if plan is not None else slots:
            if plan is not None:  # staged in chunks: the chunk buffers, within the budget
                chunked.hold_arena(self.slots[i], plan.arena_bytes, pin, self.let_go)
            else:
                self.slots[i].ensure(flat.tensors, pin, key, budget, self.let_go)
            if self.is_started():
                try:
                    with self.sigterm.handing_off():
                        self.worker.wait_ready()
                        link = self.worker.link
                        with self.worker.sending():
                            _send_arenas(self.slots[i], link)
                            _send_paths(flat.paths, link)
                finally:
                    self.sigterm.run_deferred()

    def prepare_state(self, state: Any) -> Any:
        """Split ``state`` for staging in this engine's format (formats.staged.Prepared)."""
        rules = self.rules
        if rules.components is not None:
            return components.prepare(rules.components, state, rank=rules.rank, legacy=rules.legacy)
        return staged.prepare(rules.fmt, state, legacy=rules.legacy, cache=self.flatten_cache)

    def send_arenas(self, slot: StagingSlot, link: Link) -> None:
        """The slot's arenas and specs, to the worker that lacks them (memory/tier.py)."""
        _send_arenas(slot, link)

    def release_slots(self) -> None:
        for slot in self.slots:
            slot.release()


def prune_request(
    rules: SaveRules, step: int, resumed_from: int | None, pinned: Iterable[int]
) -> PruneRequest | None:
    """What the worker prunes after committing ``step`` (None: this rank prunes nothing)."""
    if rules.keep is None or not rules.prunes_here:
        return None
    return PruneRequest(
        policy=rules.keep,
        # The commit of a newer step ends the protection of the resumed-from one.
        resumed_from=(
            resumed_from
            if resumed_from is not None and (resumed_from >= step or rules.keep_resumed == "run")
            else None
        ),
        pinned=tuple(pinned),
        run_id=rules.run_id,
        scope=rules.prune_scope,
    )


#: The longest ``let_worker_go`` waits for the worker's word (its reader thread answers at once).
DROP_WAIT_S = 60.0


def let_worker_go(saver: Saver, slot: StagingSlot) -> None:
    """Under a budget, between the release of a re-laid-out slot's arenas and the allocation
    of its new ones: the worker unmaps the old ones, and this waits for its word (``Dropped``;
    its reader thread answers at once, also while a save is being written). Both processes
    map an arena, and its memory comes back only once both let go: else the host would hold
    the old layout and the new one together, up to twice the budget. A worker that dies
    meanwhile let go by dying."""
    if not saver.is_started():
        return
    link = saver.worker.link
    try:
        with saver.worker.sending():
            dropped = _send_drops(slot, link)
    except OSError:  # the worker is dead: its mappings went with it (send_job says so)
        return
    if saver.words.wait_for_word(link, lambda: bool(dropped & link.undropped), DROP_WAIT_S):
        # (no hang for the budget's sake: said, not waited)
        log.warning(
            "the worker did not say it let go of %d old staging buffer(s) in %.0f s: "
            "the new ones are allocated beside them (over Staging(max_host_bytes=))",
            len(dropped & link.undropped),
            DROP_WAIT_S,
        )


def _send_drops(slot: StagingSlot, link: Link) -> set[int]:
    """Tell the worker to drop the arenas of this slot's old layout (both processes must let
    go of them for the shared memory to be freed); returns their ids."""
    dropped = set()
    for aid in slot.take_retired():
        if aid in link.arenas:
            link.undropped.add(aid)  # until the worker's Dropped (let_worker_go)
            M.send(link.conn, M.encode(M.Drop(aid)))
            link.arenas.discard(aid)
            link.specs = {k for k in link.specs if aid not in k}
            dropped.add(aid)
    return dropped


def _send_arenas(slot: StagingSlot, link: Link) -> None:
    # The worker first drops the arenas of this slot's old layout, then maps the new ones.
    _send_drops(slot, link)
    for aid, arena in zip(slot.arena_ids, slot.arenas, strict=True):
        if aid not in link.arenas:
            link.unmapped.add(aid)  # until the worker's Mapped (Saver.wait_mapped)
            M.send(link.conn, M.encode(M.Arena(aid, arena)))
            link.arenas.add(aid)
    # Where each tensor sits in the arenas depends only on the layout: sent once with
    # them (20,000 specs pickled per save cost more than the copy of their tensors).
    key = tuple(slot.arena_ids)
    if key not in link.specs:
        M.send(link.conn, M.encode(M.Specs(key, slot.specs)))
        link.specs.add(key)


def _send_paths(paths: dict[str, list] | None, link: Link) -> None:
    # Ahead of the first save, which then sends none (see _stage_and_send).
    if paths is not None and link.paths is not paths:
        M.send(link.conn, M.encode(M.Paths(paths)))
        link.paths = paths


def _encode_job(job: SaveJob) -> bytes:
    try:
        return M.encode(M.Save(job))
    except Exception as e:  # noqa: BLE001 - pickle raises many types
        raise SaveFailed(
            f"step {job.step} cannot be sent to the checkpoint worker: part of the job cannot be "
            f"pickled ({type(e).__name__}: {e}); a retention policy or an object in the state "
            "must be picklable (no lambdas, no local classes); nothing was written"
        ) from e


def check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float]:
    if metrics is not None and not isinstance(metrics, Mapping):
        raise TypeError("metrics must be a mapping of name -> number")
    clean = {}
    for k, v in (metrics or {}).items():
        if not isinstance(k, str):
            raise TypeError(f"metric names must be str, got {k!r}")
        if isinstance(v, (str, bytes, bytearray)):
            # float("0.5") would pass: a string is a caller's mistake (a formatted value, a
            # wrong key), not a number to convert silently.
            raise TypeError(
                f"metric {k!r} must be a number, got the string {v!r}; nothing was saved"
            )
        try:
            clean[k] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} must be a number, got {v!r}") from None
    return clean

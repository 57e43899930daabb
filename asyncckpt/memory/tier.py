"""The memory tier: checkpoints kept in the worker's shared memory, written only when needed.

``save(step, state, tier="memory")`` stages the state as any save does and hands the worker a
``Hold`` instead of a ``Save``: no disk I/O. The worker keeps the newest complete memory
checkpoint and writes it to disk, committed like any other save (manifest, tracker, prune,
marked ``"tier": "memory"`` and ``"persisted_because"`` in the manifest), when

* its trainer dies without closing the engine (the jobs pipe's end of file: ``worker/loop.py``),
* SIGTERM arrives (the engine's preemption path asks for it before draining),
* the engine closes, with ``persist_memory_on_close=True``.

Host memory: two staging slots of the state's size for both tiers (the one the worker holds +
the one the next save stages into); checked before anything is allocated. A disk save made
while the memory tier is on (``Schedule(memory_every_steps=)`` set, or after a memory save) is
staged into a memory slot too (``shares``): the worker holds it as its newest memory
checkpoint (``Hold(writing=True)``) and writes it from there (``SaveJob.held_as``), so the
disk save's own ``max_in_flight`` slots are never allocated (2x the state, not 3x). Who owns
such a slot: the hold (``slot_owner[i]`` is the memory job's id, freed by its ``Released``);
the disk write in flight owns none (``JobTable.add(owns_slot=False)``): the worker's
``Holder`` keeps the slot pinned until the write is done, even once a newer ``Hold`` replaced
it, and only then sends its ``Released``. A memory save that finds one slot held and the
other still being written is skipped rather than wait the write's length (``in_the_way``:
its handle ``skipped``, counted, logged once): the worker keeps the newest memory save it
holds. A disk save then waits for the write (back-pressure, in its ``wait_seconds``). Not
shared, counted in ``unshared`` and logged once per reason: an overlapped disk save, a state
laid out unlike the memory slots, a step not after the last memory save; those stage into a
disk slot of their own, as without the memory tier.

Why a torn memory checkpoint is never persisted: the trainer stages into a memory slot only
once the worker has let go of it. The worker lets go of the slot it held only when a ``Hold``
of a newer, completely staged checkpoint arrives (a ``Hold`` is sent only after the copy), and
a ``Hold`` is read by a thread of its own (``memory_hold.Holder``), so that this takes a pipe's round trip
even while the worker writes a disk checkpoint. Forward only: a memory checkpoint whose step is
not newer than the newest committed one is never written.

Several ranks: only a step every rank holds can be written, so each worker keeps the newest
step every rank handed off (common) besides the newest. Each memory save, before its
``save()`` returns, counts itself in the side store (``Agreement.handed_off``); when a third
step needs a slot, the trainer asks the store whether its newest held step is common
(``Agreement.common``: proposed and recorded once per step, the same answer on every rank) and
tells its worker to let go of the older one if so, else of the newest (``LetGo``): the common
step is never evicted before a newer one is common. A rank that skips a memory save says so
in the store (``Agreement.skipped``): the step is never common, and a peer holding it learns
that at once instead of waiting for its hand-off. A rank a whole memory save ahead of a
peer waits for it at most ``COMMON_WAIT_S``, then overwrites its non-common step (never
blocks longer: its peer may be dead). In a training loop with a collective between two memory
saves every peer has handed a step off before any rank's next save asks, so nothing whose
``save()`` returned on every rank is lost. No collective runs on the training thread: these
are key operations on the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from asyncckpt import faults
from asyncckpt.cluster.dist import DistConfig
from asyncckpt.core import layout as _layout
from asyncckpt.core import messages as M
from asyncckpt.core.cachekeys import same_key
from asyncckpt.core.savejob import SaveJob
from asyncckpt.errors import CheckpointError, SaveFailed, StagingMemoryError, WorkerDied
from asyncckpt.memory.hold import CLOSE, COMMON, DROPPED, PREEMPTION, TRAINER_DIED, fate, let_go
from asyncckpt.staging.arenas import (
    HostBudget,
    StagingSlot,
    any_cuda,
    check_memory,
    plan_arenas,
)
from asyncckpt.staging.stager import (
    Deferral,
    Handover,
    Link,
    PendingSave,
    SaveHandle,
    SlotJobs,
)
from asyncckpt.staging.unchanged import CopySkipper, note_skips, stage_checked, worker_digests

__all__ = [
    "CLOSE",
    "PREEMPTION",
    "TRAINER_DIED",
    "MemoryStager",
    "MemoryTier",
    "check_tier",
]

log = logging.getLogger("asyncckpt")

TIERS = ("disk", "memory")


def check_tier(tier: Any) -> str:
    if tier not in TIERS:
        raise ValueError(f'tier must be "disk" or "memory", not {tier!r}')
    return tier


def check_memory_tier(tensors: dict[str, Any], held_bytes: int, replicas: int = 0) -> None:
    """Refuse the memory tier's two slots if the machine cannot hold them (before allocating
    either). ``held_bytes``: what the memory slots already hold (re-laid out in place).
    ``replicas=1``: this rank's worker also holds two replicas of its peer rank's memory
    saves, counted as the same size as this rank's (the peer's receiver checks again)."""
    _, sizes = plan_arenas(tensors)
    need = 2 * sum(sizes) * (1 + replicas)
    try:
        check_memory(need - held_bytes)
    except StagingMemoryError as e:
        what = (
            "the checkpoint the worker holds and the one being staged"
            if not replicas
            else "the checkpoint the worker holds, the one being staged, and two replicas of "
            "a peer node's rank"
        )
        raise StagingMemoryError(
            f"the memory tier keeps {2 * (1 + replicas)} copies of the state in shared memory "
            f"({what}): {need / 2**30:.2f} GiB. {e}; nothing was staged"
        ) from None


#: How long a rank a memory save ahead of a peer waits for it before dropping its newest step.
COMMON_WAIT_S = 1.0


class Agreement:
    """Several ranks: which memory steps every rank handed off, over the side store (served
    by rank 0's worker; ``dist.py``). Keys: a counter per step, and its fate once asked."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.store: Any = None
        self.steps: list[int] = []  # handed off here, whose keys rank 0 removes once obsolete

    def _key(self, step: int) -> str:
        return f"asyncckpt/{self.cfg.token}/memory/{step}"

    def _client(self) -> Any:
        if self.store is None:
            import datetime

            import torch.distributed as dist

            td = datetime.timedelta(seconds=self.cfg.timeout)
            self.store = dist.TCPStore(self.cfg.host, self.cfg.port, None, False, td)
        return self.store

    def handed_off(self, step: int) -> None:
        """Count this rank's hand-off of ``step`` (before its ``save()`` returns)."""
        try:
            self._client().add(self._key(step), 1)
            self.steps.append(step)
        except Exception as e:  # noqa: BLE001 - the peers then see it as not common
            self.store = None
            log.warning("memory save of step %d: the side store is unreachable: %s", step, e)

    def skipped(self, step: int) -> None:
        """This rank skipped memory save ``step`` (no free slot): it is never common, and a
        peer that holds it need not wait for this rank's hand-off to know."""
        try:
            self._client().add(self._key(step) + "/skipped", 1)
            self.steps.append(step)  # (its keys go as a handed-off step's do)
        except Exception as e:  # noqa: BLE001 - the peers then wait COMMON_WAIT_S, no more
            self.store = None
            log.warning("memory save of step %d: the side store is unreachable: %s", step, e)

    def common(self, step: int) -> bool:
        """Whether every rank handed off ``step`` -- decided once for all ranks: the first
        rank to ask records its answer, the others read it."""
        try:
            store = self._client()
            deadline = time.monotonic() + COMMON_WAIT_S
            while True:
                n = store.add(self._key(step), 0)
                if n >= self.cfg.world_size or time.monotonic() >= deadline:
                    break
                if store.add(self._key(step) + "/skipped", 0):  # a rank never held it
                    break
                time.sleep(0.01)
            want = fate(n, self.cfg.world_size)
            agreed = store.compare_set(self._key(step) + "/fate", "", want).decode()
        except Exception as e:  # noqa: BLE001 - keep the older step: never a newer guess
            self.store = None
            log.warning("memory step %d: the side store is unreachable: %s", step, e)
            return False
        if agreed == COMMON:
            self._forget_before(step)
        elif agreed != DROPPED:
            raise RuntimeError(f"memory step {step}: unexpected agreement {agreed!r}")
        return agreed == COMMON

    def _forget_before(self, step: int) -> None:
        """Once ``step`` is common no rank asks about an older one: rank 0 removes their keys."""
        old = [s for s in self.steps if s < step]
        self.steps = [s for s in self.steps if s >= step]
        if self.cfg.rank != 0:
            return
        for s in old:
            self.store.delete_key(self._key(s))
            self.store.delete_key(self._key(s) + "/fate")
            self.store.delete_key(self._key(s) + "/skipped")


class SlotOwners(Protocol):
    """Who holds a slot, as the job table (``jobs.JobTable``, its only writer) says."""

    def owner(self, slot: int) -> int | None: ...

    def disown(self, slot: int, job_id: int | None = None) -> None: ...

    def in_flight(self, job_id: int) -> bool: ...


@dataclass
class MemoryTier:
    """The trainer's side: which of the engine's slots are the memory tier's, what was sent.

    ``slots``: indices into the engine's ``slots`` (appended at the first memory save). The job
    table's ``owner(i)`` is the id of the memory job the worker may still read from slot ``i``
    (until its ``Released``), or of a persist job in flight; None when free.
    """

    every_steps: int | None = None
    persist_on_close: bool = False
    replicas: int = 0  # options.MemoryTier.replicas: the worker replicates each Hold
    slots: list[int] = field(default_factory=list)
    held: SaveJob | None = None  # the job of the last Hold sent (the newest complete memory save)
    held_slot: int | None = None
    held_link: Link | None = None  # the worker link it was sent on (a new worker holds nothing)
    # Several ranks: the older step the worker also holds (common to every rank, or the
    # older of two not yet known to be), and how the ranks agree on it.
    kept: SaveJob | None = None
    kept_slot: int | None = None
    dist: DistConfig | None = None  # set at the engine's start (several ranks)
    agreement: Agreement | None = None
    sent_on: dict[int, Link] = field(default_factory=dict)  # slot -> link of its last Hold
    last_step: int | None = None  # the newest memory save's step (steps go forward)
    last_due: int | None = None
    lost: int = 0  # memory saves lost with a worker that died holding them (worker_lost)
    unprotected_step: int | None = None  # the last one lost, until a new worker holds one
    shared: int = 0  # disk saves written from a memory slot (``shares``)
    unshared: int = 0  # disk saves that could not be, with the memory tier on
    unshared_why: set[str] = field(default_factory=set)  # the reasons logged already
    skipped: int = 0  # memory saves not taken: no slot free but behind a disk write
    # Memory job id -> the id of the disk save written from its slot (pinned for that write).
    written_by: dict[int, int] = field(default_factory=dict)

    def active(self) -> bool:
        """The memory tier is in use: its slots exist, or its schedule is set."""
        return bool(self.slots) or self.every_steps is not None

    def due(self, step: int) -> bool:
        """Every ``every_steps`` steps (``step > 0``), once per step."""
        if self.every_steps is None or step <= 0 or step == self.last_due:
            return False
        if step % self.every_steps == 0:
            self.last_due = step
            return True
        return False

    def pick_slot(
        self, jobs: SlotOwners, link: Link, keys: dict[int, Any], key: tuple
    ) -> int | None:
        """A memory slot to stage into, or None while the worker still holds both. (Called
        with the engine's lock held.) A slot sent to a worker that was since replaced is free:
        the new worker holds nothing of it."""
        if self.held_link is not None and self.held_link is not link:
            self.held = self.held_slot = self.held_link = self.kept = self.kept_slot = None
        for i in self.slots:
            o = jobs.owner(i)
            if o is not None and not jobs.in_flight(o) and self.sent_on.get(i) is not link:
                jobs.disown(i)
        free = [
            i
            for i in self.slots
            if jobs.owner(i) is None and i not in (self.held_slot, self.kept_slot)
        ]
        if not free:
            return None
        same = [i for i in free if same_key(keys.get(i), key)]
        return (same or free)[0]

    def in_the_way(self, jobs: SlotOwners) -> bool:
        """No slot is free and only a disk write would free one: each memory slot is held
        (the newest memory save, or the older one several ranks keep) or being written from.
        Not when one is on its way back (a pipe's round trip). (The engine's lock held.)"""
        pinned = False
        for i in self.slots:
            o = jobs.owner(i)
            if o is not None and (jobs.in_flight(o) or jobs.in_flight(self.written_by.get(o, -1))):
                pinned = True  # a disk save (or a persist) is being written from it
            elif i not in (self.held_slot, self.kept_slot):
                return False
        return pinned

    def agree(self) -> Agreement | None:
        if self.dist is None:
            return None
        if self.agreement is None or self.agreement.cfg is not self.dist:
            self.agreement = Agreement(self.dist)
        return self.agreement

    def newest_common(self) -> tuple[SaveJob | None, int | None]:
        """Several ranks holding two: the one of them to keep (and its slot), as agreed."""
        agreement = self.agree()
        if self.kept is None or agreement is None:
            return self.held, self.held_slot
        if self.held is None or not agreement.common(self.held.step):
            return self.kept, self.kept_slot
        return self.held, self.held_slot


# ------------------------------------------------------------------ the engine's side
class TierWorker(Protocol):
    """What the memory tier needs of the worker's supervisor (``supervisor.WorkerSupervisor``)."""

    @property
    def link(self) -> Link: ...

    @property
    def start_error(self) -> str | None: ...

    def wait_ready(self) -> None: ...

    def sending(self) -> contextlib.AbstractContextManager[None]: ...


class TierJobs(SlotJobs, SlotOwners, Protocol):
    """What the memory tier needs of the job table (``jobs.JobTable``): it is the only writer
    of who holds a slot, and of job ids and attempts."""

    replicating: dict[int, SaveHandle]  # memory job id -> handle, while its replica is sent

    def add_memory_slot(self, slot: int) -> None: ...

    def reserve(self, slot: int) -> None: ...

    def own(self, slot: int, job_id: int) -> None: ...

    def new_job_id(self) -> int: ...

    def next_attempt(self, step: int) -> int: ...

    def track(self, job: SaveJob, slot: int) -> SaveHandle: ...

    def steps(self) -> list[int]: ...


class TierHost(Handover, Protocol):
    """What the memory tier needs of the saver (``saving.Saver``) beside a disk save's
    hand-over: the arenas sent as theirs are, and an overlapped save's copy waited for."""

    def send_arenas(self, slot: StagingSlot, link: Link) -> None: ...

    def wait_mapped(self, slot: StagingSlot, link: Link) -> None: ...

    def wait_staged(self, timeout: float | None = None) -> bool: ...


class MemoryStager:
    """The memory tier as a ``Stager``: memory saves (``tier="memory"``) and the disk saves
    staged into its slots (``shares``), held by the worker; its bookkeeping is ``state``
    (``MemoryTier``). Its slots join the saver's ``slots`` (the same list) at its first save;
    the job table's lock and the worker's link are used as the disk saves use them."""

    uses_disk_slot = False  # its own two slots, taken in ``stage``

    def __init__(
        self,
        state: MemoryTier,
        *,
        slots: list[StagingSlot],
        jobs: TierJobs,
        worker: TierWorker,
        host: TierHost,
        sigterm: Deferral,
        skipper: CopySkipper,
        budget: HostBudget | None,
        root: Path,
        layout: str,
        committed: Callable[[], list[_layout.CommittedDir]],
        is_started: Callable[[], bool],
    ) -> None:
        self.state = state
        self.slots = slots
        self.jobs = jobs
        self.worker = worker
        self.host = host
        self.sigterm = sigterm
        self.skipper = skipper
        self.budget = budget
        self.root = root
        self.layout = layout
        self.committed = committed
        self.is_started = is_started
        self._budget_moot_said = False

    # ------------------------------------------------------------------ Stager
    def claims(self, pending: PendingSave, overlap: bool) -> bool:
        """A memory save, or a disk save staged into a memory slot (``shares``)."""
        if self.budget is not None and not self._budget_moot_said:
            self._budget_moot_said = self._say_if_budget_is_moot(pending, self.budget)
        return pending.tier == "memory" or self.shares(pending, overlap)

    def stage(self, pending: PendingSave, overlap: bool = False) -> SaveHandle:
        """A memory save held by the worker; a disk save (``shares``) written from its slot."""
        return self.save(pending, write=pending.tier != "memory")

    # ------------------------------------------------------------------ slots
    def _add_slots(self, flat: Any, key: tuple) -> None:
        """The memory tier's two slots, checked for room (2x the state) before either exists."""
        mem = self.state
        keys = {self.slots[i].key for i in mem.slots}
        if mem.slots and keys == {key}:
            return
        check_memory_tier(flat.tensors, sum(self.slots[i].nbytes for i in mem.slots), mem.replicas)
        with self.jobs.cond:
            while len(mem.slots) < 2:
                i = len(self.slots)
                self.slots.append(StagingSlot(i))
                self.jobs.add_memory_slot(i)
                mem.slots.append(i)

    def free_slots(self, flat: Any, key: tuple) -> list[int]:
        """``prepare(state)``: the memory tier's slots (added, checked for room) not in use."""
        self._add_slots(flat, key)
        with self.jobs.cond:
            return [i for i in self.state.slots if self.jobs.owner(i) is None]

    def _make_room(self) -> None:
        """Several ranks, the worker holding two: let go of the one the ranks agree is not to
        be kept (its slot comes back with ``Released``, which ``_take_slot`` waits for)."""
        mem, jobs = self.state, self.jobs
        link = self.worker.link
        if mem.kept is None or mem.held is None or mem.held_link is not link:
            return
        agreement = mem.agree()
        common = agreement is not None and agreement.common(mem.held.step)  # outside the lock
        gone = let_go(mem.kept.step, mem.held.step, COMMON if common else DROPPED)
        victim, keep = (mem.kept, mem.held) if gone == mem.kept.step else (mem.held, mem.kept)
        keep_slot = mem.held_slot if keep is mem.held else mem.kept_slot
        with self.sigterm.handing_off():
            with self.worker.sending():
                M.send(link.memory, M.encode(M.LetGo(victim.job_id)))
            with jobs.cond:
                mem.kept, mem.kept_slot = keep, keep_slot
                mem.held = mem.held_slot = None
        self.sigterm.run_deferred()

    def _take_slot(self, pending: PendingSave, skip: bool) -> int | None:
        """A memory slot the worker does not hold; waits (a pipe's round trip) for its release.
        ``skip``: None instead of waiting for a disk write (``MemoryTier.in_the_way``)."""
        mem, jobs = self.state, self.jobs
        with jobs.cond:
            while True:
                keys = {i: self.slots[i].key for i in mem.slots}
                link = self.worker.link
                i = mem.pick_slot(jobs, link, keys, pending.key)
                if i is not None:
                    jobs.reserve(i)
                    return i
                if skip and mem.in_the_way(jobs):
                    return None
                error = self.worker.start_error
                if not self.is_started() or error is not None:
                    raise CheckpointError(
                        f"memory save of step {pending.step}: the checkpoint worker is not "
                        "running" + (f" ({error})" if error else "")
                    )
                jobs.cond.wait(0.5)

    def _skip(self, pending: PendingSave) -> None:
        """Memory save ``pending`` is not taken: no slot is free before a disk write ends, and
        training does not wait for a write (its handle completes at once, ``skipped``)."""
        mem, step = self.state, pending.step
        agreement = mem.agree()
        if agreement is not None:  # never counted as handed off: not common, said at once
            agreement.skipped(step)
        with self.jobs.cond:
            mem.skipped += 1
            first, kept = mem.skipped == 1, (mem.held or mem.kept or pending).step
        log.log(
            logging.INFO if first else logging.DEBUG,
            "memory save of step %d skipped, not waiting for a disk write: one memory slot is "
            "being written to disk, the other holds step %d, which the worker keeps "
            "(handle.skipped; engine.stats counts memory_saves_skipped; said once)",
            step,
            kept,
        )
        if mem.replicas:  # replicated_sync() says why there is no replica
            pending.handle._replica = threading.Event()
            pending.handle._replica_done("it was skipped: no memory slot was free")
        pending.handle._skip()

    def _say_if_budget_is_moot(self, pending: PendingSave, budget: HostBudget) -> bool:
        """Whether it said (a warning, once per engine: the caller keeps the answer) that
        ``Staging(max_host_bytes=)`` is below the state while this tier is on: its slots hold
        whole states and disk saves are written from them, so the budget bounds nothing."""
        if not self.state.active():
            return False
        staged = sum(plan_arenas(pending.flat.tensors)[1])
        if staged <= budget.max_bytes:
            return False
        log.warning(
            "Staging(max_host_bytes=%d) is below this state's %.1f MiB, but the memory tier "
            "stages whole states into its own slots (and disk saves are written from them): "
            "the budget does not bound them; size host memory for MemoryTier instead",
            budget.max_bytes,
            staged / 2**20,
        )
        return True

    def shares(self, pending: PendingSave, overlap: bool) -> bool:
        """Whether disk save ``pending`` is staged into a memory slot and written from there
        (the module's docstring); when the memory tier is on but it cannot be, says why (once
        per reason) and counts it."""
        mem = self.state
        if not mem.active():
            return False
        why = None
        if overlap:
            why = "an overlapped save (overlap=True) copies in the background"
        elif mem.last_step is not None and pending.step <= mem.last_step:
            why = f"its step is not after the last memory save (step {mem.last_step})"
        elif mem.slots and all(self.slots[i].key not in (None, pending.key) for i in mem.slots):
            why = "its state is laid out unlike the memory saves' (other tensors)"
        if why is None:
            return True
        with self.jobs.cond:
            mem.unshared += 1
            first = why not in mem.unshared_why
            mem.unshared_why.add(why)
        if first:
            log.info(
                "disk save of step %d staged into a slot of its own, not the memory tier's: %s "
                "(host memory: one more copy of the state; engine.stats counts these)",
                pending.step,
                why,
            )
        return False

    # ------------------------------------------------------------------ saving
    def save(self, pending: PendingSave, write: bool = False) -> SaveHandle:
        """Stage ``pending`` into a memory slot and hand it to the worker to hold; the handle
        completes at once (nothing is written unless the worker must persist it). ``write``: a
        disk save (``shares``): the worker also writes it from that slot, and the handle
        completes at its commit, as any disk save's."""
        mem = self.state
        step, handle = pending.step, pending.handle
        if mem.last_step is not None and step <= mem.last_step:
            raise CheckpointError(
                f"memory save of step {step}: steps must increase (the last memory save was "
                f"step {mem.last_step})"
            )
        self._add_slots(pending.flat, pending.key)
        try:
            self._make_room()
        except OSError as e:  # the worker is gone: the next one holds nothing anyway
            log.warning("memory save of step %d: could not reach the worker: %s", step, e)
        t_take = time.perf_counter()
        i = self._take_slot(pending, skip=not write)
        pending.stats.wait_seconds = time.perf_counter() - pending.started
        if i is None:
            self._skip(pending)
            return handle
        slot = self.slots[i]
        if write and time.perf_counter() - t_take > 0.001:  # as a disk save's back-pressure
            log.info(
                "save of step %d waited %.3fs for a staging buffer (both of the memory tier's "
                "are in use: held, or being written)",
                step,
                time.perf_counter() - t_take,
            )
        staged = self._stage(pending, i, write)
        if staged is None:
            return handle
        job, disk = staged
        link = self._hand_over(pending, i, job, disk)
        if link is None:
            return handle
        self.host.wait_mapped(slot, link)  # the worker has the slot's memory (once per layout)
        agreement = mem.agree()
        if agreement is not None:  # counted before save() returns: the peers may rely on it
            agreement.handed_off(step)
        if disk is not None:
            with self.jobs.cond:
                mem.shared += 1
            handle._staged.set()  # copied and handed over: invariant 12 holds from here
        else:
            handle._finish()  # held by the worker: done (it is written only if it must be)
        return handle

    def _stage(
        self, pending: PendingSave, i: int, write: bool
    ) -> tuple[SaveJob, SaveJob | None] | None:
        """Copy ``pending`` into memory slot ``i`` (reserved) and make its jobs: the memory
        job, and ``write``: the disk save's, in flight, owning no slot (the hold does). None:
        the state changed while it was copied (its handle failed, the slot is given back)."""
        jobs, slot = self.jobs, self.slots[i]
        step, flat, stats, handle = pending.step, pending.flat, pending.stats, pending.handle
        try:
            pin = any_cuda(flat.tensors.values())
            t0 = time.perf_counter()
            if slot.ensure(flat.tensors, pin, pending.key):
                stats.alloc_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            # Blocking, on the caller's thread: only another thread can free a storage before
            # the copy, racing it as during the copy, which no check makes safe (no guard).
            torn, skips = stage_checked(self.skipper, slot, flat.tensors, pending.marks, False, pin)
            stats.stage_seconds = time.perf_counter() - t1
            stats.staged_bytes = slot.nbytes
            note_skips(stats, skips)
            if torn is not None:  # invariant 13, as for a disk save: a torn slot is never held
                err = SaveFailed(
                    f"{'' if write else 'memory '}save of step {step} failed: the state changed "
                    f"while it was staged ({torn}); nothing was written, the worker still holds "
                    "the previous memory checkpoint"
                )
                err.__cause__ = torn
                jobs.unreserve(i)
                jobs.fail_unsent(handle, err)
                return None
            faults.point("after_stage")
            disk = None
            digests = worker_digests(slot, skips)  # the slot's bytes: for whichever job writes
            with jobs.cond:
                if write:
                    disk_id, attempt = jobs.add(step, handle, i, owns_slot=False)
                    disk = self.host.job_for(pending, slot, disk_id, attempt, digests=digests)
                else:
                    attempt = jobs.next_attempt(step)
                job = self.host.job_for(
                    pending, slot, jobs.new_job_id(), attempt, tier="memory", digests=digests
                )
                jobs.own(i, job.job_id)
                if disk is not None:
                    disk.held_as = job.job_id
                    mem = self.state
                    mem.written_by = {m: d for m, d in mem.written_by.items() if jobs.in_flight(d)}
                    mem.written_by[job.job_id] = disk.job_id
                elif self.state.replicas:  # before the Hold: its Replicated may come at once
                    handle._replica = threading.Event()
                    jobs.replicating[job.job_id] = handle
        except BaseException:
            jobs.unreserve(i)
            raise
        return job, disk

    def _hand_over(
        self, pending: PendingSave, i: int, job: SaveJob, disk: SaveJob | None
    ) -> Link | None:
        """Send memory job ``job`` (a ``Hold``) and ``disk``'s ``Save`` staged in slot ``i``;
        the link they went down, or None if the save ended (its handle says why)."""
        mem, jobs, slot = self.state, self.jobs, self.slots[i]
        step, flat, handle = pending.step, pending.flat, pending.handle

        def let_go(err: SaveFailed | None = None) -> None:
            with jobs.cond:
                jobs.disown(i, job.job_id)
                if jobs.replicating.pop(job.job_id, None) is not None:
                    handle._replica_done("it never reached the worker")
                jobs.cond.notify_all()
            if disk is not None and err is not None:
                jobs.fail(disk.job_id, err)
            elif err is not None:
                jobs.fail_unsent(handle, err)

        sent = False
        try:
            with self.sigterm.handing_off():
                self.worker.wait_ready()
                if disk is not None and not jobs.in_flight(disk.job_id):
                    let_go()  # the worker it waited for died meanwhile: the save failed with it
                    return None
                job.faults = faults.snapshot()
                link = self.worker.link
                # Paths only when they changed (a replayed plan hands out the same object).
                wire = (
                    job
                    if link.memory_paths is not flat.paths
                    else dataclasses.replace(job, paths=None)
                )
                # Several ranks: the worker keeps the older one it holds as well (_make_room).
                keep: SaveJob | None = None
                keep_slot: int | None = None
                if mem.dist is not None and mem.held_link is link:
                    keep, keep_slot = (
                        (mem.kept, mem.kept_slot) if mem.kept else (mem.held, mem.held_slot)
                    )
                payload = M.encode(
                    M.Hold(
                        wire, keep.job_id if keep is not None else None, writing=disk is not None
                    )
                )
                if disk is not None:
                    disk.faults = job.faults
                    if link.paths is flat.paths:
                        disk.paths = None
                    written = M.encode(M.Save(disk))
                sent = True
                with self.worker.sending():
                    self.host.send_arenas(slot, link)  # the arenas and specs: on the jobs pipe
                    M.send(link.memory, payload)
                    if disk is not None:  # after the Hold: the Holder pins the slot first
                        M.send(link.conn, written)
                        link.paths = flat.paths
                link.memory_paths = flat.paths
                with jobs.cond:
                    mem.sent_on[i] = link
                    mem.held, mem.held_slot, mem.held_link = job, i, link
                    mem.kept, mem.kept_slot = keep, keep_slot
                    mem.last_step = step
                    mem.unprotected_step = None  # the hole a dead worker left is closed
        except OSError as e:
            let_go(WorkerDied(f"could not hand step {step} to the worker: {e}"))
            return None
        except BaseException as e:
            # Interrupted (Ctrl-C), or no worker came up: the caller sees this very exception.
            # (Interrupted mid-send, the worker is being replaced: its death settles the job.)
            handle._observed = True
            unsent = disk is not None and not sent  # (in flight: close() would wait for it)
            let_go(
                SaveFailed(f"step {step} was not handed to the worker ({e!r})") if unsent else None
            )
            raise
        finally:
            self.sigterm.run_deferred()
        return link

    # ------------------------------------------------------------------ the worker's end
    def worker_lost(self, link: Link, pid: int | None) -> None:
        """The worker ``pid`` (its ``link``) died with the trainer alive: the memory save it
        held is gone with its memory. Count it and say which step, unless disk has it or newer."""
        mem = self.state
        with self.jobs.cond:
            job = mem.held
            if job is None or mem.held_link is not link:
                return  # held nothing, or what it held was already counted or persisted
            newest = _layout.read_tracker(self.root)
            if newest is not None and job.step <= newest:
                return  # a disk checkpoint at least as new: nothing is unprotected
            mem.lost += 1
            mem.unprotected_step = job.step
        # The handle of that save succeeded long ago: this line is the only place it shows.
        log.warning(
            "the checkpoint worker (pid %s) died holding the memory save of step %d: it is "
            "lost; until the next memory save, a trainer's death resumes from disk (step %s)",
            pid,
            job.step,
            newest,
        )

    def persist(self, reason: str) -> SaveHandle | None:
        """Ask the worker to write the memory checkpoint it holds, as a save in flight (the
        engine's drain waits for it); None if there is none, or it is not newer than what is
        on disk or in flight."""
        mem, jobs = self.state, self.jobs
        if mem.held_link is not self.worker.link or (mem.held is None and mem.kept is None):
            return None
        self.host.wait_staged()  # an overlapped save's thread may be sending: never two at once
        dirs = self.committed()
        newest = dirs[-1].step if dirs else None
        job, slot = mem.newest_common()  # several ranks: the step all of them write
        with jobs.cond:
            if job is None or slot is None:
                return None
            flying = max(jobs.steps(), default=None)
            final = self.root / _layout.dir_name(self.layout, job.step)
            if any(s is not None and job.step <= s for s in (newest, flying)) or final.exists():
                log.info("memory checkpoint of step %d not written: not newer than disk", job.step)
                return None
            pjob = dataclasses.replace(
                job,
                job_id=jobs.new_job_id(),
                persisted_because=reason,
                memory_job_id=job.job_id,
                faults=faults.snapshot(),
            )
            handle = jobs.track(pjob, slot)  # its slot is the write's until released
            # The worker forgets it too (and the other one it holds is not written by the
            # trainer).
            mem.held = mem.held_slot = mem.held_link = mem.kept = mem.kept_slot = None
        log.warning("writing the memory checkpoint of step %d (%s)", job.step, reason)
        try:
            with self.worker.sending():
                M.send(self.worker.link.conn, M.encode(M.Save(pjob)))
        except OSError as e:
            jobs.fail(pjob.job_id, WorkerDied(f"could not ask the worker to write it: {e}"))
        return handle

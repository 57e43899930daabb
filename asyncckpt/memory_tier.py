"""The memory tier: checkpoints kept in the worker's shared memory, written only when needed.

``save(step, state, tier="memory")`` stages the state as any save does and hands the worker a
``Hold`` instead of a ``Save``: no disk I/O. The worker keeps the newest complete memory
checkpoint and writes it to disk, committed like any other save (manifest, tracker, prune,
marked ``"tier": "memory"`` and ``"persisted_because"`` in the manifest), when

* its trainer dies without closing the engine (the jobs pipe's end of file: ``worker.py``),
* SIGTERM arrives (the engine's preemption path asks for it before draining),
* the engine closes, with ``persist_memory_on_close=True``.

Host memory: two staging slots of the state's size (the one the worker holds + the one the
next memory save stages into), on top of the disk saves' ``max_in_flight`` slots; checked
before anything is allocated.

Why a torn memory checkpoint is never persisted: the trainer stages into a memory slot only
once the worker has let go of it. The worker lets go of the slot it held only when a ``Hold``
of a newer, completely staged checkpoint arrives (a ``Hold`` is sent only after the copy), and
a ``Hold`` is read by a thread of its own (``memory_hold.Holder``), so that this takes a pipe's round trip
even while the worker writes a disk checkpoint. Forward only: a memory checkpoint whose step is
not newer than the newest committed one is never written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .memory_hold import CLOSE, PREEMPTION, TRAINER_DIED
from .staging import check_memory, plan_arenas

__all__ = [
    "CLOSE",
    "PREEMPTION",
    "TRAINER_DIED",
    "MemoryTier",
    "check_tier",
    "persist",
    "save",
    "worker_lost",
]

log = logging.getLogger("asyncckpt")

TIERS = ("disk", "memory")


def check_tier(tier: Any) -> str:
    if tier not in TIERS:
        raise ValueError(f'tier must be "disk" or "memory", not {tier!r}')
    return tier


def check_memory_tier(tensors: dict[str, Any], held_bytes: int) -> None:
    """Refuse the memory tier's two slots if the machine cannot hold them (before allocating
    either). ``held_bytes``: what the memory slots already hold (re-laid out in place)."""
    from .errors import StagingMemoryError

    _, sizes = plan_arenas(tensors)
    need = 2 * sum(sizes)
    try:
        check_memory(need - held_bytes)
    except StagingMemoryError as e:
        raise StagingMemoryError(
            f"the memory tier keeps two copies of the state in shared memory (the checkpoint "
            f"the worker holds and the one being staged): {need / 2**30:.2f} GiB. {e}; "
            "nothing was staged"
        ) from None


@dataclass
class MemoryTier:
    """The trainer's side: which of the engine's slots are the memory tier's, what was sent.

    ``slots``: indices into the engine's ``slots`` / ``slot_owner`` (appended at the first
    memory save). ``slot_owner[i]`` is the id of the memory job the worker may still read from
    slot ``i`` (until its ``Released``), or of a persist job in flight; None when free.
    """

    every_steps: int | None = None
    persist_on_close: bool = False
    slots: list[int] = field(default_factory=list)
    held: Any = None  # the SaveJob of the last Hold sent (the newest complete memory save)
    held_slot: int | None = None
    held_link: Any = None  # the worker link it was sent on (a new worker holds nothing)
    sent_on: dict[int, Any] = field(default_factory=dict)  # slot -> link of its last Hold
    last_step: int | None = None  # the newest memory save's step (steps go forward)
    last_due: int | None = None
    lost: int = 0  # memory saves lost with a worker that died holding them (worker_lost)
    unprotected_step: int | None = None  # the last one lost, until a new worker holds one

    def due(self, step: int) -> bool:
        """Every ``every_steps`` steps (``step > 0``), once per step."""
        if self.every_steps is None or step <= 0 or step == self.last_due:
            return False
        if step % self.every_steps == 0:
            self.last_due = step
            return True
        return False

    def pick_slot(
        self, owner: dict[int, Any], inflight: dict, link: Any, keys: dict[int, Any], key: tuple
    ) -> int | None:
        """A memory slot to stage into, or None while the worker still holds both. (Called
        with the engine's lock held.) A slot sent to a worker that was since replaced is free:
        the new worker holds nothing of it."""
        if self.held_link is not None and self.held_link is not link:
            self.held = self.held_slot = self.held_link = None
        for i in self.slots:
            o = owner[i]
            if o is not None and o not in inflight and self.sent_on.get(i) is not link:
                owner[i] = None
        free = [i for i in self.slots if owner[i] is None and i != self.held_slot]
        if not free:
            return None
        same = [i for i in free if keys.get(i) == key]
        return (same or free)[0]

    def released(self, owner: dict[int, Any], job_id: int) -> bool:
        """The worker let go of memory job ``job_id``'s slot; True if it was one of ours."""
        for i in self.slots:
            if owner[i] == job_id:
                owner[i] = None
                return True
        return False


# ------------------------------------------------------------------ the engine's side
# Functions of the engine's ``saving.Saver`` (``saver``), kept here so that the save path only
# passes ``tier`` through: its job table's lock and slots, and the worker's link, are used as
# its disk saves use them.


def _add_slots(saver: Any, pending: Any) -> None:
    """The memory tier's two slots, checked for room (2x the state) before either exists."""
    from .staging import StagingSlot

    mem, jobs = saver.memory, saver.jobs
    keys = {saver.slots[i].key for i in mem.slots}
    if mem.slots and keys == {pending.key}:
        return
    check_memory_tier(pending.flat.tensors, sum(saver.slots[i].nbytes for i in mem.slots))
    with jobs.cond:
        while len(mem.slots) < 2:
            i = len(saver.slots)
            saver.slots.append(StagingSlot(i))
            jobs.slot_owner[i] = None
            jobs.memory_slots.add(i)
            mem.slots.append(i)


def _take_slot(saver: Any, pending: Any) -> int:
    """A memory slot the worker does not hold; waits (a pipe's round trip) for its release."""
    from .errors import CheckpointError
    from .jobs import RESERVED

    mem, jobs = saver.memory, saver.jobs
    with jobs.cond:
        while True:
            keys = {i: saver.slots[i].key for i in mem.slots}
            link = saver.worker.link
            i = mem.pick_slot(jobs.slot_owner, jobs.inflight, link, keys, pending.key)
            if i is not None:
                jobs.slot_owner[i] = RESERVED
                return i
            error = saver.worker.start_error
            if not saver.is_started() or error is not None:
                raise CheckpointError(
                    f"memory save of step {pending.step}: the checkpoint worker is not running"
                    + (f" ({error})" if error else "")
                )
            jobs.cond.wait(0.5)


def save(saver: Any, pending: Any) -> Any:
    """Stage ``pending`` into a memory slot and hand it to the worker to hold; the handle
    completes at once (nothing is written unless the worker must persist it)."""
    import dataclasses
    import time

    from . import faults
    from . import messages as M
    from .errors import CheckpointError, SaveFailed, StateModifiedWhileStaging, WorkerDied
    from .staging import modified_since

    mem, jobs = saver.memory, saver.jobs
    step, flat, stats, handle = pending.step, pending.flat, pending.stats, pending.handle
    if mem.last_step is not None and step <= mem.last_step:
        raise CheckpointError(
            f"memory save of step {step}: steps must increase (the last memory save was step "
            f"{mem.last_step})"
        )
    _add_slots(saver, pending)
    i = _take_slot(saver, pending)
    slot = saver.slots[i]
    stats.wait_seconds = time.perf_counter() - pending.started
    try:
        pin = any(t.is_cuda for t in flat.tensors.values())
        t0 = time.perf_counter()
        if slot.ensure(flat.tensors, pin, pending.key):
            stats.alloc_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        slot.copy_in(flat.tensors, any_cuda=pin)
        stats.stage_seconds = time.perf_counter() - t1
        stats.staged_bytes = slot.nbytes
        torn = modified_since(flat.tensors, pending.versions)
        if torn:  # invariant 13, as for a disk save: a torn slot is never held
            cause = StateModifiedWhileStaging(torn)
            err = SaveFailed(
                f"memory save of step {step} failed: the state changed while it was staged "
                f"({cause}); the worker still holds the previous memory checkpoint"
            )
            err.__cause__ = cause
            jobs.unreserve(i)
            jobs.fail_unsent(handle, err)
            return handle
        faults.point("after_stage")
        with jobs.cond:
            jobs.next_job += 1
            job = saver.job_for(
                pending, slot, jobs.next_job, jobs.attempts.get(step, 0), tier="memory"
            )
            jobs.attempts[step] = job.attempt + 1
            jobs.slot_owner[i] = job.job_id
    except BaseException:
        jobs.unreserve(i)
        raise

    def let_go() -> None:
        with jobs.cond:
            if jobs.slot_owner[i] == job.job_id:
                jobs.slot_owner[i] = None
            jobs.cond.notify_all()

    try:
        with saver.sigterm.handing_off():
            saver.worker.wait_ready()
            job.faults = faults.snapshot()
            link = saver.worker.link
            # Paths only when they changed (a replayed plan hands out the same object).
            wire = (
                job if link.memory_paths is not flat.paths else dataclasses.replace(job, paths=None)
            )
            payload = M.encode(M.Hold(wire))
            with saver.worker.sending():
                saver.send_arenas(slot, link)  # the arenas and specs: on the jobs pipe
                M.send(link.memory, payload)
            link.memory_paths = flat.paths
            with jobs.cond:
                mem.sent_on[i] = link
                mem.held, mem.held_slot, mem.held_link = job, i, link
                mem.last_step = step
                mem.unprotected_step = None  # the hole a dead worker left is closed
    except OSError as e:
        let_go()
        jobs.fail_unsent(handle, WorkerDied(f"could not hand step {step} to the worker: {e}"))
        return handle
    except BaseException:
        let_go()
        raise
    finally:
        saver.sigterm.run_deferred()
    saver.wait_mapped(slot, link)  # the worker has the slot's memory (once per layout)
    handle._finish()  # held by the worker: done (it is written only if it must be)
    return handle


def worker_lost(saver: Any, link: Any, pid: int | None) -> None:
    """The worker ``pid`` (its ``link``) died with the trainer alive: the memory save it held
    is gone with its memory. Count it and say which step, unless disk has it or newer."""
    from . import layout as _layout

    mem, jobs = saver.memory, saver.jobs
    with jobs.cond:
        job = mem.held
        if job is None or mem.held_link is not link:
            return  # held nothing, or what it held was already counted or persisted
        newest = _layout.read_tracker(saver.rules.root)
        if newest is not None and job.step <= newest:
            return  # a disk checkpoint at least as new: nothing is unprotected
        mem.lost += 1
        mem.unprotected_step = job.step
    # The handle of that save succeeded long ago: this line is the only place it shows.
    log.warning(
        "the checkpoint worker (pid %s) died holding the memory save of step %d: it is lost; "
        "until the next memory save, a trainer's death resumes from disk (step %s)",
        pid,
        job.step,
        newest,
    )


def persist(saver: Any, reason: str) -> Any:
    """Ask the worker to write the memory checkpoint it holds, as a save in flight (the
    engine's drain waits for it); None if there is none, or it is not newer than what is on
    disk or in flight."""
    import dataclasses

    from . import faults
    from . import layout as _layout
    from . import messages as M
    from .errors import WorkerDied

    mem, jobs = saver.memory, saver.jobs
    if mem.held is None or mem.held_link is not saver.worker.link:
        return None
    saver.wait_staged()  # an overlapped save's thread may be sending: never two at once
    dirs = saver.restorer.committed()
    newest = dirs[-1].step if dirs else None
    with jobs.cond:
        job = mem.held
        if job is None:
            return None
        flying = max((j.handle.step for j in jobs.inflight.values()), default=None)
        final = saver.rules.root / _layout.dir_name(saver.rules.layout, job.step)
        if any(s is not None and job.step <= s for s in (newest, flying)) or final.exists():
            log.info("memory checkpoint of step %d not written: not newer than disk", job.step)
            return None
        jobs.next_job += 1
        pjob = dataclasses.replace(
            job,
            job_id=jobs.next_job,
            persisted_because=reason,
            memory_job_id=job.job_id,
            faults=faults.snapshot(),
        )
        handle = jobs.track(pjob, mem.held_slot)  # its slot is the write's until released
        mem.held = mem.held_slot = mem.held_link = None  # the worker forgets it too
    log.warning("writing the memory checkpoint of step %d (%s)", job.step, reason)
    try:
        with saver.worker.sending():
            M.send(saver.worker.link.conn, M.encode(M.Save(pjob)))
    except OSError as e:
        jobs.fail(pjob.job_id, WorkerDied(f"could not ask the worker to write it: {e}"))
    return handle

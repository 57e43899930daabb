"""The disk slots as a ``Stager`` (staging/stager.py): a save copied into one of the
``max_in_flight`` staging slots, reserved first (back-pressure, invariant 6), checked for torn
tensors (invariant 13), then handed to the worker, at once or (``overlap``) from a thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from asyncckpt import faults
from asyncckpt.core.cachekeys import same_key
from asyncckpt.errors import SaveFailed
from asyncckpt.staging.arenas import HostBudget, StagingSlot, any_cuda, ready_events
from asyncckpt.staging.stager import Handover, PendingSave, SaveHandle
from asyncckpt.staging.unchanged import CopySkipper, note_skips, stage_checked, worker_digests
from asyncckpt.trainer.jobs import JobTable

log = logging.getLogger("asyncckpt")


class DiskSlots:
    """The disk saves' own staging slots (the last stager: it claims every save)."""

    uses_disk_slot = True

    def __init__(
        self,
        *,
        slots: list[StagingSlot],
        jobs: JobTable,
        handover: Handover,
        skipper: CopySkipper,
        budget: HostBudget | None,
        let_go: Callable[[StagingSlot], None] | None,
        check_can_save: Callable[[int], int],
    ) -> None:
        self.slots = slots
        self.jobs = jobs
        self.handover = handover
        self.skipper = skipper
        self.budget = budget
        self.let_go = let_go
        self.check_can_save = check_can_save  # raises why a save cannot be made now
        self._giving_back = threading.Lock()  # take_slot vs give_back_slot of one save
        self.staging: SaveHandle | None = None  # the last overlapped save (staged or not)

    def claims(self, pending: PendingSave, overlap: bool) -> bool:
        return True

    # ------------------------------------------------------------------ the slot
    def take_slot(self, pending: PendingSave, block: bool = True) -> bool:
        """Reserve a staging slot (back-pressure); False only if ``block`` is False and none
        is free."""
        slot = self.jobs.acquire_slot(
            lambda i: same_key(self.slots[i].key, pending.key), block=block
        )
        if slot is None:
            if not block:
                return False
            self.check_can_save(pending.step)  # raises the failure that freed nothing
        with self._giving_back:
            if pending.abandoned:  # its caller was cancelled while this thread waited
                if slot is not None:
                    self.jobs.unreserve(slot)
                return False
            pending.slot = slot
        pending.stats.wait_seconds = time.perf_counter() - pending.started
        if pending.stats.wait_seconds > 0.001:
            log.info(
                "save of step %d waited %.3fs for a staging buffer",
                pending.step,
                pending.stats.wait_seconds,
            )
        return True

    def give_back_slot(self, pending: PendingSave) -> None:
        """The slot of a save abandoned before it staged: back to the table, now or (its
        ``take_slot`` still waiting in a thread that cannot be interrupted) once taken."""
        with self._giving_back:
            pending.abandoned = True
            if pending.slot is not None:
                self.jobs.unreserve(pending.slot)
                pending.slot = None

    # ------------------------------------------------------------------ staging
    def stage(self, pending: PendingSave, overlap: bool = False) -> SaveHandle:
        """Stage into the reserved slot and hand the job to the worker.

        ``overlap``: return at once; a background thread copies (and hands the job over) while
        the training loop goes on, and the handle's ``staged`` says when the copy is done.
        """
        assert pending.slot is not None
        if overlap:
            if any_cuda(pending.flat.tensors.values()):
                pending.ready = ready_events(pending.flat.tensors)
            pending.stats.overlapped = True
            pending.guard = True  # the loop goes on (and may free a storage) as it copies
            thread = threading.Thread(
                target=self._stage_behind, args=(pending,), name="asyncckpt-stage", daemon=True
            )
            self.staging = pending.handle
            try:
                thread.start()
            except BaseException:
                self.staging = None
                raise
            return pending.handle
        return self._stage_and_send(pending)

    def _stage_behind(self, pending: PendingSave) -> None:
        """An overlapped save's staging, on its own thread: a failure fails the handle."""
        handle = pending.handle
        try:
            self._stage_and_send(pending)
        except BaseException as e:  # noqa: BLE001 - reported on the handle, not lost
            assert pending.slot is not None
            self.jobs.unreserve(pending.slot)
            if not handle.done():
                err = SaveFailed(f"staging step {pending.step} failed: {e!r}; nothing was written")
                err.__cause__ = e
                self.jobs.fail_unsent(handle, err)
            else:
                handle._observed = False  # no caller saw it raise: the next save reports it
        finally:
            handle._staged.set()

    def staging_busy(self) -> bool:
        """True while an overlapped save is still copying."""
        h = self.staging
        return h is not None and not h._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> bool:
        """Wait until the overlapped save under way (if any) has copied the state."""
        h = self.staging
        return h is None or h._staged.wait(timeout)

    def _stage_and_send(self, pending: PendingSave) -> SaveHandle:
        step, flat, stats, slot_idx = pending.step, pending.flat, pending.stats, pending.slot
        assert slot_idx is not None
        slot = self.slots[slot_idx]
        pin = any_cuda(flat.tensors.values())
        t0 = time.perf_counter()
        if slot.ensure(flat.tensors, pin, pending.key, self.budget, self.let_go):
            stats.alloc_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        torn, skips = stage_checked(
            self.skipper, slot, flat.tensors, pending.marks, pending.guard, pin, pending.ready,
            check_bytes=stats.overlapped,
        )  # fmt: skip
        stats.stage_seconds = time.perf_counter() - t1
        stats.staged_bytes = slot.nbytes
        note_skips(stats, skips)
        handle = pending.handle
        if torn is not None:
            # Invariant 13: the arena may hold two moments of the state; never send it.
            err = SaveFailed(
                f"save of step {step} failed: the state changed while it was staged ({torn}); "
                "nothing was written, older checkpoints are intact. Wait for the copy before "
                "mutating the state or freeing its storage (handle.staged(), "
                "engine.stage_before_step(optimizer))"
            )
            err.__cause__ = torn
            self.jobs.unreserve(slot_idx)
            self.jobs.fail_unsent(handle, err)
            return handle
        faults.point("after_stage")
        job_id, attempt = self.jobs.add(step, handle, slot_idx)
        job = self.handover.job_for(
            pending, slot, job_id, attempt, digests=worker_digests(slot, skips)
        )
        if self.handover.send_job(pending, slot, job_id, job) is not None:
            handle._staged.set()  # copied and handed over: invariant 12 holds from here
        return handle

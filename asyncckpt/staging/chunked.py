"""Chunked staging: a state larger than ``Staging(max_host_bytes=)`` saved through the budget.

The budget is one shared-memory arena (handed to the worker once, like any staging arena):
a small control header, then two chunk buffers of about half the budget each. ``save()``
copies chunk 1 into buffer A and hands the job over; the worker writes chunk 1 while the
trainer copies chunk 2 into buffer B; chunk 3 waits until the worker has written chunk 1 and
given buffer A back (back-pressure), and so on. Which bytes go in which chunk is
``chunking.plan_chunks`` with each tensor cut, if at all, at whole rows.

One consistent snapshot: ``save()`` does not return before the last chunk is copied, so the
training loop cannot move the state on while part of it is still to be copied; its stall is
the copy of the whole state plus the waits for the worker's writes, so it grows with
state / budget. The torn-state check (invariant 13) runs before the last chunk is handed over,
from the counters and from the bytes (each CPU tensor's staged bytes fingerprinted while the
worker writes their chunk, every source fingerprinted again once the last chunk is copied:
``bytecheck.ChunkFingerprints``, so a ``.data`` write between chunks is seen too): the worker
commits only once every chunk is written and the last one is released by the trainer, and
a trainer that fails (torn state, an error) or dies before that leaves the worker nothing to
commit: it fails the save and removes its temporary (the previous step stays the newest); a
torn save's handle raises the trainer's error, naming the tensors (``JobTable.explain``).

The control header's int64 words (both processes poll them; a chunk's bytes are complete
before its count is stored):
``[job id, chunks filled by the trainer, chunks written by the worker, aborted by the trainer]``.
The worker's side (the writer that waits for each chunk) is ``chunked_write.py``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncckpt import faults
from asyncckpt.errors import SaveFailed, StagingMemoryError, StateModifiedWhileStaging
from asyncckpt.options import MIN_HOST_BYTES
from asyncckpt.staging.arenas import (
    HostBudget,
    Marks,
    StagingSlot,
    allocate_arena,
    check_memory,
    plan_arenas,
    read_only_bytes,
    torn_since,
)
from asyncckpt.staging.bytecheck import ChunkFingerprints
from asyncckpt.staging.chunking import ALIGN, Chunk, plan_chunks
from asyncckpt.staging.stager import Deferral, Handover, PendingSave, SaveHandle, SlotJobs

log = logging.getLogger("asyncckpt")

#: Bytes at the head of the chunk arena: the control words (one cache line).
HEADER = 64
#: Chunk buffers in the arena: the trainer fills one while the worker writes the other.
BUFFERS = 2
# The smallest budget Staging accepts holds the header and two of the smallest buffers.
assert HEADER + BUFFERS * ALIGN <= MIN_HOST_BYTES
#: How often each side looks at the other's progress while it waits (seconds).
POLL_S = 0.0005

_JOB, _FILLED, _WRITTEN, _ABORTED = range(4)
#: Why the trainer aborted (the ``_ABORTED`` word): an error or a torn state (invariant 13).
GAVE_UP, TORN = 1, 2


@dataclass(frozen=True)
class ChunkedTensor:
    """A staged tensor as the worker rebuilds it from the chunks."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    row_bytes: int  # bytes of one index along dim 0 (a slice's granularity)


@dataclass(frozen=True)
class ChunkedPlan:
    """Which bytes of which tensor are in which chunk, and where the chunk buffers are."""

    chunk_bytes: int
    tensors: tuple[ChunkedTensor, ...]
    chunks: tuple[Chunk, ...]

    @property
    def arena_bytes(self) -> int:
        return HEADER + BUFFERS * self.chunk_bytes

    def buffer_offset(self, k: int) -> int:
        """Where chunk ``k``'s buffer starts in the arena."""
        return HEADER + (k % BUFFERS) * self.chunk_bytes

    def sliced(self) -> set[int]:
        """Indices of the tensors cut into several pieces."""
        counts: dict[int, int] = {}
        for c in self.chunks:
            for p in c.pieces:
                counts[p.index] = counts.get(p.index, 0) + 1
        return {i for i, n in counts.items() if n > 1}


def chunk_bytes_for(budget: int) -> int:
    """The size of each chunk buffer under a budget of ``budget`` bytes (ALIGN multiple)."""
    return max(ALIGN, (budget - HEADER) // BUFFERS // ALIGN * ALIGN)


def plan_for(tensors: dict[str, torch.Tensor], budget: int) -> ChunkedPlan:
    """The chunk plan of ``tensors`` (staging order) under ``budget`` bytes."""
    chunk = chunk_bytes_for(budget)
    specs, sizes, quanta = [], [], []
    for fqn, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        rows = t.shape[0] if t.dim() > 0 else 1
        row = nbytes // rows if rows else nbytes
        specs.append(ChunkedTensor(fqn, t.dtype, tuple(t.shape), row))
        sizes.append(nbytes)
        quanta.append(row)
    try:
        chunks = plan_chunks(sizes, chunk, quanta)
    except ValueError as e:
        raise StagingMemoryError(
            f"the state cannot be staged in chunks of {chunk} bytes under "
            f"Staging(max_host_bytes={budget}): {e}; raise max_host_bytes; nothing was written"
        ) from e
    return ChunkedPlan(chunk, tuple(specs), tuple(chunks))


class ChunkSignals:
    """The control words at the head of a chunk arena (see the module's docstring)."""

    def __init__(self, arena: torch.Tensor) -> None:
        self.words = arena[:32].numpy().view(np.int64)  # 4 words, shared with the other side

    def begin(self, job_id: int) -> None:
        self.words[_FILLED] = self.words[_WRITTEN] = self.words[_ABORTED] = 0
        self.words[_JOB] = job_id

    def filled(self, count: int) -> None:
        self.words[_FILLED] = count

    def written(self, job_id: int, count: int) -> None:
        if self.words[_JOB] == job_id:  # a later save owns the header once this one failed
            self.words[_WRITTEN] = count

    def abort(self, torn: bool) -> None:
        self.words[_ABORTED] = TORN if torn else GAVE_UP

    def wait_free(self, k: int, going: Callable[[], bool]) -> bool:
        """Trainer: until chunk ``k``'s buffer is free (the chunk ``BUFFERS`` before it is
        written); False if ``going()`` turns False first (the job failed)."""
        while self.words[_WRITTEN] < k - BUFFERS + 1:
            if not going():
                return False
            time.sleep(POLL_S)
        return True

    def wait_filled(self, job_id: int, k: int, trainer_alive: Callable[[], bool]) -> None:
        """Worker: until chunk ``k`` is in its buffer; raises if the trainer gave the save up
        or died first (what was not fully staged is never committed)."""
        while True:
            if self.words[_JOB] != job_id or self.words[_ABORTED]:
                why = (
                    "the state changed while it was staged in chunks (a tensor written in "
                    "place or its storage freed before save() returned)"
                    if self.words[_ABORTED] == TORN
                    else "the trainer gave up staging it (an error in save(): see its traceback)"
                )
                raise SaveFailed(
                    f"{why}, after {int(self.words[_FILLED])} chunk(s); nothing was committed, "
                    "older checkpoints are intact"
                )
            if self.words[_FILLED] > k:
                return
            if not trainer_alive():
                raise SaveFailed(
                    f"the trainer died while staging this save in chunks ({k} of them "
                    "copied); nothing is committed"
                )
            time.sleep(POLL_S)


def hold_arena(
    slot: StagingSlot, nbytes: int, pin: bool, let_go: Callable[[StagingSlot], None] | None
) -> bool:
    """Give ``slot`` one arena of ``nbytes`` and no tensor specs (the chunk buffers), unless
    it has it already; True if newly allocated (the worker must be sent it). ``let_go``: as
    for ``StagingSlot.ensure``."""
    key = ("asyncckpt-chunks", nbytes)
    if slot.lays_out(key, pin):
        return False
    check_memory(nbytes - slot.nbytes)
    slot.release()
    if let_go is not None:
        let_go(slot)
    slot.arenas = [allocate_arena(nbytes, pin)]
    slot.pinned, slot.nbytes, slot.key = pin, nbytes, key
    StagingSlot._next_id += 1
    slot.arena_ids = [StagingSlot._next_id]
    return True


def _copy_piece(dst: torch.Tensor, t: torch.Tensor, spec: ChunkedTensor, piece: Any) -> None:
    """Copy the rows of ``piece`` of ``t`` into ``dst`` (the bytes at the piece's offset)."""
    if piece.nbytes == 0:
        return
    raw = dst[piece.offset : piece.offset + piece.nbytes]
    src = t.detach()
    if src.dim() > 0 and piece.nbytes != spec.row_bytes * src.shape[0]:
        src = src[piece.start // spec.row_bytes : piece.stop // spec.row_bytes]
    if not src.is_cuda and src.is_contiguous() and not (src.is_conj() or src.is_neg()):
        np.copyto(raw.numpy(), read_only_bytes(src))  # (the arena's own bytes: ours)
    else:  # on a GPU, or strided: torch's copy into a typed view of the bytes
        raw.view(src.dtype).view(src.shape).copy_(src)


@dataclass
class ChunkedStaging:
    """One save's chunks, copied by the trainer (``run``) as the worker frees buffers."""

    plan: ChunkedPlan
    arena: torch.Tensor
    tensors: dict[str, torch.Tensor]
    marks: Marks
    signals: ChunkSignals
    waited: float = 0.0
    prints: ChunkFingerprints = field(default_factory=ChunkFingerprints)
    _arena_bytes: Any = None

    def _bytes(self) -> Any:
        """The chunk arena as a flat uint8 NumPy array (made once)."""
        if self._arena_bytes is None:
            self._arena_bytes = self.arena.numpy()
        return self._arena_bytes

    def run(
        self,
        job_id: int,
        going: Callable[[], bool],
        hand_over: Callable[[], None],
        on_torn: Callable[[StateModifiedWhileStaging], None] = lambda e: None,
    ) -> bool:
        """Copy every chunk; ``hand_over()`` sends the job once chunk 1 is in. Returns False
        if the job ended (failed) before every chunk was copied. Raises a torn state
        (``StateModifiedWhileStaging``) before the last chunk is released, ``on_torn`` told
        of it before the worker is."""
        srcs = list(self.tensors.values())
        n = len(self.plan.chunks)
        self.signals.begin(job_id)
        torn = False
        done = False
        try:
            for k, chunk in enumerate(self.plan.chunks):
                t0 = time.perf_counter()
                if not self.signals.wait_free(k, going):
                    return False
                self.waited += time.perf_counter() - t0
                indices = sorted({p.index for p in chunk.pieces})
                self.marks.check_pointers(self.tensors, srcs, indices)  # nothing freed
                base = self.plan.buffer_offset(k)
                buf = self.arena[base : base + self.plan.chunk_bytes]
                with torch.no_grad():
                    for p in chunk.pieces:
                        spec = self.plan.tensors[p.index]
                        _copy_piece(buf, srcs[p.index], spec, p)
                        if p.nbytes and not srcs[p.index].is_cuda:  # (GPU: counters only)
                            at = base + p.offset
                            staged = self._bytes()[at : at + p.nbytes]
                            self.prints.staged(p.index, p.start, p.stop, spec.row_bytes, staged)
                if any(t.is_cuda for t in srcs):
                    torch.cuda.synchronize()
                if k == n - 1:
                    self.prints.take()
                    changed = self._torn(srcs)
                    if changed is not None:
                        torn = True
                        raise changed
                self.signals.filled(k + 1)
                if k == 0:
                    hand_over()
                if k < n - 1:
                    # Fingerprinted while the worker writes it (both only read the buffer;
                    # it is refilled only once the worker gave it back): a disk-bound save
                    # waits for the worker meanwhile anyway.
                    self.prints.take()
                    faults.point("between_chunks")
            done = True
            return True
        except StateModifiedWhileStaging as e:
            torn = True
            on_torn(e)
            raise
        finally:
            if not done:
                self.signals.abort(torn)  # the worker must not wait for (or commit) the rest

    def _torn(self, srcs: list[torch.Tensor]) -> StateModifiedWhileStaging | None:
        """Once the last chunk is copied: a write the counters see, else one they do not
        (each source's bytes compared with the digests of what was staged of it)."""
        changed = torn_since(self.tensors, self.marks)
        if changed is not None:
            return changed
        unseen = self.prints.changed(self.tensors, srcs, self.marks)
        if not unseen:
            return None
        # A write the counters do see may have landed since torn_since: named as such.
        return torn_since(self.tensors, self.marks) or StateModifiedWhileStaging(
            unseen, unseen=unseen
        )


# ------------------------------------------------------------------ the save path's side
class ChunkedStager:
    """The chunked budget as a ``Stager``: a disk save whose state is over
    ``Staging(max_host_bytes=)`` is staged through the budget's one chunk arena."""

    uses_disk_slot = True  # the chunk arena is a disk slot's (max_in_flight=1)

    def __init__(
        self,
        budget: HostBudget | None,
        *,
        fmt: str,
        components: bool,
        slots: list[StagingSlot],
        jobs: SlotJobs,
        handover: Handover,
        sigterm: Deferral,
        let_go: Callable[[StagingSlot], None] | None,
        whole_states: Callable[[], bool],
    ) -> None:
        self.budget = budget
        self.fmt = fmt
        self.components = components  # Components(...): not plain DCP
        self.slots = slots
        self.jobs = jobs
        self.handover = handover
        self.sigterm = sigterm
        self.let_go = let_go
        self.whole_states = whole_states  # the memory tier is on: its slots hold whole states
        # The last (layout, budget) asked about (``plan``): its staged bytes and chunk plan.
        self._last: tuple[Any, int, ChunkedPlan | None] = (None, 0, None)

    def plan(self, flat: Any, key: tuple) -> ChunkedPlan | None:
        """The chunk plan of ``flat``'s tensors if their staging is over the budget (None: it
        fits, or there is no budget). Raises ``StagingMemoryError`` where such a state cannot
        be staged in chunks (the reason is in the message)."""
        budget = self.budget
        if budget is None:
            return None
        if self._last[0] is None or self._last[0] != (key, budget):  # once per layout
            staged = sum(plan_arenas(flat.tensors)[1])
            over = staged * budget.copies > budget.max_bytes
            plan = plan_for(flat.tensors, budget.max_bytes) if over and budget.copies == 1 else None
            self._last = ((key, budget), staged, plan)
        staged, plan = self._last[1], self._last[2]
        if staged * budget.copies <= budget.max_bytes:
            return None
        why = None
        if budget.copies > 1:
            why = f"max_in_flight={budget.copies} (chunks need max_in_flight=1)"
        elif self.components or self.fmt != "dcp":
            why = f"format {self.fmt!r} (chunks are written for plain DCP only)"
        elif flat.extra and flat.extra.get("shards"):
            why = "DTensor pieces (chunks take plain tensors only)"
        elif self.whole_states():
            why = "a memory tier (its slots hold whole states)"
        if why is not None or plan is None:
            raise StagingMemoryError(
                f"staging this state takes {staged / 2**20:.1f} MiB of host memory per save, "
                f"over Staging(max_host_bytes={budget.max_bytes}) with {budget.copies} in "
                f"flight, and it cannot be staged in chunks with {why}; raise max_host_bytes; "
                "nothing was written"
            )
        return plan

    def claims(self, pending: PendingSave, overlap: bool) -> bool:
        """Over the budget: staged in chunks (a refusal raises here, and an overlapped save is
        refused: the chunks are copied before ``save()`` returns)."""
        plan = self.plan(pending.flat, pending.key)
        if plan is not None and overlap:
            refuse_overlap(plan)
        return plan is not None

    def stage(self, pending: PendingSave, overlap: bool = False) -> SaveHandle:
        """Copy ``pending`` into its reserved slot chunk by chunk while the worker writes
        them; returns the handle once the last chunk is copied (or the save failed)."""
        # The plan ``claims`` found (made once per layout: ``plan`` answers from its cache).
        plan, slot_idx = self.plan(pending.flat, pending.key), pending.slot
        assert plan is not None and slot_idx is not None
        slot = self.slots[slot_idx]
        tensors = pending.flat.tensors
        stats, handle = pending.stats, pending.handle
        pin = any(t.is_cuda for t in tensors.values())
        t0 = time.perf_counter()
        if hold_arena(slot, plan.arena_bytes, pin, self.let_go):
            stats.alloc_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        job_id, attempt = self.jobs.add(pending.step, handle, slot_idx)
        job = self.handover.job_for(pending, slot, job_id, attempt)
        job.chunks = plan
        job.figures["chunks"] = len(plan.chunks)
        job.figures["staged_bytes"] = sum(p.nbytes for c in plan.chunks for p in c.pieces)
        arena = slot.arenas[0]
        staging = ChunkedStaging(plan, arena, tensors, pending.marks, ChunkSignals(arena))
        sent: list[Any] = []

        def hand_over() -> None:
            link = self.handover.send_job(pending, slot, job_id, job)
            if link is None:
                raise _Ended()
            sent.append(link)

        def going() -> bool:
            return self.jobs.in_flight(job_id)

        failed: list[SaveFailed] = []

        def torn(e: StateModifiedWhileStaging) -> None:
            err = SaveFailed(
                f"save of step {pending.step} failed: the state changed while it was staged "
                f"in chunks ({e}); nothing was committed, older checkpoints are intact. Do not "
                "mutate the state or free its storage while save() runs"
            )
            err.__cause__ = e
            failed.append(err)
            self.jobs.explain(job_id, err)  # the handle raises it, not the worker's word

        with self.sigterm.handing_off():  # a SIGTERM's drain would wait for chunks never copied
            try:
                complete = staging.run(job_id, going, hand_over, torn)
            except _Ended:
                complete = False
            except StateModifiedWhileStaging:
                complete = False
                log.error("%s", failed[0])
                if sent:  # the worker fails it (told by the header), then gives the slot back
                    while going():
                        time.sleep(POLL_S)
                else:
                    self.jobs.fail(job_id, failed[0])
            except BaseException as e:
                handle._observed = True  # the caller sees this very exception
                if not sent:
                    self.jobs.fail(job_id, SaveFailed(f"staging step {pending.step} failed: {e!r}"))
                raise  # (sent: the worker fails it, told by the header)
            finally:
                self.sigterm.run_deferred()
        stats.stage_seconds = time.perf_counter() - t1 - staging.waited  # (blocked: stage+wait)
        stats.wait_seconds += staging.waited
        stats.copy_check_seconds = staging.prints.seconds
        stats.staged_bytes = job.figures["staged_bytes"]
        stats.chunks = len(plan.chunks)
        if complete:
            log.info(
                "save of step %d staged in %d chunks of %.1f MiB (over Staging(max_host_bytes=)): "
                "%.3fs, of which %.3fs waiting for the worker's writes",
                pending.step,
                len(plan.chunks),
                plan.chunk_bytes / 2**20,
                stats.stage_seconds,
                staging.waited,
            )
            handle._staged.set()
        return handle


def refuse_overlap(plan: ChunkedPlan) -> None:
    raise StagingMemoryError(
        f"this state is over Staging(max_host_bytes=) and is staged in {len(plan.chunks)} "
        "chunks, which save() copies before it returns (one snapshot): overlap=True cannot "
        "stage it behind the training loop; save it without overlap or raise max_host_bytes; "
        "nothing was written"
    )


class _Ended(Exception):
    """The job could not be handed over (its handle already says why)."""

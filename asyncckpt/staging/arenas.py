"""Stage: copy the training state into reused shared-memory arenas.

``save`` blocks the training loop only for what happens in this module. The state is flattened
the way DCP flattens it (``core.tree``: plain ``torch.distributed.checkpoint.load`` finds the
same keys), tensors are copied into a few large shared-memory arenas allocated once per state layout and
handed to the worker once, and non-tensor leaves are pickled (which both snapshots them and
proves they can be written, before anything touches the disk).
"""

from __future__ import annotations

import io
import operator
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch

from asyncckpt import faults
from asyncckpt._torch import foreach_copy_, host_register, host_unregister, version_counters
from asyncckpt.core.cachekeys import arena_key, same_key
from asyncckpt.core.savejob import TensorSpec
from asyncckpt.errors import NotSerializable, StagingMemoryError, StateModifiedWhileStaging
from asyncckpt.staging.copyruns import SmallCopyPlan, empty_plan

#: Alignment of every tensor inside an arena (cache line; keeps vectorised copies fast).
ALIGN = 64
#: An arena holds at most this many bytes, unless one tensor alone is larger.
ARENA_BYTES = 4 << 30
#: Staging refuses to allocate if less than this would be left available afterwards.
MEMORY_HEADROOM = 1 << 30


def serialize_objects(objects: dict[str, Any]) -> dict[str, bytes]:
    """Serialise the non-tensor leaves now, the way DCP does (``torch.save``).

    This snapshots them (the loop may mutate them right after ``save`` returns), gives a clear
    error naming the entry before anything touches the disk, and spares the worker from ever
    unpickling user objects (whose classes may live in the trainer's ``__main__``).
    """
    out = {}
    for fqn, obj in objects.items():
        buf = io.BytesIO()
        try:
            torch.save(obj, buf)
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            kind = type_name(obj)
            raise NotSerializable(
                f"state entry {fqn!r} ({kind}) cannot be saved: {e}; save plain values "
                "(tensors, numbers, strings, containers of them) or leave it out of the "
                "state; nothing was written",
                key=fqn,
                type_name=kind,
            ) from e
        out[fqn] = buf.getvalue()
    return out


def type_name(obj: Any) -> str:
    """``obj``'s type as a user would write it: ``function``, ``_thread.lock``, ``mod.Cls``."""
    cls = type(obj)
    module = getattr(cls, "__module__", "builtins")
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


#: Two states with the same key share staging arenas (``cachekeys`` says what each cache covers).
layout_key = arena_key


def plan_arenas(
    tensors: dict[str, torch.Tensor], arena_bytes: int = ARENA_BYTES
) -> tuple[list[TensorSpec], list[int]]:
    """Place every tensor in an arena; returns the specs and the size of each arena."""
    specs: list[TensorSpec] = []
    sizes: list[int] = [0]
    for fqn, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        offset = -(-sizes[-1] // ALIGN) * ALIGN
        if offset + nbytes > arena_bytes and sizes[-1] > 0:
            sizes.append(0)
            offset = 0
        specs.append(TensorSpec(fqn, len(sizes) - 1, offset, nbytes, t.dtype, tuple(t.shape)))
        sizes[-1] = offset + nbytes
    return specs, [max(s, 1) for s in sizes]


def check_memory(nbytes: int) -> None:
    """Refuse an allocation that would push the machine into swap or the OOM killer."""
    available = psutil.virtual_memory().available
    if nbytes + MEMORY_HEADROOM > available:
        raise StagingMemoryError(
            f"staging needs {nbytes / 2**30:.2f} GiB of shared memory but only "
            f"{available / 2**30:.2f} GiB is available (keeping {MEMORY_HEADROOM / 2**30:.1f} GiB "
            "headroom); lower Staging(max_in_flight=) or free memory"
        )
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return
    if nbytes > shm_free:
        raise StagingMemoryError(
            f"staging needs {nbytes / 2**30:.2f} GiB in /dev/shm but only {shm_free / 2**30:.2f} GiB "
            "is free there (in a container, raise --shm-size)"
        )


@dataclass(frozen=True)
class HostBudget:
    """``Staging(max_host_bytes=, max_in_flight=)`` as the slots see it: each of the
    ``copies`` slots may hold at most ``max_bytes // copies`` (the slots are reused for every
    save, so one that fits at the first save fits for the whole run)."""

    max_bytes: int
    copies: int

    def check(self, nbytes: int) -> None:
        """Raise ``StagingMemoryError`` if one slot of ``nbytes`` is over its share."""
        if nbytes * self.copies > self.max_bytes:
            raise StagingMemoryError(
                f"staging this state takes {nbytes / 2**20:.1f} MiB of host memory per save in "
                f"flight ({self.copies} in flight: {nbytes * self.copies / 2**20:.1f} MiB), over "
                f"Staging(max_host_bytes={self.max_bytes}) ({self.max_bytes / 2**20:.1f} MiB); "
                "raise max_host_bytes or lower max_in_flight; nothing was written"
            )


def allocate_arena(nbytes: int, pin: bool) -> torch.Tensor:
    """One shared-memory byte tensor; page-locked in place for async D2H copies on CUDA."""
    arena = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    if pin:
        # Registering the shared pages makes them pinned without a second copy.
        host_register(arena.data_ptr(), nbytes)
    return arena


def unpin_arena(arena: torch.Tensor) -> None:
    host_unregister(arena.data_ptr())


def arena_view(arena: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The typed view of ``spec`` inside the trainer's arena tensor."""
    raw = arena[spec.offset : spec.offset + spec.nbytes]
    if spec.nbytes == 0:
        return torch.empty(spec.shape, dtype=spec.dtype)
    return raw.view(spec.dtype).view(spec.shape)


class StagingSlot:
    """One checkpoint's worth of arenas, reused for every save with the same layout."""

    _next_id = 0

    def __init__(self, index: int, pack_check: bool = True) -> None:
        self.index = index
        # Whether the byte check may pack small tensors into scratch buffers (bytecheck.py):
        # not under a staging budget, which they would sit outside of.
        self.pack_check = pack_check
        self.key: tuple | None = None
        self.arena_ids: list[int] = []
        self.arenas: list[torch.Tensor] = []
        self.specs: list[TensorSpec] = []
        self.views: list[torch.Tensor] = []
        self.small: list[int] = []  # indices of tensors under SMALL_TENSOR_BYTES
        self.small_views: list[torch.Tensor] = []
        self.small_plan = empty_plan()  # how the small ones are copied (copyruns.py)
        self.large: list[int] = []  # the others (empty tensors are in neither)
        self.dst_bytes: dict[int, Any] = {}  # a large view's bytes as a numpy array
        self.pinned = False
        self.nbytes = 0
        # Large tensor index -> the fingerprint of the bytes its view holds now (unchanged.py:
        # a save skips copying a tensor whose bytes this very slot already holds). Forgotten
        # with the arenas: a new layout, or the arena lent to chunked staging.
        self.held: dict[int, bytes] = {}
        # Ids of arenas released since the engine last looked: the worker still maps them
        # until it is told to drop them (engine._send_arenas), or the memory is never freed.
        self.retired: list[int] = []
        # The small tensors packed for the byte check of overlapped saves (bytecheck.py).
        self.byte_check: Any = None

    def ensure(
        self,
        tensors: dict[str, torch.Tensor],
        pin: bool,
        key: tuple | None = None,
        budget: HostBudget | None = None,
        let_go: Callable[[StagingSlot], None] | None = None,
    ) -> bool:
        """Allocate arenas for this layout unless they exist; True if newly allocated.
        ``budget``: refuse (``StagingMemoryError``) a layout that does not fit in it.
        ``let_go``: called between the release of the old arenas and the allocation of the
        new ones (saving.let_worker_go: the worker unmaps them first)."""
        key = layout_key(tensors) if key is None else key
        if self.lays_out(key, pin):
            return False
        specs, sizes = plan_arenas(tensors)
        if budget is not None:
            budget.check(sum(sizes))
        check_memory(sum(sizes) - self.nbytes)
        self.release()
        if let_go is not None:
            let_go(self)
        self.arenas = [allocate_arena(n, pin) for n in sizes]
        self.pinned = pin
        self.nbytes = sum(sizes)
        self.arena_ids = []
        for _ in sizes:
            StagingSlot._next_id += 1
            self.arena_ids.append(StagingSlot._next_id)
        self.specs = specs
        self.views = [arena_view(self.arenas[s.arena], s) for s in specs]
        # The copy plan, fixed for the layout: small tensors in one foreach copy (the
        # per-tensor work done in C++, not here), large ones in memcpy chunks on the pool.
        self.small = [i for i, s in enumerate(specs) if 0 < s.nbytes < SMALL_TENSOR_BYTES]
        self.small_views = [self.views[i] for i in self.small]
        self.small_plan = SmallCopyPlan.build(
            [specs[i] for i in self.small], self.small_views, self.arenas
        )
        self.large = [i for i, s in enumerate(specs) if s.nbytes >= SMALL_TENSOR_BYTES]
        self.dst_bytes = {i: _bytes_of_view(self.views[i]) for i in self.large}
        self.key = key
        return True

    def lays_out(self, key: tuple | None, pin: bool) -> bool:
        """True if this slot's arenas are laid out for ``key`` (page-locked if ``pin``)."""
        return same_key(key, self.key) and bool(self.arenas) and (self.pinned or not pin)

    def release(self) -> None:
        self.retired.extend(self.arena_ids)
        if self.pinned:
            for a in self.arenas:
                unpin_arena(a)
        self.arenas, self.views, self.specs, self.arena_ids = [], [], [], []
        self.small, self.small_views, self.large, self.dst_bytes = [], [], [], {}
        self.small_plan = empty_plan()
        self.key, self.pinned, self.nbytes = None, False, 0
        self.held = {}
        self.byte_check = None

    def take_retired(self) -> list[int]:
        """The ids of arenas released since the last call (for the worker to drop)."""
        retired, self.retired = self.retired, []
        return retired

    def copy_in(
        self,
        tensors: dict[str, torch.Tensor],
        any_cuda: bool | None = None,
        ready: dict[int, Any] | None = None,
        marks: Marks | None = None,
        skip: frozenset[int] = frozenset(),
    ) -> None:
        """Copy every tensor into its view; returns once the copies have completed.

        Large CPU tensors go to the copy pool (memcpy chunks) first; meanwhile this thread
        copies the small ones with one ``torch._foreach_copy_`` (thousands of tensors cost
        about a microsecond each, not a Python loop's tens). CUDA tensors go on a side stream.
        ``any_cuda``: whether any tensor is on a GPU, where the caller knows (a pass over
        20,000 tensors asking is 4 ms, a tenth of such a save's stall).
        ``ready``: device index -> a CUDA event recorded where the values to save were queued
        (an overlapped save, copied on another thread: that thread's current stream is not the
        trainer's); without it the side stream waits for this thread's current stream.
        ``marks``: check, right before each group of tensors is read, that none of their
        storages moved since ``save`` was called (``StateModifiedWhileStaging``): a freed one
        would be read through a dangling pointer (torch's copy crashes on a null one).
        ``skip``: indices of large tensors not copied: their views hold their bytes already
        (unchanged.py decides that from fingerprints, never from counters).
        """
        srcs = list(tensors.values())
        cuda_pairs = []
        if marks is not None and self.large:
            marks.check_pointers(tensors, srcs, self.large)
        with _CpuCopier(cpu_copy_threads()) as copier:
            for i in self.large:
                if i in skip:
                    continue
                t = srcs[i]
                src = None if t.is_cuda else _as_bytes(t)
                if t.is_cuda:
                    cuda_pairs.append((self.views[i], t))
                elif src is None:
                    self.views[i].copy_(t.detach())
                else:
                    copier.add(self.dst_bytes[i], src)
            copier.flush()
            # Some of the state copied (the large CPU tensors under way), not all: a delay here
            # widens the window a torn-state test writes in.
            faults.point("mid_stage")
            # All small (the many-tensor case): the plan's indices are 0..n-1, no gather.
            small = srcs if len(self.small) == len(srcs) else [srcs[i] for i in self.small]
            if marks is not None and self.small:
                marks.check_pointers(tensors, srcs, self.small)
            if (any_cuda is None or any_cuda) and any(t.is_cuda for t in small):
                cpu_dst, cpu_src = [], []
                for view, t in zip(self.small_views, small, strict=True):
                    if t.is_cuda:
                        cuda_pairs.append((view, t))
                    else:
                        cpu_dst.append(view)
                        cpu_src.append(t)
                if cpu_src:
                    with torch.no_grad():
                        foreach_copy_(cpu_dst, cpu_src)
            elif small:  # all on the CPU: runs of one shape by stack, the rest by foreach
                self.small_plan.copy(small)
        if cuda_pairs:
            _copy_from_cuda(cuda_pairs, ready)


#: Tensors under this size are copied together by one ``torch._foreach_copy_`` on the
#: training thread; larger ones in memcpy chunks by the copy pool.
SMALL_TENSOR_BYTES = 1 << 20

#: Threads for CPU -> arena copies; None uses as many as the trainer's torch intra-op pool
#: (the cores it computes on, idle while ``save`` blocks it), at most 8; the environment
#: variable ASYNCCKPT_COPY_THREADS overrides both. The copies are numpy memcpys of 32 MiB
#: chunks handed out by a small thread pool: a thread that loses its core to another process
#: delays one chunk, not the whole copy (torch's OpenMP copy waits for its slowest thread,
#: 2-3x slower than one memcpy stream on a small, busy machine: benchmarks/README.md).
CPU_COPY_THREADS: int | None = None
_COPY_CHUNK = 32 << 20
_copy_pool: Any = None
_copy_pool_threads = 0


def cpu_copy_threads() -> int:
    env = os.environ.get("ASYNCCKPT_COPY_THREADS")
    if env:
        return max(1, int(env))
    if CPU_COPY_THREADS:
        return max(1, CPU_COPY_THREADS)
    return max(1, min(8, torch.get_num_threads()))


def _as_bytes(t: torch.Tensor) -> Any:
    """The bytes of a dense CPU tensor as a numpy array (no copy), or None to use torch."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return read_only_bytes(t)


class _Borrowed:
    """A NumPy array's view of a tensor's bytes, made from its data pointer: the array keeps
    this object (and so the tensor) alive as its ``base``."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, t: torch.Tensor, nbytes: int, writable: bool = False) -> None:
        self.tensor = t
        self.__array_interface__ = {
            "data": (t.data_ptr(), not writable),  # (the flag says "read-only")
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


def read_only_bytes(t: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor as a read-only flat uint8 NumPy array (no copy).

    Not ``t.numpy()``: torch marks a storage exported to NumPy non-resizable for good, and
    the caller's tensors must stay as they were (``t.resize_()``,
    ``t.untyped_storage().resize_(0)`` still work after a save, as after ``dcp.save``).
    Reading through the pointer is as safe as torch's own copy: the caller must not free
    the storage while the save reads it (``Marks.check_pointers`` sees one freed before)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_Borrowed(t, nbytes))


def writable_bytes(t: torch.Tensor) -> Any:
    """``read_only_bytes``, writable: what a load reads the checkpoint's bytes into when the
    target is the caller's own tensor (left resizable, as after ``dcp.load``)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    return np.asarray(_Borrowed(t, nbytes, writable=True))


def _bytes_of_view(view: torch.Tensor) -> Any:
    """The flat uint8 numpy array over an arena view (computed once per layout)."""
    return view.reshape(-1).view(torch.uint8).numpy()


def _pool(threads: int) -> Any:
    global _copy_pool, _copy_pool_threads
    if _copy_pool is None or _copy_pool_threads != threads:
        from concurrent.futures import ThreadPoolExecutor

        if _copy_pool is not None:
            _copy_pool.shutdown(wait=False)
        _copy_pool = ThreadPoolExecutor(threads, thread_name_prefix="asyncckpt-copy")
        _copy_pool_threads = threads
    return _copy_pool


class _CpuCopier:
    """Copies (dst, src) byte arrays, in tasks of about ``_COPY_CHUNK`` bytes.

    numpy's copy is a plain memcpy that releases the GIL: one thread copies inline; more hand
    tasks to a small pool as soon as each is full (big tensors cut into slices, small ones
    batched, so thousands of small tensors cost tens of tasks, not thousands). Leaving the
    ``with`` block waits for every task, also when the block raised, so nothing is still
    writing into the arena once the caller sees an error.
    """

    def __init__(self, threads: int) -> None:
        self.pool = _pool(threads) if threads > 1 else None
        self.batch: list[tuple[Any, Any]] = []
        self.filled = 0
        self.futures: list[Any] = []

    def add(self, dst: Any, src: Any) -> None:
        if self.pool is None:
            np.copyto(dst, src)
            return
        for off in range(0, len(src), _COPY_CHUNK):
            self.batch.append((dst[off : off + _COPY_CHUNK], src[off : off + _COPY_CHUNK]))
            self.filled += min(_COPY_CHUNK, len(src) - off)
            if self.filled >= _COPY_CHUNK:
                self._submit()

    def flush(self) -> None:
        """Hand the pending batch to the pool now (the caller has other work meanwhile)."""
        if self.pool is not None:
            self._submit()

    def _submit(self) -> None:
        if self.batch and self.pool is not None:
            self.futures.append(self.pool.submit(_copy_batch, self.batch))
        self.batch, self.filled = [], 0

    def __enter__(self) -> _CpuCopier:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._submit()
        from concurrent.futures import wait

        wait(self.futures)
        if exc_type is None:
            for f in self.futures:
                f.result()  # re-raise a copy's error


def _copy_batch(batch: list[tuple[Any, Any]]) -> None:
    for dst, src in batch:
        np.copyto(dst, src)


_side_streams: dict[int, Any] = {}


def side_stream(dev: int, ready: dict[int, Any] | None = None) -> Any:
    """The copy stream of device ``dev``, made to wait for the values to save: the event of
    the ``save`` call's stream where given (``ready``), else this thread's current stream.
    Fingerprints (unchanged.py) run on it too, so the copies queue after them."""
    stream = _side_streams.get(dev)
    if stream is None:
        stream = _side_streams[dev] = torch.cuda.Stream(dev)
    if ready is not None and dev in ready:
        stream.wait_event(ready[dev])  # the trainer's stream when save() was called
    else:
        stream.wait_stream(torch.cuda.current_stream(dev))
    return stream


def _copy_from_cuda(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], ready: dict[int, Any] | None = None
) -> None:
    # Non-blocking D2H copies on a side stream that first waits for the work already queued on
    # each tensor's current stream (so we copy the values the training step produced), then a
    # wait on one event per device, not a device-wide synchronize.
    by_device: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for view, t in pairs:
        by_device.setdefault(t.device.index or 0, []).append((view, t))
    events = []
    for dev, items in by_device.items():
        with torch.cuda.device(dev):
            stream = side_stream(dev, ready)
            with torch.cuda.stream(stream):
                for view, t in items:
                    if t.numel():
                        view.copy_(t.detach(), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
    for ev in events:
        ev.synchronize()


# ------------------------------------------------------------------ torn states (invariant 13)
# Every in-place op through autograd's view of a tensor (``add_``, ``copy_``, an optimizer's
# step, also under ``torch.no_grad``, and through ``.detach()`` aliases, which share the
# counter) bumps its version counter, and so do the in-place ops that change its shape, strides
# or offset (``resize_``, ``set_``, ``as_strided_``, ``t_``). What does not bump it is freeing,
# resizing or swapping the storage under the tensor (``untyped_storage().resize_(0)``, which FSDP
# does to parameters between steps, a growing or shrinking ``resize_``, ``.data = other``):
# there the tensor's data pointer moves, as torch allocates a resized storage's new block while
# the old one is still held, and a freed one has none. Counters and pointers of 20,000 tensors
# are ~1.5 ms of Python each, read twice per save (when it is called, when staging ends), and
# the pointers once more before the copy reads them where other code of the program ran since
# ``save`` was called (``Marks.check_pointers``). A storage's size adds nothing the pointer
# does not show, save a free and a re-allocation of another size at the same address, and
# neither shows a free and a re-allocation of the same size there.

_DATA_PTR = torch.Tensor.data_ptr  # unbound: 3x cheaper per tensor than a methodcaller


@dataclass
class Marks:
    """What says each tensor still holds the bytes of the ``save`` call, in staging order."""

    versions: list[int]  # in-place writes (empty where torch has no counters)
    pointers: list[int]  # the data pointer: a storage freed, resized or replaced

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> Marks:
        ts = tensors.values()
        return cls(version_counters(ts), list(map(_DATA_PTR, ts)))

    def check_pointers(
        self, tensors: dict[str, torch.Tensor], srcs: list[torch.Tensor], indices: list[int]
    ) -> None:
        """Raise ``StateModifiedWhileStaging`` if a storage of ``srcs[i]`` (``i`` in
        ``indices``) moved: the copy must not read a storage that was freed or replaced."""
        if len(indices) == len(srcs):  # all of them (the many-small-tensors case): no gather
            now, before = list(map(_DATA_PTR, srcs)), self.pointers
        else:
            now = [_DATA_PTR(srcs[i]) for i in indices]
            before = [self.pointers[i] for i in indices]
        if now != before:
            keys = list(tensors)
            moved = [keys[i] for i, a, b in zip(indices, now, before, strict=True) if a != b]
            raise StateModifiedWhileStaging(moved, storage=moved)


def torn_since(tensors: dict[str, torch.Tensor], before: Marks) -> StateModifiedWhileStaging | None:
    """The error naming the tensors written in place or whose storage moved since
    ``before = Marks.of(tensors)``; None if none did."""
    now = Marks.of(tensors)
    if now == before:
        return None
    changed = set()
    if now.versions != before.versions:
        changed = {
            k for k, a, b in zip(tensors, now.versions, before.versions, strict=True) if a != b
        }
    moved = [k for k, a, b in zip(tensors, now.pointers, before.pointers, strict=True) if a != b]
    changed.update(moved)
    return StateModifiedWhileStaging([k for k in tensors if k in changed], storage=moved)


def copy_checked(
    slot: StagingSlot,
    tensors: dict[str, torch.Tensor],
    before: Marks,
    guard: bool,
    any_cuda: bool,
    ready: dict[int, Any] | None = None,
    skip: frozenset[int] = frozenset(),
) -> StateModifiedWhileStaging | None:
    """``slot.copy_in``, where a torn state that stops the copy is returned, not raised.

    ``guard``: other code of the program ran since ``save`` was called (an overlapped save, a
    wait for a slot), so no storage is read before its pointer is checked. A storage swapped
    while the copy runs can make torch or NumPy refuse it (a size mismatch): that is reported
    as the torn state it is. The caller still checks ``torn_since`` once the copy is over.
    """
    try:
        slot.copy_in(
            tensors, any_cuda=any_cuda, ready=ready, marks=before if guard else None, skip=skip
        )
    except StateModifiedWhileStaging as e:
        return e
    except Exception as e:
        torn = torn_since(tensors, before)
        if torn is None:
            raise
        torn.__cause__ = e  # what torch or NumPy said, for the traceback
        return torn
    return None


_IS_CUDA = operator.attrgetter("is_cuda")


def any_cuda(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``tensors`` is on a GPU. No pass over them where this process never
    initialised CUDA: no tensor can be on a GPU then (torch initialises CUDA before it makes
    one, also from DLPack or another process), and the pass is ~2 ms of a 20,000-tensor stall."""
    if not torch.cuda.is_initialized():
        return False
    return any(map(_IS_CUDA, tensors))


def ready_events(tensors: dict[str, torch.Tensor]) -> dict[int, Any]:
    """One CUDA event per device of ``tensors``, recorded on this thread's current stream.

    An overlapped save copies on another thread: its side stream waits on these events, so it
    copies the values queued before ``save`` was called and no later ones.
    """
    events = {}
    for dev in {t.device.index or 0 for t in tensors.values() if t.is_cuda}:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        events[dev] = ev
    return events

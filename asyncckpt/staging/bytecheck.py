"""The torn-state check from the bytes, for overlapped saves: after the copy, every CPU
tensor's bytes are compared with what its staging view holds; for saves staged in chunks,
with fingerprints of what was staged (``ChunkFingerprints``, below).

Why: the training loop runs while an overlapped save copies, and the torn-state check of
version counters and data pointers (staging.torn_since) cannot see writes that move no
counter: through ``.data`` (``p.data.copy_(w)``, the weight syncs of RL trainers), NumPy views
(``t.numpy()[:] = ...``) or a tensor made under ``torch.inference_mode``. Such a write that
lands during the copy on a tensor already copied would leave the checkpoint with that tensor
from before and the rest from after (invariant 13); one on a tensor not yet copied is seen by
this compare only if it lands after that tensor's copy.

What it proves: every tensor compared held, when compared, the bytes its view holds, so
(unless a tensor changed and changed back) each was constant from its copy to its compare,
and the compares start after the last copy: the staged bytes are the state at one instant,
the end of the copy. It is exact (bytes, not a fingerprint).

Not covered: tensors on a GPU (their copy is queued on a stream: the counters still apply),
and a blocking save that is not chunked (the caller's thread is inside ``save``; only another
thread can write, during a copy that does not wait for the worker).
Cost: one more read of the sources and of the staged bytes, in the background
(``SaveStats.copy_check_seconds``). Large tensors are compared in place in pieces on the copy
threads (NumPy lets go of the GIL); the small ones (thousands, in a model's norms and biases)
are first packed, sources and staged views alike, by two ``torch._foreach_copy_`` calls into
two scratch buffers kept per slot layout (twice their bytes, up to ``PACK_MAX_BYTES``; beyond
it the rest are compared one by one, ~40 us each, and a log line says so once), then compared
whole. Under ``Staging(max_host_bytes=)`` nothing is packed (the scratch would sit outside the
budget): every small tensor is compared one by one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncckpt._torch import foreach_copy_
from asyncckpt.staging.arenas import (
    Marks,
    StagingSlot,
    _as_bytes,
    _bytes_of_view,
    _pool,
    cpu_copy_threads,
    read_only_bytes,
)
from asyncckpt.staging.fingerprints import fingerprint_bytes

log = logging.getLogger("asyncckpt")

#: Bytes compared per piece: a large tensor is split so that the copy threads share it, and
#: each compare's temporary (a bool per byte) stays this small.
PIECE = 4 << 20
#: The most bytes of small tensors packed per slot layout (two buffers of this many at most).
PACK_MAX_BYTES = 256 << 20
_ALIGN = 64

_said_unpacked = False


def changed_since_copied(
    slot: StagingSlot, tensors: dict[str, torch.Tensor], marks: Marks | None = None
) -> list[str]:
    """The keys of the CPU tensors whose bytes differ from what ``slot``'s views hold now
    (``slot`` was just staged from ``tensors``; a tensor whose copy was skipped, its view
    holding its bytes already, is compared the same way). ``marks``: as the copy does, no
    source is read before its storage is found where it was when ``save`` was called
    (``StateModifiedWhileStaging`` if one was freed or replaced: never read through a
    dangling pointer; the loop must still not free one until ``handle.staged()``)."""
    keys = list(tensors)
    srcs = list(tensors.values())
    small = set(slot.small)
    pieces: list[tuple[int, Any, Any]] = []  # (index, source bytes, staged bytes)
    one_by_one: list[int] = []
    for i, spec in enumerate(slot.specs):
        if spec.nbytes == 0 or i in small or srcs[i].is_cuda:
            continue
        one_by_one.append(i)
    small_cpu = [i for i in slot.small if not srcs[i].is_cuda]
    if marks is not None:
        marks.check_pointers(tensors, srcs, one_by_one + small_cpu)
    packed = _packed(slot, small_cpu)
    if packed is not None:
        pieces.extend(packed.pieces(srcs, slot))
        one_by_one.extend(packed.left)
    for i in one_by_one:
        src, dst = _source_bytes(srcs[i]), _staged_bytes(slot, i)
        if src.nbytes != dst.nbytes:
            pieces.append((i, None, None))  # (resized under the copy: the pointers said so)
            continue
        for at in range(0, src.nbytes, PIECE):
            pieces.append((i, src[at : at + PIECE], dst[at : at + PIECE]))
    threads = cpu_copy_threads()
    if threads > 1 and len(pieces) > 1:
        same = list(_pool(threads).map(_same, pieces))
    else:
        same = [_same(p) for p in pieces]
    changed: set[int] = set()
    for (i, src, dst), ok in zip(pieces, same, strict=True):
        if ok:
            continue
        if i >= 0 or packed is None:
            changed.add(i)
        else:  # a packed piece: which of its tensors
            changed.update(packed.which(-1 - i, src, dst))
    return [keys[i] for i in sorted(changed)]


@dataclass
class _Packed:
    """The small tensors of one slot layout packed end to end, twice: the sources'
    bytes and the staged views' bytes (``pieces``); ``left``: those beyond the cap."""

    key: Any
    order: list[int]
    offsets: list[int]
    src_views: list[torch.Tensor]
    dst_views: list[torch.Tensor]
    src_buf: torch.Tensor
    dst_buf: torch.Tensor
    left: list[int]

    def pieces(self, srcs: list[torch.Tensor], slot: StagingSlot) -> list[tuple[int, Any, Any]]:
        if not self.order:
            return []
        with torch.no_grad():
            foreach_copy_(self.src_views, [srcs[i] for i in self.order])
            foreach_copy_(self.dst_views, [slot.views[i] for i in self.order])
        a, b = self.src_buf.numpy(), self.dst_buf.numpy()
        # Index -1 - at: a packed piece starting at byte ``at`` (``which`` says whose).
        return [(-1 - at, a[at : at + PIECE], b[at : at + PIECE]) for at in range(0, a.size, PIECE)]

    def which(self, start: int, src: Any, dst: Any) -> list[int]:
        """The tensors whose bytes differ within the packed piece at byte ``start`` (the rare
        path)."""
        out = []
        for i, off, view in zip(self.order, self.offsets, self.src_views, strict=True):
            n = view.numel() * view.element_size()
            lo, hi = max(off, start), min(off + n, start + src.size)
            if lo < hi and not np.array_equal(
                src[lo - start : hi - start], dst[lo - start : hi - start]
            ):
                out.append(i)
        return out


def _packed(slot: StagingSlot, indices: list[int]) -> _Packed | None:
    """The packing of ``indices`` (small CPU tensors) for ``slot``'s layout, kept on the slot
    (made again when the layout or which tensors are on the CPU changes)."""
    global _said_unpacked
    if not indices:
        return None
    limit = PACK_MAX_BYTES if slot.pack_check else 0  # (not under a staging budget)
    key = (slot.arena_ids and tuple(slot.arena_ids), tuple(indices))
    kept = slot.byte_check
    if kept is not None and kept.key == key:
        return kept
    order, offsets, at = [], [], 0
    left = []
    for i in indices:
        n = slot.specs[i].nbytes
        if at + n > limit:
            left.append(i)
            continue
        order.append(i)
        offsets.append(at)
        at += -(-n // _ALIGN) * _ALIGN  # each view at an offset its dtype can start at
    if left and not _said_unpacked:
        _said_unpacked = True
        log.info(
            "the byte check of overlapped saves compares %d small tensors one by one (beyond "
            "the %d bytes of them it packs%s)",
            len(left),
            limit,
            "" if slot.pack_check else ": none under Staging(max_host_bytes=)",
        )
    # Zeroed: the padding between views is compared too, and never written.
    src_buf = torch.zeros(at, dtype=torch.uint8)
    dst_buf = torch.zeros(at, dtype=torch.uint8)

    def views(buf: torch.Tensor) -> list[torch.Tensor]:
        return [
            buf[o : o + slot.specs[i].nbytes].view(slot.specs[i].dtype).view(slot.specs[i].shape)
            for i, o in zip(order, offsets, strict=True)
        ]

    packed = _Packed(key, order, offsets, views(src_buf), views(dst_buf), src_buf, dst_buf, left)
    slot.byte_check = packed  # (dropped with the slot's layout: StagingSlot.release)
    return packed


def _same(piece: tuple[int, Any, Any]) -> bool:
    _, src, dst = piece
    return src is not None and bool(np.array_equal(src, dst))


def _source_bytes(t: torch.Tensor) -> Any:
    src = _as_bytes(t)
    if src is None:  # strided, conjugate, negative: as the copy resolved it
        src = read_only_bytes(t.detach().resolve_conj().resolve_neg().contiguous())
    return src


def _staged_bytes(slot: StagingSlot, i: int) -> Any:
    if i in slot.dst_bytes:
        return slot.dst_bytes[i]
    return _bytes_of_view(slot.views[i])


# ------------------------------------------------------------------ chunked saves
# A save staged in chunks (``Staging(max_host_bytes=)``, chunked.py) cannot compare as above:
# a chunk's buffer is refilled once the worker has written it, and the budget leaves no room
# for a second copy of the state. So each CPU tensor's staged bytes are fingerprinted
# (xxh3-128, in blocks of whole rows) in the chunk buffer after their copy, while the worker
# writes that chunk (both only read it), and once the last chunk is copied, before it is
# released to the worker, every source is fingerprinted again and compared. Equal digests
# (the same bytes, unless a tensor changed and changed back, or a 128-bit hash collided)
# prove that the bytes written are the state at one instant, the end of the copy, as for
# overlapped saves; a tensor that differs fails the save as torn, and the worker commits
# nothing. Cost: one read of the staged bytes, mostly while the trainer would wait for the
# worker's writes anyway, and one more read of the sources at the end
# (``SaveStats.copy_check_seconds``), on the copy threads; memory: 16 bytes per MiB of state.
# GPU tensors are not read again (the counters still apply), as above.

#: Bytes per fingerprint block of a chunked save (whole rows of its tensor, at least one): a
#: strided source's block, made contiguous to be hashed, stays this small.
BLOCK = 1 << 20
#: Bytes of blocks per task handed to the copy threads.
_TASK = 32 << 20


@dataclass
class _StagedPiece:
    index: int  # the tensor's position in the state
    start: int  # the piece's bytes within the tensor: [start, stop)
    stop: int
    row: int  # bytes of one row along dim 0 (a block is whole rows)
    digests: list[bytes]


def _blocks(start: int, stop: int, row: int) -> list[tuple[int, int]]:
    """Byte ranges, relative to ``start``, of the blocks of a piece (whole rows each)."""
    step = max(1, BLOCK // row) * row if row > 0 else BLOCK
    return [(a, min(a + step, stop - start)) for a in range(0, stop - start, step)]


class ChunkFingerprints:
    """The digests of what a chunked save staged (``staged`` per piece, then ``take`` once
    per chunk), compared with the sources by ``changed`` at the end."""

    def __init__(self) -> None:
        self.pieces: list[_StagedPiece] = []
        self._todo: list[Any] = []  # staged bytes, per block not yet hashed
        self._owners: list[_StagedPiece] = []  # whose digest each block of _todo gives
        self.seconds = 0.0  # the final compare's

    def staged(self, index: int, start: int, stop: int, row: int, dst: Any) -> None:
        """Bytes ``[start, stop)`` of tensor ``index`` are staged in ``dst`` (a flat uint8
        array over the chunk buffer), to be fingerprinted at the next ``take``."""
        piece = _StagedPiece(index, start, stop, row, [])
        self.pieces.append(piece)
        for a, b in _blocks(start, stop, row):
            self._todo.append(dst[a:b])
            self._owners.append(piece)

    def take(self) -> None:
        """Fingerprint what was staged since the last call (the copy threads share it)."""
        todo, owners = self._todo, self._owners
        self._todo, self._owners = [], []
        for owner, digest in zip(owners, _run(fingerprint_bytes, todo), strict=True):
            owner.digests.append(digest)

    def changed(
        self, tensors: dict[str, torch.Tensor], srcs: list[torch.Tensor], marks: Marks
    ) -> list[str]:
        """The keys of the tensors whose bytes now differ from what was staged of them (in
        state order). A storage that moved since ``save`` was called is never read
        (``StateModifiedWhileStaging``, raised)."""
        t0 = time.perf_counter()
        marks.check_pointers(tensors, srcs, sorted({p.index for p in self.pieces}))
        todo: list[Any] = []
        owners: list[_StagedPiece] = []
        for p in self.pieces:
            t = srcs[p.index].detach()
            flat = _as_bytes(t)
            for a, b in _blocks(p.start, p.stop, p.row):
                if flat is not None:
                    todo.append(flat[p.start + a : p.start + b])
                else:  # strided, conjugate: its rows, made contiguous on a copy thread
                    todo.append((t, (p.start + a) // p.row, (p.start + b) // p.row))
                owners.append(p)
        now = _run(_source_digest, todo)
        changed: set[int] = set()
        at: dict[int, int] = {}  # piece id -> blocks of it compared so far
        for p, digest in zip(owners, now, strict=True):
            k = at.get(id(p), 0)
            at[id(p)] = k + 1
            if digest != p.digests[k]:
                changed.add(p.index)
        self.seconds += time.perf_counter() - t0
        keys = list(tensors)
        return [keys[i] for i in sorted(changed)]


def _run(fn: Any, items: list[Any]) -> list[bytes]:
    """``[fn(x) for x in items]``, in tasks of about ``_TASK`` bytes on the copy threads."""
    threads = cpu_copy_threads()
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    per = max(1, _TASK // BLOCK)
    groups = [items[i : i + per] for i in range(0, len(items), per)]
    out: list[bytes] = []
    for done in _pool(threads).map(lambda g: [fn(x) for x in g], groups):
        out.extend(done)
    return out


def _source_digest(block: Any) -> bytes:
    if isinstance(block, tuple):  # (tensor, first row, end row): a strided source
        t, r0, r1 = block
        rows = t if t.dim() == 0 else t[r0:r1]
        block = read_only_bytes(rows.resolve_conj().resolve_neg().contiguous())
    return fingerprint_bytes(block)

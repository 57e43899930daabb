"""A load straight from a surviving worker's memory, no file read (hot_resume.py's step offered
before it was written: hot_serve.offer_staged).

The offer says what the step holds: each tensor's dtype, shape and CRC-32C (computed by the
worker from the staged memory), the objects (``torch.save`` bytes, as DCP stores them) and the
paths that rebuild the nested state from the flat keys. The target is compared with that
first (``StateMismatch``: the disk's copy would not fit either) and the objects unpickled;
then each tensor is copied into its host target and checksummed as it lands, chunk by chunk
(one pass over the memory, not a check and then a copy: a third less memory traffic); a device
target's bytes are checked in the memory before any copy. The objects go in last, once every
tensor matched. A checksum that does not match declines (``HotSpoiled``: host targets may hold
part of it), and the caller must then restore the whole target from the disk or fail
(invariant 11: never a target left half-written by a load that returns). Anything short of an
exact fit (keys the target does not ask for, a part of the step) declines before anything is
copied (``HotDeclined``): the disk path reads it once committed.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncckpt.core.entries import Entries, walk
from asyncckpt.core.tree import is_stateful, merge_into, target_tensors, unflatten
from asyncckpt.formats.hotread import HotDeclined, _frombuffer, copy_bytes, fits_in_place
from asyncckpt.formats.loadcheck import LoadReport, compare
from asyncckpt.memory.hot_serve import Offer, tensor_crcs
from asyncckpt.staging.arenas import read_only_bytes
from asyncckpt.storage.manifest import _POLYNOMIALS, checksum, crc_combine

#: Threads that checksum and copy (both release the GIL).
THREADS = 4
CRC32C = _POLYNOMIALS["crc32c"]


def entries(offer: Offer) -> Entries:
    """What the offered step holds, as a checkpoint's metadata would say."""
    assert offer.staged is not None
    out = Entries()
    for fqn, (dtype, shape, _) in offer.staged.items():
        out.leaves[fqn] = (tuple(shape), dtype)
    for fqn in offer.objects or {}:
        out.leaves[fqn] = None
    return out


def load_offered(
    state: Any, offer: Offer, memory: Mapping[str, memoryview], strict: bool
) -> LoadReport:
    """Restore the offered step into ``state`` from ``memory`` (DCP key -> mapped bytes)."""
    assert offer.staged is not None
    report = compare(walk(state), entries(offer), strict=strict, where=f"step {offer.step}")
    if report.missing or report.unexpected or report.other_ranks:
        raise HotDeclined("the target asks for a part of the step: read from the disk")
    views = {fqn: memory[fqn] for fqn in offer.staged}
    want = {fqn: crc for fqn, (_, _, crc) in offer.staged.items()}
    flat: dict[str, Any] = {
        k: torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)
        for k, b in (offer.objects or {}).items()
    }  # (DCP's read of an object; unpickled before anything goes in)
    targets = target_tensors(state)
    host: dict[str, torch.Tensor] = {}
    device: dict[str, torch.Tensor] = {}
    for fqn, (dtype, shape, _) in offer.staged.items():
        t = targets.get(fqn)
        if t is None or not fits_in_place(t, dtype, shape):
            t = torch.empty(shape, dtype=dtype)  # merged in below (merge_into), as from disk
        (host if t.device.type == "cpu" else device)[fqn] = t
        flat[fqn] = t
    # A device target's bytes are checked in the memory before any copy; a host target's as
    # they land in it (one pass over the memory, not two).
    _declined(want, tensor_crcs({k: views[k] for k in device}, THREADS))
    try:
        _declined(want, copy_checked({k: (host[k], views[k]) for k in host}))
    except HotDeclined as e:
        raise HotSpoiled(str(e)) from None
    _copy_all([(device[k], views[k]) for k in device])
    loaded = unflatten(flat, offer.paths or {})
    if is_stateful(state):
        state.load_state_dict(loaded)
    else:
        merge_into(state, loaded)
    return report


def _declined(want: Mapping[str, int], found: Mapping[str, int]) -> None:
    bad = sorted(k for k, crc in found.items() if want[k] != crc)
    if bad:
        raise HotDeclined(f"the memory did not match the checksums offered: {bad[:3]}")


class HotSpoiled(HotDeclined):
    """Declined after part of the memory went into host targets: only a load from disk that
    restores the whole target may follow (hot_resume.py ``spoiled``)."""


#: The copy and its checksum go this many bytes at a time (in the cache between the two) ...
CHUNK = 1 << 20
#: ... in parts of a tensor this large, one part per thread (their checksums combined).
PART = 32 << 20


def copy_checked(copies: Mapping[str, tuple[torch.Tensor, memoryview]]) -> dict[str, int]:
    """Copy each memory into its host tensor, chunk by chunk, and return the CRC-32C of what
    landed in each (computed on the chunk just copied, still in the cache)."""
    parts = [
        (fqn, at, min(PART, len(src) - at))
        for fqn, (_, src) in copies.items()
        for at in range(0, max(len(src), 1), PART)
    ]

    def one(part: tuple[str, int, int]) -> int:
        fqn, at, n = part
        dst, src = copies[fqn]
        if not n:
            return 0
        # (read through the pointer: dst.numpy() would leave the caller's tensor non-resizable)
        flat = memoryview(read_only_bytes(dst.detach()))
        to, frm = dst.data_ptr(), _frombuffer(src).data_ptr()
        crc = 0
        for i in range(at, at + n, CHUNK):
            j = min(i + CHUNK, at + n)
            ctypes.memmove(to + i, frm + i, j - i)  # (a foreign call: the GIL is released)
            crc = checksum(flat[i:j], crc)
        return crc

    parts.sort(key=lambda p: -p[2])  # largest first: the threads end together
    with ThreadPoolExecutor(THREADS, thread_name_prefix="asyncckpt-hot") as pool:
        crcs = dict(zip(parts, pool.map(one, parts), strict=True))
    out: dict[str, int] = {}
    for fqn, at, n in sorted(parts, key=lambda p: (p[0], p[1])):
        out[fqn] = (
            crcs[(fqn, at, n)] if at == 0 else crc_combine(out[fqn], crcs[(fqn, at, n)], n, CRC32C)
        )
    return out


def _copy_all(copies: list[tuple[torch.Tensor, memoryview]]) -> None:
    """Device copies (through reused pinned buffers), largest first, by a few threads."""
    copies.sort(key=lambda c: -len(c[1]))
    with ThreadPoolExecutor(THREADS, thread_name_prefix="asyncckpt-hot") as pool:
        list(pool.map(lambda c: copy_bytes(*c), copies))

"""A load straight from a surviving worker's memory, no file read (hot.py's step offered before
it was written: hot_serve.offer_staged).

The offer says what the step holds: each tensor's dtype, shape and CRC-32C (computed by the
worker from the staged memory), the objects (``torch.save`` bytes, as DCP stores them) and the
paths that rebuild the nested state from the flat keys. The target is compared with that
first (``StateMismatch``: the disk's copy would not fit either), every tensor's bytes are
checksummed in the mapped memory, the objects unpickled, and only then is anything copied into
the target (invariant 11). Anything short of an exact fit (keys the target does not ask for,
a part of the step) declines (``HotDeclined``): the disk path reads it once committed.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .entries import Entries, walk
from .formats.hotread import HotDeclined, as_tensor, copy_bytes
from .hot_serve import Offer, tensor_crcs
from .loadcheck import LoadReport, compare
from .staging import is_stateful

#: Threads that checksum and copy (both release the GIL).
THREADS = 4


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
    from .formats.dcp import merge_into, target_tensors, unflatten

    assert offer.staged is not None
    report = compare(walk(state), entries(offer), strict=strict, where=f"step {offer.step}")
    if report.missing or report.unexpected or report.other_ranks:
        raise HotDeclined("the target asks for a part of the step: read from the disk")
    views = {fqn: memory[fqn] for fqn in offer.staged}
    found = tensor_crcs(views, THREADS)
    bad = sorted(k for k, (_, _, crc) in offer.staged.items() if found[k] != crc)
    if bad:
        raise HotDeclined(f"the memory did not match the checksums offered: {bad[:3]}")
    flat: dict[str, Any] = {
        k: torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)
        for k, b in (offer.objects or {}).items()
    }  # (DCP's read of an object; unpickled before anything goes in)
    targets = target_tensors(state)
    copies: list[tuple[torch.Tensor, memoryview]] = []
    for fqn, (dtype, shape, _) in offer.staged.items():
        t = targets.get(fqn)
        if t is not None and _fits(t, dtype, shape):
            copies.append((t, views[fqn]))
            flat[fqn] = t
        else:  # merged in below (merge_into), as the disk path does
            flat[fqn] = as_tensor(views[fqn], dtype, shape).clone()
    _copy_all(copies)
    loaded = unflatten(flat, offer.paths or {})
    if is_stateful(state):
        state.load_state_dict(loaded)
    else:
        merge_into(state, loaded)
    return report


def _fits(t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return (
        t.dtype == dtype
        and tuple(t.shape) == tuple(shape)
        and t.is_contiguous()
        and t.device.type != "meta"
        and not (t.is_conj() or t.is_neg())
    )


def _copy_all(copies: list[tuple[torch.Tensor, memoryview]]) -> None:
    """The copies, largest first, by a few threads."""
    copies.sort(key=lambda c: -len(c[1]))
    if len(copies) < 2:
        for dst, src in copies:
            copy_bytes(dst, src)
        return
    with ThreadPoolExecutor(THREADS, thread_name_prefix="asyncckpt-hot") as pool:
        list(pool.map(lambda c: copy_bytes(*c), copies))

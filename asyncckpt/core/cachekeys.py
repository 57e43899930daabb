"""Every cache of a plan, layout or template, and the key it is kept under: in one place.

A save reuses work from earlier saves of the same layout: that is where the speed at many
tensors comes from. A reused piece is only correct while everything it was made from still
holds, so each cache below is keyed by (or checked against) *everything* its content depends
on. A key that leaves something out writes the old layout under the new one and nothing
notices (a plan cache keyed by less than the state's dtypes once wrote the old dtype into
``.metadata``, and ``verify`` said ok). When a cached thing starts to depend on something
new, add it to its key here.

The caches, what each holds, and what its key covers:

- staging arenas (``staging.StagingSlot``, trainer): where each tensor sits in shared
  memory. ``arena_key``: every tensor's name, dtype and shape, in order.
- the flatten plan (``flatplan.FlattenPlan``, trainer): where every leaf sits in the state.
  Not keyed: ``replay`` checks the recorded structure against the state at every save
  (container types, lengths and keys, leaf types, dtypes and shapes).
- DCP's save plans and ``.metadata`` (``formats.dcp.write_flat``, worker): DCP's own plan
  caching, whose own check of "unchanged" ignores dtypes. ``dcp_plan_signature``: every
  key with what DCP's plan and metadata record of it (its object path in the nested state,
  ``planner_data``; dtype, shape, requires_grad, layout, pinning; a shard's global shape and
  chunks; a byte leaf); ``DcpPlanKeys`` turns it into
  DCP's cache key, together with the planner, the name of what is written and, across
  ranks, every rank's signature digest and process (any rank's change re-plans on every
  rank; a restarted worker anywhere has no cached plans).
- ``torch.save`` record templates (``formats.records.RecordWriter``, worker):
  ``record_template_key``: dtype, shape, torch's CRC setting and its storage alignment.
- ``.metadata`` read back (``formats.dcp.read_dcp_metadata``): ``metadata_file_key``: the
  file's path, inode, modification time and size (committed checkpoints never change in
  place; a replaced one has another inode or time).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from asyncckpt.core.shards import LocalShard


def arena_key(tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Two states with the same key share staging arenas (their byte layout is the same)."""
    return tuple((k, t.dtype, tuple(t.shape)) for k, t in tensors.items())


def same_key(a: tuple | None, b: tuple | None) -> bool:
    """``a == b``, at once where both are the one key object a replayed flatten plan hands
    out at every save (``==`` on two 20,000-entry keys walks them both, ~1 ms a compare)."""
    return a is b or a == b


def dcp_plan_signature(
    flat: Mapping[str, Any], byte_leaf: type, object_paths: Mapping[str, tuple] | None = None
) -> tuple | None:
    """Everything DCP's local save plan and its ``.metadata`` entry of a flat state depend on,
    per key; None where a leaf is of a kind not described here (then nothing is cached).

    ``byte_leaf``: the type of the pre-serialised leaves (written as bytes).
    ``object_paths``: each key's path in the nested state, the plan's ``planner_data``
    (``{"a": {"0": t}}`` and ``{"a": [t]}`` have the same keys and tensors, not the same paths).
    """
    paths = object_paths or {}
    sig: list[tuple[Any, ...]] = []
    for k, v in flat.items():
        kind = type(v)
        path = paths.get(k)
        if kind is torch.Tensor:
            sig.append((k, path, v.dtype, v.shape, v.requires_grad, v.layout, v.is_pinned()))
        elif kind is LocalShard:
            pieces = tuple(
                (tuple(off), p.dtype, p.shape, p.requires_grad, p.layout, p.is_pinned())
                for p, off in zip(v._pieces, v._offsets, strict=True)
            )
            sig.append((k, path, LocalShard, v.dtype, v.shape, pieces))
        elif isinstance(v, byte_leaf):
            sig.append((k, path, byte_leaf))
        else:
            return None
    return tuple(sig)


def signature_digest(signature: tuple) -> str:
    """A digest of a plan signature, for telling other ranks (the signature itself is large)."""
    return hashlib.blake2b(repr(signature).encode(), digest_size=16).hexdigest()


class DcpPlanKeys:
    """DCP's plan-cache key for each name written again and again, one live key per name.

    A new signature under a name gets a new key, and the old key's plans are dropped from
    DCP's caches: a layout that comes back must be planned afresh, because across ranks the
    coordinator holds only every rank's *latest* plan.
    """

    def __init__(self) -> None:
        self._live: dict[str, tuple[tuple, str]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def key(self, name: str, signature: tuple, caches: list[dict]) -> str:
        with self._lock:
            live = self._live.get(name)
            if live is not None and live[0] == signature:
                return live[1]
            if live is not None:
                for cache in caches:
                    cache.pop(live[1], None)
            self._count += 1
            key = f"{name}#{self._count}"
            self._live[name] = (signature, key)
            return key


def record_template_key(dtype: torch.dtype, shape: tuple[int, ...], with_crc: bool) -> tuple:
    """What a ``torch.save`` record's bytes depend on, besides the tensor's data."""
    from torch.utils.serialization import config

    return (dtype, shape, with_crc, config.save.storage_alignment)


def metadata_file_key(path: str | os.PathLike) -> tuple:
    """A committed ``.metadata`` file, as read: path, inode, modification time, size."""
    st = os.stat(path)
    return (os.path.realpath(path), st.st_ino, st.st_mtime_ns, st.st_size)

"""Plain torch.distributed.checkpoint: ``.metadata`` plus ``.distcp`` shards.

The worker writes a *flat* state dict whose keys are the same fully-qualified names DCP would
produce from the nested state, so ``dcp.load(nested_state, checkpoint_id=dir)`` works without
asyncckpt. Our writer is DCP's ``FileSystemWriter`` with one change: every byte goes through a
stream that computes its checksum (CRC-32C) on the way (no read-back for the manifest) and honours the
throttle's rate limit and the ``mid_shard_write`` fault point.

This module is the format (``DCPFormat``); its parts, one job each:

- ``planner``: DCP's save planning for flat states, plan caching across saves and ranks.
- ``writer``: the checksumming, paced storage writer; ``write_flat``.
- ``metadata``: ``.metadata`` read once and cached (``read_dcp_metadata``).
- ``reader``: the storage reader that places records straight into the targets;
  ``read_flat``, ``load_flat``, ``load_into``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from asyncckpt.core import layout as L
from asyncckpt.core.entries import Entries, has_sharded_base
from asyncckpt.core.shards import (
    LocalShard,
    ShardInfo,
    dtensor_shard_info,
    is_dtensor,
    is_dtensor_type,
)
from asyncckpt.core.tree import flatten_state, merge_into, target_tensors, unflatten
from asyncckpt.formats.base import (
    Crcs,
    Format,
    LoadOptions,
    Paths,
    Prepared,
    SaveOptions,
    WriteOptions,
)
from asyncckpt.staging.arenas import serialize_objects

if TYPE_CHECKING:
    from asyncckpt.formats.dcp.metadata import _METADATA_CACHE, read_dcp_metadata
    from asyncckpt.formats.dcp.planner import Serialized, _PassThroughPlanner, dcp_object_paths
    from asyncckpt.formats.dcp.reader import (
        CachedMetadataReader,
        load_flat,
        load_into,
        read_flat,
    )
    from asyncckpt.formats.dcp.writer import PIECE_BYTES, ChecksumWriter, _result, write_flat

#: The parts that import ``torch.distributed.checkpoint`` (about a second: it brings DTensor's
#: op tables), imported when first asked for. A trainer that resumes from memory and leaves
#: every write to its worker never pays for them.
_LAZY = {
    "metadata": ("_METADATA_CACHE", "read_dcp_metadata"),
    "planner": ("Serialized", "_PassThroughPlanner", "dcp_object_paths"),
    "reader": ("CachedMetadataReader", "load_flat", "load_into", "read_flat"),
    "writer": ("PIECE_BYTES", "ChecksumWriter", "_result", "write_flat"),
}
_LAZY_FROM = {name: part for part, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    part = _LAZY_FROM.get(name)
    if part is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{part}"), name)
    globals()[name] = value  # asked once
    return value


#: What the package's other modules, the tests and the benchmarks import from here.
__all__ = [
    "DCPFormat",
    "PIECE_BYTES",
    "CachedMetadataReader",
    "ChecksumWriter",
    "Serialized",
    "_METADATA_CACHE",
    "_PassThroughPlanner",
    "_result",
    "assemble",
    "dcp_entries",
    "dcp_object_paths",
    "load_flat",
    "load_into",
    "local_piece",
    "merge_into",
    "read_dcp_metadata",
    "read_flat",
    "target_tensors",
    "unflatten",
    "write_flat",
]


def local_piece(t: torch.Tensor, key: str, shards: dict, tensors: dict) -> None:
    """Stage ``t`` under ``key``: a DTensor as this rank's local piece (with where it sits in
    the global tensor, in ``shards``), any other tensor as it is."""
    if is_dtensor(t):
        shards[key] = (dtensor_shard_info(t), [key])
        tensors[key] = t.to_local()  # type: ignore[attr-defined]  # a DTensor (is_dtensor)
    else:
        tensors[key] = t


def assemble(views: Mapping[str, torch.Tensor], shards: Mapping[str, Any]) -> dict[str, Any]:
    """The staged views put back together: each sharded key's pieces as one ``LocalShard``."""
    flat: dict[str, Any] = {}
    grouped: set[str] = set()
    for key, (info, keys) in shards.items():
        flat[key] = LocalShard([views[k] for k in keys], info)
        grouped.update(keys)
    for k, v in views.items():
        if k not in grouped:
            flat[k] = v
    return flat


def dcp_entries(metadata: Any, *, objects_known: bool = True) -> Entries:
    """What a DCP checkpoint holds, from its ``Metadata`` (``FileSystemReader.read_metadata``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = Entries(objects_known=objects_known)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            out.leaves[fqn] = (tuple(md.size), md.properties.dtype)
        else:
            out.leaves[fqn] = None
    return out


class DCPFormat(Format):
    """Plain DCP: the state flattened to DCP keys, DTensors as their local pieces; loads at
    any world size (DCP reshards)."""

    name = "dcp"
    shared_by_ranks = True
    verifies_while_reading = True
    differential = True
    #: The files describing the checkpoint, read by the pre-load check.
    metadata_files = frozenset({L.DCP_METADATA})
    #: The DCP save planner's class (None: ``write_flat``'s default).
    planner: type | None = None

    def prepare(self, state: Any, options: SaveOptions) -> Prepared:
        cache = options.cache
        flat = cache.flatten(state) if cache is not None else flatten_state(state)
        tensors: dict[str, torch.Tensor] = flat.tensors
        shards: dict[str, tuple[ShardInfo, list[str]]] = {}
        key = flat.key
        if any(is_dtensor_type(t) for t in set(map(type, tensors.values()))):
            tensors, key = {}, None  # the local pieces are what is staged
            for fqn, t in flat.tensors.items():
                local_piece(t, fqn, shards, tensors)
        objects = serialize_objects(flat.objects)
        return Prepared(tensors, objects, flat.paths, {"shards": shards}, key=key)

    def write(self, part: Prepared, location: Path, options: WriteOptions) -> Crcs:
        from asyncckpt.formats.dcp.planner import Serialized, dcp_object_paths
        from asyncckpt.formats.dcp.writer import write_flat

        flat: dict[str, Any] = {k: Serialized(v) for k, v in part.objects.items()}
        flat.update(assemble(part.tensors, part.extra.get("shards", {})))
        return write_flat(
            flat,
            location,
            thread_count=options.thread_count,
            threads_used=options.threads_used,
            pace=options.pace,
            direct_io=options.direct_io,
            process_group=options.process_group,
            planner=None if self.planner is None else self.planner(),  # None: the default
            plan_cache=options.plan_cache,
            object_paths=dcp_object_paths(part.paths),
            differential=options.differential if self.differential else None,
        )

    def load_into(self, state: Any, location: Path, paths: Paths, options: LoadOptions) -> None:
        from asyncckpt.formats.dcp.reader import load_into

        load_into(state, location, paths, options.verify, options.target_only)

    def entries(self, state: Any, location: Path, options: LoadOptions) -> Entries | None:
        if not (location / L.DCP_METADATA).exists() or has_sharded_base(state):
            return None  # megatron's loader validates a sharded state dict itself
        from asyncckpt.formats.dcp.metadata import read_dcp_metadata

        return dcp_entries(read_dcp_metadata(location), objects_known=self.objects_known(location))

    def objects_known(self, location: Path) -> bool:
        """Whether ``.metadata`` lists the non-tensor leaves too."""
        return True

    def read_by_check(self, path: Path, location: Path) -> bool:
        return path.name in self.metadata_files and path.parent == location

    def read(self, location: Path, paths: Paths) -> dict[str, Any]:
        from asyncckpt.formats.dcp.metadata import paths_from_dcp, read_dcp_metadata
        from asyncckpt.formats.dcp.reader import read_flat

        flat = read_flat(location)
        if paths is None:
            paths = paths_from_dcp(read_dcp_metadata(location))
        return unflatten(flat, paths)

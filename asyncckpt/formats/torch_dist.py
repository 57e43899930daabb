"""Megatron ``torch_dist`` format: state -> ``metadata.json`` + ``common.pt`` + DCP shards.

What ``megatron.core.dist_checkpointing.save`` (megatron-core 0.16.1, backend ``torch_dist``)
puts in a checkpoint directory, and what its ``load`` needs back:

- ``metadata.json``: ``json.dump(asdict(CheckpointingConfig("torch_dist", 1)))``, i.e. exactly
  ``{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
  "common_backend_version": 1}`` (no newline). Written last: its presence is what
  ``check_is_distributed_checkpoint`` tests.
- ``common.pt``: ``torch.save`` of every leaf that is not a ``ShardedTensor``/``ShardedObject``,
  in the original nesting (megatron's ``extract_matching_values``: empty containers kept, lists
  compacted). Read back with ``torch.load(weights_only=True)``, so it must hold only types the
  weights-only unpickler accepts (plus whatever the reader registered as safe globals).
- DCP shards (``__<rank>_<n>.distcp``) and ``.metadata`` (a pickled DCP ``Metadata`` with
  ``planner_data=None``). DCP keys: ``ShardedTensor.key`` for tensors, with one chunk per
  main-replica shard at its ``global_offset``; ``ShardedObject.unique_key``
  (``<key>/shard_<offset>_<shape>``, e.g. ``rng_state/shard_0_1``) for objects, stored as a
  bytes item holding ``torch.save([obj.data, ...])`` (a *list*: megatron's loader unpacks it).
  File names do not matter to the loader; only ``.metadata``'s storage index does.

Plain state dicts (no megatron types) use one convention: a tensor at nested path ``a.b``
(dict keys and list indices joined by ``.``) becomes the whole, unsharded tensor with DCP key
``"a.b"`` -- byte for byte what megatron writes for ``ShardedTensor.from_rank_offsets("a.b", t)``
-- and every other leaf goes to ``common.pt``. So ``dist_checkpointing.load`` restores it from a
sharded state dict built with ``from_rank_offsets(path, tensor)`` at each tensor's place. A state
that holds any megatron ``ShardedBase`` is treated exactly as megatron does instead: only
``ShardedTensor``/``ShardedObject`` go to DCP, plain tensors go to ``common.pt``.

The trainer (``TorchDistFormat.prepare``) stages this rank's chunks and pickles the common
state; the worker (``write``) writes them. Multi-rank saves, one ``write`` per rank with the
same ``process_group`` (the workers' side group, never the trainer's):

- DCP plans collectively over the group (gather local plans to rank 0, scatter the global plan
  back), each rank writes only its own chunks to ``__<plan index>_<n>.distcp``, then rank 0
  gathers the write results and alone writes ``.metadata`` (so ``.metadata`` implies all
  shards landed);
- replicated chunks: identical plain tensors on several ranks are deduplicated by DCP's
  global plan;
- ``common.pt`` and ``metadata.json`` come from rank 0 of the group only (megatron assumes the
  common state is identical on all ranks); ``metadata.json`` after ``.metadata``;
- the commit (fsync of the directory, rename) waits for every rank's write to return.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, SavePlan

from asyncckpt.core import layout as L
from asyncckpt.core.shards import ShardInfo
from asyncckpt.core.tree import merge_into
from asyncckpt.formats.base import (
    Crcs,
    LoadOptions,
    Paths,
    Prepared,
    SaveOptions,
    Verify,
    WriteOptions,
)
from asyncckpt.formats.dcp import (
    DCPFormat,
    _PassThroughPlanner,
    load_flat,
    local_piece,
    read_dcp_metadata,
)
from asyncckpt.formats.precheck import check_files
from asyncckpt.formats.staged import materialize
from asyncckpt.staging.arenas import serialize_objects
from asyncckpt.storage.commit import write_synced

#: What megatron's ``save_config`` writes for ``torch_dist``; key order matters for the bytes.
CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}

#: DCP key -> this rank's pieces under that key: one plain tensor, or megatron ShardedTensors
#: (several when a rank holds several chunks of one global tensor) or ShardedObjects.
Sharded = dict[str, list[Any]]


def _mcore_mapping() -> Any:
    """megatron's mapping module if it is already imported, else None.

    A megatron object cannot exist in a process that has not imported megatron, so checking
    ``sys.modules`` is enough and keeps plain saves free of megatron's slow, noisy import.
    """
    return sys.modules.get("megatron.core.dist_checkpointing.mapping")


def _has_sharded_base(x: Any, base: type) -> bool:
    if isinstance(x, dict):
        return any(_has_sharded_base(v, base) for v in x.values())
    if isinstance(x, list):
        return any(_has_sharded_base(v, base) for v in x)
    return isinstance(x, base)


def _split_plain(
    x: dict | list, path: tuple, flat: Sharded, paths: dict | None
) -> tuple[bool, Any]:
    """Tensors into ``flat`` keyed by dotted path; returns (had tensors, the rest).

    ``path`` holds ("d", key) / ("l", index) items; with ``paths`` each tensor's typed path is
    recorded there too (the dotted key loses int dict keys, which an optimizer's state has).
    The rest mirrors megatron's ``dict_utils.extract_matching_values`` so ``common.pt`` is
    what megatron would write. A list that would come back misaligned from megatron's
    ``merge`` (tensors and non-tensors mixed) is refused up front.
    """
    if isinstance(x, dict):
        found, rest = False, {}
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                m, r = _split_plain(v, (*path, ("d", k)), flat, paths)
                found |= m
                if r or not v:
                    rest[k] = r
            elif isinstance(v, torch.Tensor):
                _add(flat, (*path, ("d", k)), v, paths)
                found = True
            else:
                rest[k] = v
        return found, rest
    n_match, rest_list = 0, []
    for i, v in enumerate(x):
        if isinstance(v, (dict, list)) and v:
            m, r = _split_plain(v, (*path, ("l", i)), flat, paths)
            n_match += m
            if r:
                rest_list.append(r)
        elif isinstance(v, torch.Tensor):
            _add(flat, (*path, ("l", i)), v, paths)
            n_match += 1
        else:
            rest_list.append(v)
    if n_match and rest_list and (n_match != len(x) or len(rest_list) != len(x)):
        raise ValueError(
            f"list at {_dotted(path) or '<root>'} mixes tensors and other values "
            "element-wise; megatron's loader cannot merge it back (use a dict instead)"
        )
    return n_match > 0, rest_list


def _dotted(path: tuple) -> str:
    return ".".join(str(k) for _, k in path)


def _add(flat: Sharded, path: tuple, t: torch.Tensor, paths: dict | None) -> None:
    key = _dotted(path)
    if key in flat:
        raise ValueError(f"two tensors map to the same checkpoint key {key!r}")
    flat[key] = [t]
    if paths is not None:
        paths[key] = [list(p) for p in path]


def split_common(state: dict, paths: dict | None = None) -> tuple[Sharded, dict]:
    """Split ``state`` into (DCP pieces by key, the common state that goes to ``common.pt``).

    Pure: ``state`` is not modified (megatron factories are applied to a copy of the nesting).
    For a plain state, ``paths`` (if given) receives each tensor key's path from the root,
    ``[["d", key] or ["l", index], ...]`` with the original key types, as DCP's manifest paths.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    mapping = _mcore_mapping()
    if mapping is None or not _has_sharded_base(state, mapping.ShardedBase):
        flat: Sharded = {}
        _, common = _split_plain(state, (), flat, paths)
        return flat, common
    # Megatron sharded state dict: reuse megatron's own preprocessing so the split is the same.
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
    )

    copy, _ = extract_matching_values(state, lambda _: True)  # copies containers, not leaves
    sharded_part, common = save_preprocess(copy, validate_access_integrity=False)
    grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_part, True)
    return dict(grouped), common


class _TorchDistPlanner(_PassThroughPlanner):
    """Flat keys as given; tensor properties recorded as megatron records them; pre-pickled
    objects written as they are.

    Megatron saves detached GPU tensors, so ``.metadata`` says requires_grad=False and
    pin_memory=False; our sources are pinned staging views, which would say otherwise.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for it in plan.items:
            if it.tensor_data is not None:
                props = dataclasses.replace(
                    it.tensor_data.properties, requires_grad=False, pin_memory=False
                )
                td = dataclasses.replace(it.tensor_data, properties=props)
                it = dataclasses.replace(it, tensor_data=td)
            items.append(it)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan


def read_config(directory: str | os.PathLike) -> dict | None:
    """``metadata.json`` as a dict, or None when the directory is not a dist checkpoint."""
    try:
        return json.loads((Path(directory) / L.TORCH_DIST_CONFIG).read_text())
    except FileNotFoundError:
        return None


def read_torch_dist(
    directory: str | os.PathLike,
    target_state: dict,
    paths: Mapping[str, list] | None = None,
    verify: Verify | None = None,
) -> dict:
    """Load a plain-state checkpoint into ``target_state`` in place and return it.

    Tensors the target has are read into its own tensors (shapes and dtypes must match); the
    checkpoint's other tensors are read into new ones and put where ``paths`` (the manifest's
    ``{key: [["d", key] or ["l", index], ...]}``) says they were saved, so an optimizer's
    int-keyed state loads into a fresh optimizer whose ``state`` is still ``{}``. Without a
    path for a key, it goes under the deepest container of the target its dotted key names
    (digits as int keys), or is left out if the target has none. The other leaves come from
    ``common.pt`` and are merged in (``dcp.merge_into``). For megatron sharded state dicts use
    ``megatron.core.dist_checkpointing.load`` (it needs a process group).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    directory = Path(directory)
    if read_config(directory) != CONFIG:
        raise ValueError(f"{directory} is not a torch_dist checkpoint (bad {L.TORCH_DIST_CONFIG})")
    target_paths: dict[str, list] = {}
    sharded, _ = split_common(target_state, target_paths)
    if any(not isinstance(p[0], torch.Tensor) for p in sharded.values()):
        raise TypeError("read_torch_dist takes plain state dicts; use dist_checkpointing.load")
    metadata = read_dcp_metadata(directory)
    # Every tensor the target asks for (DCP raises on one the checkpoint lacks, or of another
    # shape), then those it does not have yet.
    request: dict[str, torch.Tensor] = {k: p[0] for k, p in sharded.items()}
    where = dict(target_paths)
    for key, md in metadata.state_dict_metadata.items():
        if key in request or not isinstance(md, TensorStorageMetadata):
            continue
        path = (paths or {}).get(key) or _guess_path(target_state, key)
        if path is None:
            continue  # as megatron's loader: what the target does not ask for stays on disk
        request[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        where[key] = path
    load_flat(
        request,
        directory,
        planner=DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
        verify=verify,
    )
    with open(directory / L.TORCH_DIST_COMMON, "rb") as f:
        loaded = _load_weights_only(f)
    for key, t in request.items():
        _place(loaded, where[key], t)
    merge_into(target_state, loaded)
    return target_state


def _place(root: dict, path: list, value: Any) -> None:
    """Put ``value`` at ``path`` in the nested ``root``, creating dicts and lists on the way."""
    node: Any = root
    for i, (kind, key) in enumerate(path):
        child: list | dict | None
        if i == len(path) - 1:
            child = None
        else:
            child = [] if path[i + 1][0] == "l" else {}
        if kind == "l":
            while len(node) <= key:
                node.append(None)
            if child is None:
                node[key] = value
            elif node[key] is None:
                node[key] = child
            node = node[key]
        elif child is None:
            node[key] = value
        else:
            node = node.setdefault(key, child)


def _guess_path(target: Any, key: str) -> list | None:
    """A path for a checkpoint key the target lacks, when no manifest recorded it: follow the
    target's containers as far as the dotted key names them (dict keys may hold dots), then
    new dicts, digits as int keys (an optimizer's state). None if not even the first part of
    the key is in the target."""
    parts = key.split(".")
    path: list = []
    node, i = target, 0
    while i < len(parts):
        step = None
        if isinstance(node, dict):
            for j in range(len(parts), i, -1):
                name = ".".join(parts[i:j])
                for k in (name, int(name)) if name.isdigit() else (name,):
                    if k in node and (j == len(parts) or isinstance(node[k], (dict, list))):
                        step = (("d", k), node[k], j)
                        break
                if step:
                    break
        elif isinstance(node, list) and parts[i].isdigit() and int(parts[i]) < len(node):
            step = (("l", int(parts[i])), node[int(parts[i])], i + 1)
        if step is None:
            break
        path.append(list(step[0]))
        node, i = step[1], step[2]
    if not path:
        return None
    kind = "l" if isinstance(node, list) else "d"
    for p in parts[i:]:
        path.append([kind, int(p) if p.isdigit() else p])
        kind = "d"
    return path


def _load_weights_only(f: BinaryIO) -> Any:
    """``torch.load(weights_only=True)``, as megatron reads ``common.pt``: what megatron cannot
    read, we neither write nor read. ``import megatron.core`` registers megatron's safe globals
    (argparse.Namespace, numpy RNG state, its enums), so a load that needs them is retried
    once megatron is imported, when it is installed (its import is slow: only on demand)."""
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if "megatron.core" in sys.modules:
            raise
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            pass
        f.seek(0)
        return torch.load(f, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------ the format


class TorchDistFormat(DCPFormat):
    """Megatron ``torch_dist``: DCP shards of this rank's chunks plus ``common.pt`` and
    ``metadata.json`` from rank 0, as ``megatron.core.dist_checkpointing.save`` writes them."""

    name = "torch_dist"
    #: Linked as plain DCP's: megatron's loader finds tensors through ``.metadata``'s storage
    #: index, never by file name or count, so unchanged groups are whole files linked from the
    #: previous checkpoint; ``common.pt`` and ``metadata.json`` are written every time.
    differential = True
    metadata_files = frozenset({L.DCP_METADATA, L.TORCH_DIST_CONFIG, L.TORCH_DIST_COMMON})
    planner = _TorchDistPlanner

    def prepare(self, state: Any, options: SaveOptions) -> Prepared:
        state = materialize(state)
        if not isinstance(state, dict):
            raise TypeError(f"format torch_dist needs a dict state, not {type(state).__name__}")
        paths: dict[str, list] = {}  # plain tensors' typed paths, for the manifest
        sharded, common = split_common(state, paths)
        buf = io.BytesIO()
        try:
            torch.save(common, buf)
        except Exception as e:
            raise TypeError(f"the non-tensor state cannot be saved to common.pt: {e}") from e
        # Megatron (and our own load) read common.pt with weights_only=True: a state it cannot
        # read would commit and then fail every load as corrupt. Refused here, before any write.
        buf.seek(0)
        try:
            _load_weights_only(buf)
        except Exception as e:  # noqa: BLE001 - pickle raises many types
            raise TypeError(
                "the non-tensor state cannot be read back from common.pt with "
                f"torch.load(weights_only=True), as Megatron and asyncckpt load it: {e}; keep "
                "plain Python values there (numbers, strings, lists, dicts, argparse.Namespace)"
            ) from e
        tensors: dict[str, torch.Tensor] = {}
        objects: dict[str, bytes] = {}
        shards: dict[str, tuple[ShardInfo, list[str]]] = {}
        for key, pieces in sharded.items():
            first = pieces[0]
            if isinstance(first, torch.Tensor):  # plain state: the whole tensor under its path
                local_piece(first, key, shards, tensors)
            elif hasattr(first, "unique_key"):  # ShardedObject: megatron stores a list of data
                objects[key] = serialize_objects({key: [p.data for p in pieces]})[key]
            else:  # megatron ShardedTensor(s): this rank's chunks of one global tensor
                keys, chunks = [], []
                for i, sh in enumerate(pieces):
                    if sh.data is None:
                        raise ValueError(f"ShardedTensor {sh.key!r} has no data")
                    if sh.flattened_range is not None:
                        raise ValueError(
                            f"ShardedTensor {sh.key!r}: flattened_range is not supported"
                        )
                    shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
                    sk = f"{key}#{i}"
                    tensors[sk] = sh.data.detach().reshape(shape)
                    keys.append(sk)
                    chunks.append((tuple(sh.global_offset), shape))
                shards[key] = (ShardInfo(tuple(pieces[0].global_shape), tuple(chunks)), keys)
        return Prepared(tensors, objects, paths, {"shards": shards, "common": buf.getvalue()})

    def write(self, part: Prepared, location: Path, options: WriteOptions) -> Crcs:
        if options.rank == 0:
            write_synced(location / L.TORCH_DIST_COMMON, part.extra["common"])
        crcs = super().write(part, location, options)
        if options.rank == 0:  # last, as megatron does: "this is a complete checkpoint"
            write_synced(location / L.TORCH_DIST_CONFIG, json.dumps(CONFIG).encode())
        return crcs

    def load_into(self, state: Any, location: Path, paths: Paths, options: LoadOptions) -> None:
        if not (location / L.TORCH_DIST_COMMON).exists():
            return super().load_into(state, location, paths, options)
        # Tensors are read in place into the state's own tensors (a module's state_dict()
        # tensors are its parameters); the rest is merged back, Stateful objects get
        # load_state_dict.
        target = materialize(state)
        mapping = _mcore_mapping()
        if mapping is not None and _has_sharded_base(target, mapping.ShardedBase):
            if options.verify is not None:  # megatron's loader reads: checked before, apart
                check_files(location, options.verify.files).raise_any(location)
                options.verify.done.update(options.verify.files)
            _load_megatron(target, location)
        else:
            read_torch_dist(location, target, paths, options.verify)
        merge_into(state, target)

    def objects_known(self, location: Path) -> bool:
        # The non-tensor leaves are in common.pt, outside .metadata.
        return not (location / L.TORCH_DIST_COMMON).exists()


def _load_megatron(state: dict, directory: Path) -> None:
    """megatron's own loader (it needs torch.distributed), results copied back in place."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "loading a megatron sharded state dict needs torch.distributed initialised "
            "(megatron's loader runs collectives); a gloo group is enough on CPU"
        )

    def copy(x: Any) -> Any:
        # megatron's loader rewrites the containers and ShardedTensors it is given; hand it a
        # copy so the caller's tensors stay where they are and are filled in place below.
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, list):
            return [copy(v) for v in x]
        return dataclasses.replace(x) if isinstance(x, ShardedBase) else x

    loaded = dc.load(copy(state), str(directory))

    def put(target: Any, got: Any) -> Any:
        if isinstance(target, ShardedBase):
            data = getattr(target, "data", None)
            if isinstance(data, torch.Tensor) and isinstance(got, torch.Tensor):
                if data is not got:
                    with torch.no_grad():
                        data.copy_(got.reshape(data.shape))
                return target
            target.data = got
            return target
        if isinstance(target, dict) and isinstance(got, dict):
            for k, v in got.items():
                target[k] = put(target[k], v) if k in target else v
            return target
        if isinstance(target, list) and isinstance(got, list) and len(target) == len(got):
            for i, v in enumerate(got):
                target[i] = put(target[i], v)
            return target
        return got

    put(state, loaded)

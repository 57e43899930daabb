"""The bridge between a format and the staging pipeline: what the trainer stages, what the
worker writes.

``prepare(fmt, state)`` runs in the training process while ``save`` blocks: it picks out the
dense tensors to copy into the staging arenas (for a DTensor or a megatron ``ShardedTensor``:
this rank's local piece only, with where it sits in the global tensor), and serialises
everything else right away (a snapshot, and a clear error before anything is written).
``write(...)`` runs in the worker: it puts the staged views back together (local pieces as
``dist.LocalShard``) and writes the format into the temporary directory, collectively over the
workers' side group when there is one. Neither megatron nor a device mesh is needed in the
worker.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..commit import write_synced
from ..dist import LocalShard, ShardInfo, dtensor_shard_info, is_dtensor, is_dtensor_type
from ..staging import flatten_state, is_stateful, serialize_objects
from . import FORMAT_ALIASES as ALIASES
from .components import COMPONENTS
from .dcp import Serialized
from .torch_dist import _Planner as _MegatronPlanner


@dataclass
class Prepared:
    """One save's state, split for staging (trainer side)."""

    tensors: dict[str, torch.Tensor]  # staging key -> dense local tensor (copied into an arena)
    objects: dict[str, bytes] = field(default_factory=dict)  # DCP key -> torch.save bytes
    paths: dict[str, list] = field(default_factory=dict)  # dcp: fqn -> path (manifest)
    extra: dict[str, Any] = field(default_factory=dict)  # picklable, travels with the job
    key: tuple | None = None  # staging.layout_key(tensors), where already known


@dataclass(frozen=True)
class LegacyRanks:
    """Where this rank's files go in Megatron-LM's legacy layout, and whether it writes."""

    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    write: bool = True
    distrib_optim_key: str = "distrib_optim"


def legacy_ranks(rank: int, world_size: int, given: Any = None) -> LegacyRanks:
    """Explicit ranks, else megatron's parallel_state if initialised, else one dir per rank."""
    if isinstance(given, LegacyRanks):
        return given
    if isinstance(given, Mapping):
        return LegacyRanks(**given)
    import sys

    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return LegacyRanks(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            write=ps.get_data_parallel_rank() == 0,
        )
    return LegacyRanks(tp_rank=rank)


# ------------------------------------------------------------------------------ trainer side


def _local(t: torch.Tensor, key: str, shards: dict, tensors: dict) -> None:
    if is_dtensor(t):
        shards[key] = (dtensor_shard_info(t), [key])
        tensors[key] = t.to_local()
    else:
        tensors[key] = t


def prepare(
    fmt: str, state: Any, *, legacy: LegacyRanks | None = None, cache: Any = None
) -> Prepared:
    """``cache`` (a ``flatplan.FlattenCache``) replays the last save's flattening (dcp)."""
    fmt = ALIASES.get(fmt, fmt)
    if fmt == "dcp":
        return _prepare_dcp(state, cache)
    if fmt == "torch_dist":
        return _prepare_torch_dist(state)
    if fmt == "megatron_legacy":
        return _prepare_legacy(state, legacy or LegacyRanks())
    raise ValueError(f"unknown format {fmt!r}")


def _prepare_dcp(state: Any, cache: Any = None) -> Prepared:
    flat = cache.flatten(state) if cache is not None else flatten_state(state)
    tensors: dict[str, torch.Tensor] = flat.tensors
    shards: dict[str, tuple[ShardInfo, list[str]]] = {}
    key = flat.key
    if any(is_dtensor_type(t) for t in set(map(type, tensors.values()))):
        tensors, key = {}, None  # the local pieces are what is staged
        for fqn, t in flat.tensors.items():
            _local(t, fqn, shards, tensors)
    objects = serialize_objects(flat.objects)
    return Prepared(tensors, objects, flat.paths, {"shards": shards}, key=key)


def materialize(x: Any) -> Any:
    """The state with every Stateful object (module, optimizer) replaced by its state_dict();
    containers are copied, leaves are not."""
    if is_stateful(x):
        x = x.state_dict()
    if isinstance(x, Mapping):
        return {k: materialize(v) for k, v in x.items()}
    if isinstance(x, list):
        return [materialize(v) for v in x]
    return x


def _prepare_torch_dist(state: Any) -> Prepared:
    from . import torch_dist as td

    state = materialize(state)
    if not isinstance(state, dict):
        raise TypeError(f"format torch_dist needs a dict state, not {type(state).__name__}")
    paths: dict[str, list] = {}  # plain tensors' typed paths, for the manifest
    sharded, common = td.split_common(state, paths)
    buf = io.BytesIO()
    try:
        torch.save(common, buf)
    except Exception as e:
        raise TypeError(f"the non-tensor state cannot be saved to common.pt: {e}") from e
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, bytes] = {}
    shards: dict[str, tuple[ShardInfo, list[str]]] = {}
    for key, pieces in sharded.items():
        first = pieces[0]
        if isinstance(first, torch.Tensor):  # plain state: the whole tensor under its path
            _local(first, key, shards, tensors)
        elif hasattr(first, "unique_key"):  # ShardedObject: megatron stores a list of data
            objects[key] = serialize_objects({key: [p.data for p in pieces]})[key]
        else:  # megatron ShardedTensor(s): this rank's chunks of one global tensor
            keys, chunks = [], []
            for i, sh in enumerate(pieces):
                if sh.data is None:
                    raise ValueError(f"ShardedTensor {sh.key!r} has no data")
                if sh.flattened_range is not None:
                    raise ValueError(f"ShardedTensor {sh.key!r}: flattened_range is not supported")
                shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
                sk = f"{key}#{i}"
                tensors[sk] = sh.data.detach().reshape(shape)
                keys.append(sk)
                chunks.append((tuple(sh.global_offset), shape))
            shards[key] = (ShardInfo(tuple(pieces[0].global_shape), tuple(chunks)), keys)
    return Prepared(tensors, objects, paths, {"shards": shards, "common": buf.getvalue()})


#: Modules the worker (a spawned process that never runs the trainer's script) cannot import.
_UNIMPORTABLE_IN_WORKER = ("__main__", "__mp_main__")


class _MainReference(Exception):
    def __init__(self, obj: Any) -> None:
        super().__init__(obj)
        self.name = f"{obj.__module__}.{getattr(obj, '__qualname__', obj)}"


class _TensorRefPickler(pickle.Pickler):
    def __init__(self, file: Any, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.ids: dict[int, str] = {}

    def persistent_id(self, obj: Any) -> Any:
        # Every class and function the pickle refers to passes here: one from the trainer's
        # __main__ would pickle fine and only fail when the worker unpickles it.
        if (
            isinstance(obj, (type, types.FunctionType))
            and getattr(obj, "__module__", None) in _UNIMPORTABLE_IN_WORKER
        ):
            raise _MainReference(obj)
        if isinstance(obj, torch.Tensor):
            key = self.ids.get(id(obj))
            if key is None:
                key = self.ids[id(obj)] = f"t{len(self.ids)}"
                self.tensors[key] = obj
            return ("asyncckpt.tensor", key)
        return None


class _TensorRefUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, views: Mapping[str, torch.Tensor]) -> None:
        super().__init__(file)
        self.views = views

    def persistent_load(self, pid: Any) -> Any:
        return self.views[pid[1]]


def _state_dicts(x: Any) -> Any:
    """``x`` with every Stateful object replaced by its ``state_dict()`` (what Megatron-LM's
    ``model_optim_rng.pt`` holds); only the containers on the way to one are copied, so a
    module's state_dict keeps its type and ``_metadata``."""
    if is_stateful(x):
        return x.state_dict()
    if isinstance(x, dict):
        out = {k: _state_dicts(v) for k, v in x.items()}
        return out if any(out[k] is not v for k, v in x.items()) else x
    if isinstance(x, (list, tuple)):
        items = [_state_dicts(v) for v in x]
        if all(a is b for a, b in zip(items, x, strict=True)):
            return x
        return items if isinstance(x, list) else tuple(items)
    return x


def _main_reference_entry(state: Any) -> str:
    """The dotted path of the first entry of ``state`` whose pickle refers to ``__main__``."""

    def visit(x: Any, path: str) -> str | None:
        if type(x).__module__ in _UNIMPORTABLE_IN_WORKER:
            return path
        if isinstance(x, dict):
            items: Any = x.items()
        elif isinstance(x, (list, tuple)):
            items = enumerate(x)
        else:
            try:
                _TensorRefPickler(io.BytesIO(), {}).dump(x)
            except _MainReference:
                return path
            except Exception:  # noqa: BLE001 - only looking for the __main__ reference
                return None
            return None
        for k, v in items:
            found = visit(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
        return None

    return visit(state, "") or "<root>"


def pickle_with_refs(state: Any, what: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Pickle ``state`` with its tensors left out (staged instead): the skeleton and the
    tensors by the reference the skeleton holds. ``what`` names the file in errors."""
    tensors: dict[str, torch.Tensor] = {}
    buf = io.BytesIO()
    try:
        _TensorRefPickler(buf, tensors).dump(state)
    except _MainReference as e:
        entry = _main_reference_entry(state)
        raise TypeError(
            f"state entry {entry!r} refers to {e.name}, defined in the trainer's __main__: "
            f"the worker writing {what} (a spawned process that does not run the "
            "trainer's script) could not unpickle it; define it in an importable module "
            "or save plain values"
        ) from None
    except Exception as e:
        raise TypeError(f"the state cannot be pickled for {what}: {e}") from e
    return buf.getvalue(), tensors


def _prepare_legacy(state: Any, ranks: LegacyRanks) -> Prepared:
    # State dicts, not the objects: Megatron-LM's files hold state dicts, and the load then
    # restores the caller's modules and optimizers in place (load_state_dict).
    state = _state_dicts(state)
    if not isinstance(state, dict):
        raise TypeError(f"format megatron_legacy needs a dict state, not {type(state).__name__}")
    skeleton, tensors = b"", {}
    if ranks.write:
        skeleton, tensors = pickle_with_refs(state, "model_optim_rng.pt")
    for k, t in tensors.items():
        if is_dtensor(t):
            raise TypeError(f"format megatron_legacy stores per-rank files; {k} is a DTensor")
    return Prepared(tensors, {}, {}, {"skeleton": skeleton, "ranks": ranks})


def prepare_pt(state: Any, *, write: bool = True, what: str = "a .pt file") -> Prepared:
    """One ``torch.save`` file (``formats.pt``): state dicts, tensors staged; nothing at all
    on a rank that does not write the file."""
    state = _state_dicts(state)
    if not write:
        return Prepared({}, {}, {}, {"skeleton": None})
    skeleton, tensors = pickle_with_refs(state, what)
    for k, t in tensors.items():
        if is_dtensor(t):
            raise TypeError(f"{what} is one torch.save file; {k} is a DTensor (save it as dcp)")
    return Prepared(tensors, {}, {}, {"skeleton": skeleton})


def unpickle_with_refs(skeleton: bytes, views: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of ``pickle_with_refs``, in the worker: the staged views put back in."""
    return _TensorRefUnpickler(io.BytesIO(skeleton), views).load()


# ------------------------------------------------------------------------------ worker side


def _assemble(views: Mapping[str, torch.Tensor], shards: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    grouped: set[str] = set()
    for key, (info, keys) in shards.items():
        flat[key] = LocalShard([views[k] for k in keys], info)
        grouped.update(keys)
    for k, v in views.items():
        if k not in grouped:
            flat[k] = v
    return flat


def write(
    fmt: str,
    views: Mapping[str, torch.Tensor],
    objects: Mapping[str, bytes],
    extra: Mapping[str, Any] | None,
    directory: Path,
    *,
    rank: int = 0,
    process_group: Any = None,
    thread_count: int = 1,
    pace: Callable[[int], None] | None = None,
    direct_io: bool = False,
    step: int = 0,
    world_size: int = 1,
    plan_cache: str | None = None,
) -> dict[str, tuple[int, int]]:
    """Write one rank's part of a checkpoint into ``directory``; returns crcs of files written
    (by path relative to ``directory``).

    With a ``process_group`` every rank of it must call this for the same directory; DCP's
    metadata and the format's global files come from its rank 0. ``step`` and ``world_size``
    place the parts of a checkpoint of components (``formats.components``).
    """
    from . import dcp

    fmt = ALIASES.get(fmt, fmt)
    extra = extra or {}
    if fmt == COMPONENTS:
        from . import components

        return components.write(
            extra, views, objects, directory, step=step, rank=rank, world_size=world_size,
            process_group=process_group, thread_count=thread_count, pace=pace,
            direct_io=direct_io, plan_cache=plan_cache,
        )  # fmt: skip
    shards = extra.get("shards", {})
    if fmt in ("dcp", "torch_dist"):
        flat: dict[str, Any] = {k: Serialized(v) for k, v in objects.items()}
        flat.update(_assemble(views, shards))
        megatron = fmt == "torch_dist"
        if megatron:
            from . import torch_dist as td

            if rank == 0:
                write_synced(directory / td.COMMON_FNAME, extra["common"])
        crcs = dcp.write_flat(
            flat,
            directory,
            thread_count=thread_count,
            pace=pace,
            direct_io=direct_io,
            process_group=process_group,
            planner=_TorchDistPlanner() if megatron else None,  # None: write_flat's default
            plan_cache=plan_cache,
        )
        if megatron and rank == 0:  # last, as megatron does: "this is a complete checkpoint"
            write_synced(directory / td.CONFIG_FNAME, json.dumps(td.CONFIG).encode())
        return crcs
    if fmt == "megatron_legacy":
        from . import megatron_legacy as legacy

        ranks: LegacyRanks = extra["ranks"]
        if ranks.write:
            state = unpickle_with_refs(extra["skeleton"], views)
            legacy.write_legacy(
                state, directory, ranks.tp_rank, ranks.pp_rank, ranks.pp_size,
                ranks.distrib_optim_key,
            )  # fmt: skip
        return {}
    raise ValueError(f"unknown format {fmt!r}")


class _TorchDistPlanner(_MegatronPlanner):
    """megatron's planner settings (``torch_dist._Planner``) + pre-pickled objects as they are."""

    def transform_object(self, write_item: Any, object: Any) -> Any:
        if isinstance(object, Serialized):
            return io.BytesIO(object)
        return super().transform_object(write_item, object)


# ------------------------------------------------------------------------------ loading


def load_into(
    fmt: str,
    state: Any,
    directory: Path,
    paths: Mapping[str, list] | None,
    *,
    legacy: LegacyRanks | None = None,
    weights_only: bool = True,
) -> None:
    """Restore the checkpoint in ``directory`` into ``state`` in place (any world size).

    For format ``pt`` (a component's ``torch.save`` file) ``directory`` is the file, read
    with ``weights_only``.
    """
    from . import dcp

    fmt = ALIASES.get(fmt, fmt)
    if fmt == "pt":
        from . import pt

        loaded = pt.read(directory, weights_only=weights_only)
        if is_stateful(state):
            state.load_state_dict(loaded)
        else:
            dcp.merge_into(state, loaded)
        return
    if fmt == "megatron_legacy":
        from . import megatron_legacy as lg

        r = legacy or LegacyRanks()
        loaded = lg.read_legacy(directory, r.tp_rank, r.pp_rank, r.pp_size, r.distrib_optim_key)
        target = state.state_dict() if is_stateful(state) else state
        if is_stateful(state):
            state.load_state_dict(loaded)
        else:
            dcp.merge_into(target, loaded)
        return
    if fmt == "torch_dist" and (directory / "common.pt").exists():
        from . import torch_dist as td

        # Tensors are read in place into the state's own tensors (a module's state_dict()
        # tensors are its parameters); the rest is merged back, Stateful objects get
        # load_state_dict.
        target = materialize(state)
        mapping = td._mcore_mapping()
        if mapping is not None and td._has_sharded_base(target, mapping.ShardedBase):
            _load_megatron(target, directory)
        else:
            td.read_torch_dist(directory, target, paths)
        dcp.merge_into(state, target)
        return
    dcp.load_into(state, directory, paths)


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

"""The bridge between the formats and the staging pipeline: what the trainer stages, what the
worker writes, what a load reads; each by format name, through the registry
(``asyncckpt.formats.get_format``).

``prepare(fmt, state)`` runs in the training process while ``save`` blocks: the format picks
out the dense tensors to copy into the staging arenas (for a DTensor or a megatron
``ShardedTensor``: this rank's local piece only, with where it sits in the global tensor), and
serialises everything else right away (a snapshot, and a clear error before anything is
written). ``write(...)`` runs in the worker: the format puts the staged views back together
(local pieces as ``dist.LocalShard``) and writes into the temporary directory, collectively
over the workers' side group when there is one. Neither megatron nor a device mesh is needed
in the worker.

A format registered in the trainer but not built in travels with each job
(``extra[FORMAT_KEY]``): the worker is a spawned process that never ran the registration.
"""

from __future__ import annotations

import io
import pickle
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncckpt.core.tree import is_stateful
from asyncckpt.errors import NotSerializable
from asyncckpt.formats import (  # noqa: F401 - format_of, prepare_part and FORMAT_KEY are names of this module too
    _UNIMPORTABLE_IN_WORKER,
    FORMAT_KEY,
    components,
    format_of,
    get_format,
    prepare_part,
)
from asyncckpt.formats.base import (
    Format,
    LegacyRanks,
    LoadOptions,
    Prepared,
    SaveOptions,
    Verify,
    WriteOptions,
)
from asyncckpt.staging.arenas import type_name


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


def state_dicts(x: Any) -> Any:
    """``x`` with every Stateful object replaced by its ``state_dict()`` (what Megatron-LM's
    ``model_optim_rng.pt`` holds); only the containers on the way to one are copied, so a
    module's state_dict keeps its type and ``_metadata``."""
    if is_stateful(x):
        return x.state_dict()
    if isinstance(x, dict):
        out = {k: state_dicts(v) for k, v in x.items()}
        return out if any(out[k] is not v for k, v in x.items()) else x
    if isinstance(x, (list, tuple)):
        items = [state_dicts(v) for v in x]
        if all(a is b for a, b in zip(items, x, strict=True)):
            return x
        return items if isinstance(x, list) else tuple(items)
    return x


def _failing_entry(state: Any, *, main_only: bool) -> tuple[str, Any]:
    """The dotted path and value of the first entry of ``state`` whose pickle fails (or, with
    ``main_only``, refers to ``__main__``); ``("<root>", state)`` where no single one does."""

    def visit(x: Any, path: str) -> tuple[str, Any] | None:
        if type(x).__module__ in _UNIMPORTABLE_IN_WORKER:
            return path, x
        if isinstance(x, dict):
            items: Any = x.items()
        elif isinstance(x, (list, tuple)):
            items = enumerate(x)
        else:
            try:
                _TensorRefPickler(io.BytesIO(), {}).dump(x)
            except _MainReference:
                return path, x
            except Exception:  # noqa: BLE001 - pickle raises many types
                return None if main_only else (path, x)
            return None
        for k, v in items:
            found = visit(v, f"{path}.{k}" if path else str(k))
            if found is not None:
                return found
        return None

    found = visit(state, "")
    return found if found is not None and found[0] else ("<root>", state)


def pickle_with_refs(state: Any, what: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Pickle ``state`` with its tensors left out (staged instead): the skeleton and the
    tensors by the reference the skeleton holds. ``what`` names the file in errors."""
    tensors: dict[str, torch.Tensor] = {}
    buf = io.BytesIO()
    try:
        _TensorRefPickler(buf, tensors).dump(state)
    except _MainReference as e:
        entry, leaf = _failing_entry(state, main_only=True)
        kind = type_name(leaf)
        raise NotSerializable(
            f"state entry {entry!r} ({kind}) refers to {e.name}, defined in the trainer's "
            "__main__: "
            f"the worker writing {what} (a spawned process that does not run the "
            "trainer's script) could not unpickle it; define it in an importable module "
            "or save plain values; nothing was written",
            key=entry,
            type_name=kind,
        ) from None
    except Exception as e:  # noqa: BLE001 - pickle raises many types
        entry, leaf = _failing_entry(state, main_only=False)
        kind = type_name(leaf)
        raise NotSerializable(
            f"state entry {entry!r} ({kind}) cannot be pickled for {what}: {e}; save plain "
            "values (tensors, numbers, strings, containers of them) or leave it out of the "
            "state; nothing was written",
            key=entry,
            type_name=kind,
        ) from e
    return buf.getvalue(), tensors


def unpickle_with_refs(skeleton: bytes, views: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of ``pickle_with_refs``, in the worker: the staged views put back in."""
    return _TensorRefUnpickler(io.BytesIO(skeleton), views).load()


# ------------------------------------------------------------------------------ trainer side


def prepare(
    fmt: str, state: Any, *, legacy: LegacyRanks | None = None, cache: Any = None
) -> Prepared:
    """``state`` split for staging in format ``fmt`` (a name or alias). ``cache`` (a
    ``flatplan.FlattenCache``) replays the last save's flattening (dcp)."""
    options = SaveOptions(legacy=legacy or LegacyRanks(), cache=cache)
    return prepare_part(get_format(fmt), state, options)


# ------------------------------------------------------------------------------ worker side


def write(
    fmt: str | Format,
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
    paths: Mapping[str, list] | None = None,
    differential: Any = None,
    threads_used: list[int] | None = None,
) -> dict[str, tuple[int, int]]:
    """Write one rank's part of a checkpoint into ``directory``; returns crcs of files written
    (by path relative to ``directory``).

    With a ``process_group`` every rank of it must call this for the same directory; DCP's
    metadata and the format's global files come from its rank 0. ``step`` and ``world_size``
    place the parts of a checkpoint of components (``formats.components``). ``paths``: the
    prepared ``Prepared.paths`` (dcp records them in ``.metadata`` as DCP's object paths).
    ``differential``: a ``differential.Previous`` for formats that link unchanged files, or None.
    ``threads_used``: gets how many files each writer wrote at once (``WriteOptions``).
    """
    extra = extra or {}
    paths = paths or {}
    options = WriteOptions(
        rank, process_group, thread_count, pace, direct_io, plan_cache, differential, threads_used
    )
    if fmt == components.COMPONENTS:
        return components.write(
            extra,
            views,
            objects,
            directory,
            step=step,
            world_size=world_size,
            options=options,
            paths=paths,
        )
    part = Prepared(views, objects, paths, extra)
    return format_of(fmt, extra).write(part, directory, options)


# ------------------------------------------------------------------------------ loading


def load_into(
    fmt: str,
    state: Any,
    directory: Path,
    paths: Mapping[str, list] | None,
    *,
    legacy: LegacyRanks | None = None,
    weights_only: bool = True,
    verify: Verify | None = None,
    target_only: bool = False,
) -> None:
    """Restore the checkpoint in ``directory`` into ``state`` in place (any world size).

    For format ``pt`` (a component's ``torch.save`` file) ``directory`` is the file, read
    with ``weights_only``. ``verify``: files the format checks as it reads them (only for a
    format that ``verifies_while_reading``). ``target_only``: ``LoadOptions.target_only``.
    """
    options = LoadOptions(
        legacy=legacy or LegacyRanks(),
        weights_only=weights_only,
        verify=verify,
        target_only=target_only,
    )
    get_format(fmt).load_into(state, Path(directory), paths, options)

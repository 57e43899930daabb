"""The state tree, walked the way DCP walks it: flattened to DCP keys for a save, rebuilt and
merged back into the caller's objects for a load.

Pure and below every wing that handles states: staging flattens with it, the formats rebuild
with it, ``entries`` describes a load target with it. Nothing here touches a file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

#: A path from the state's root to a leaf: ("d", key) for a dict key, ("l", i) for a list index.
PathItem = tuple[str, Any]


def is_stateful(obj: Any) -> bool:
    """DCP's Stateful protocol: ``state_dict()`` and ``load_state_dict()`` (module, optimizer)."""
    return (
        not isinstance(obj, (torch.Tensor, Mapping))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def is_terminal(value: Any) -> bool:
    """Whether ``value`` is a leaf of the state tree (not walked into)."""
    # Mirrors torch.distributed.checkpoint._traverse.traverse_state_dict: mappings are always
    # walked; a list only if it holds tensors or walkable containers; anything else is a leaf.
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, (Mapping, list)) and not is_terminal(entry):
                return False
            if isinstance(entry, torch.Tensor):
                return False
            if is_stateful(entry):  # saved as its state_dict(), not pickled whole
                return False
        return True
    return True


@dataclass
class FlatState:
    """A state flattened to DCP keys (fully qualified names, "a.b.0.c")."""

    tensors: dict[str, torch.Tensor]
    objects: dict[str, Any]
    paths: dict[str, list[PathItem]]  # fqn -> path with the original key types
    key: tuple | None = None  # layout_key(tensors), where already known (flatplan)


def flatten_state(state: Any) -> FlatState:
    """Flatten a nested state; Stateful objects are replaced by their ``state_dict()``."""
    if is_stateful(state):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state must be a dict of named components (or a Stateful object), not {type(state).__name__}"
        )
    flat = FlatState({}, {}, {})

    def visit(path: list[PathItem], fqn: str, value: Any) -> None:
        # ``fqn`` is the path's keys joined by dots, carried along rather than re-joined per leaf.
        if is_stateful(value):
            value = value.state_dict()
        if isinstance(value, Mapping) and not value and path:
            # An empty dict (an optimizer's ``state`` before its first step) has no leaves, so
            # DCP's flattening would drop it and the load could not give it back: keep it as
            # an object leaf. Plain ``dcp.load`` reads only the keys its target asks for, and
            # a target's empty dict asks for none, so it still loads such a checkpoint. Kept
            # as a plain dict (always picklable), as non-empty mappings come back.
            _leaf(path, fqn, {})
        elif isinstance(value, Mapping):
            for k, v in value.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(
                        f"state key {k!r} at {fqn or '<root>'}: keys must be str or int"
                    )
                visit(path + [("d", k)], f"{fqn}.{k}" if path else str(k), v)
        elif not is_terminal(value):
            for i, v in enumerate(value):
                visit(path + [("l", i)], f"{fqn}.{i}" if path else str(i), v)
        else:
            _leaf(path, fqn, value)

    def _leaf(path: list[PathItem], fqn: str, value: Any) -> None:
        if fqn in flat.paths:
            raise ValueError(f"two entries of the state flatten to the same key {fqn!r}")
        flat.paths[fqn] = path
        if isinstance(value, torch.Tensor):
            _check_tensor(fqn, value)
            flat.tensors[fqn] = value
        else:
            flat.objects[fqn] = value

    visit([], "", state)
    return flat


def _check_tensor(fqn: str, t: torch.Tensor) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{fqn}: only dense (strided) tensors can be staged, not {t.layout}")
    if t.device.type == "meta":
        raise TypeError(f"{fqn}: a meta tensor has no data to save")
    if t.is_quantized:
        raise TypeError(f"{fqn}: quantized tensors are not supported")
    if t.dtype in _BITS_DTYPES:  # DCP's writer fails on them (torch.iinfo), as dcp.save does
        raise TypeError(
            f"{fqn}: {t.dtype} tensors cannot be saved by DCP; view them as torch.uint8 "
            "(or int16) to save their bytes"
        )


_BITS_DTYPES = frozenset(
    getattr(torch, n)
    for n in ("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16")
    if hasattr(torch, n)
)


def target_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of the caller's state by DCP key (Stateful objects via state_dict())."""
    try:
        return flatten_state(state).tensors
    except (TypeError, ValueError):
        return {}


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, list]) -> dict[str, Any]:
    """Rebuild the nested state (dicts and lists, original key types) from flat leaves."""
    root: dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn) or [("d", fqn)]
        node: Any = root
        for i, (kind, key) in enumerate(path):
            last = i == len(path) - 1
            nxt_kind = None if last else path[i + 1][0]
            if kind == "l":
                while len(node) <= key:
                    node.append(None)
                if last:
                    node[key] = value
                else:
                    if node[key] is None:
                        node[key] = [] if nxt_kind == "l" else {}
                    node = node[key]
            else:
                if last:
                    node[key] = value
                else:
                    node = node.setdefault(key, [] if nxt_kind == "l" else {})
    return root


def merge_into(target: Any, loaded: Any, where: str = "") -> Any:
    """Restore ``loaded`` into ``target`` in place where possible; returns the merged value.

    Tensors are copied into existing tensors of the same shape; Stateful objects get
    ``load_state_dict``; dicts are merged key by key (keys only in the checkpoint are added);
    a list that holds tensors (or, in the target, Stateful objects) is restored element by
    element when it has the target's length; anything else, a list of plain values included,
    is replaced by the checkpoint's value.
    """
    if is_stateful(target) and isinstance(loaded, Mapping):
        target.load_state_dict(loaded)
        return target
    if isinstance(target, torch.Tensor) and isinstance(loaded, torch.Tensor):
        if target is loaded:
            return target
        if target.shape == loaded.shape:
            with torch.no_grad():
                target.copy_(loaded)
            return target
        return loaded
    if isinstance(target, dict) and isinstance(loaded, Mapping):
        for k, v in loaded.items():
            target[k] = merge_into(target[k], v, f"{where}.{k}") if k in target else v
        return target
    if (
        isinstance(target, list)
        and isinstance(loaded, list)
        and len(target) == len(loaded)
        and (_holds_tensor(loaded) or any(is_stateful(t) for t in target))
    ):
        for i, v in enumerate(loaded):
            target[i] = merge_into(target[i], v, f"{where}.{i}")
        return target
    # A list of plain values is a value as saved: merging it element by element into the
    # target's list would keep the target's extra elements (or their extra dict keys).
    return loaded


def _holds_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, Mapping):
        return any(_holds_tensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v) for v in x)
    return False

"""What a state or a checkpoint holds, by DCP key: the two sides ``loadcheck`` compares.

A format describes a checkpoint as ``Entries`` (``Format.entries``); ``walk`` describes a load
target the same way. Pure, and below every format: formats depend on it, never the reverse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncckpt.core.tree import is_stateful, is_terminal

#: A tensor's (shape, dtype); None for a non-tensor entry.
Entry = tuple[tuple[int, ...], torch.dtype] | None


@dataclass
class Entries:
    """One side of the comparison: every leaf by DCP key, and the open containers."""

    leaves: dict[str, Entry] = field(default_factory=dict)
    #: Keys of empty containers / None in the target: anything under them is accepted.
    open: set[str] = field(default_factory=set)
    #: Whether the non-tensor leaves are known (torch_dist keeps them outside ``.metadata``).
    objects_known: bool = True
    #: Keys of tensors whose elements share memory (``expand()``): no load can fill them.
    overlapping: set[str] = field(default_factory=set)

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: v for k, v in self.leaves.items() if v is not None}


def _entry(value: Any) -> Entry:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return None


def self_overlapping(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` are one memory location (``expand()``, some
    ``as_strided`` views): it cannot hold distinct values, and torch refuses to write into it."""
    if t.numel() <= 1 or t.is_contiguous():
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    if any(st == 0 for st, _ in dims):
        return True
    reach = 0  # the furthest offset the dims with smaller strides reach
    for st, n in dims:
        if st <= reach:
            break
        reach += st * (n - 1)
    else:
        return False  # each stride steps past everything the smaller ones reach
    # Interleaved strides (rare): count the distinct offsets.
    offsets = torch.zeros((), dtype=torch.int64)
    for n, st in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
    return offsets.unique().numel() < t.numel()


def walk(state: Any) -> Entries:
    """The leaves of a nested state by DCP key, as ``staging.flatten_state`` names them.

    Stateful objects count through their ``state_dict()``. Mirrors DCP's traversal: mappings
    are walked, a list only if it holds tensors or containers, anything else is a leaf.
    """
    out = Entries()

    def visit(fqn: str, value: Any, top: bool) -> None:
        if is_stateful(value):
            value = value.state_dict()
        if isinstance(value, Mapping):
            if not value and not top:
                out.open.add(fqn)
            for k, v in value.items():
                visit(f"{fqn}.{k}" if not top else str(k), v, False)
        elif isinstance(value, list) and not value:
            out.open.add(fqn)
        elif not is_terminal(value):
            for i, v in enumerate(value):
                visit(f"{fqn}.{i}" if not top else str(i), v, False)
        elif value is None and not top:
            out.open.add(fqn)
        elif not top:
            out.leaves[fqn] = _entry(value)
            if isinstance(value, torch.Tensor) and self_overlapping(value):
                out.overlapping.add(fqn)

    visit("", state, True)
    return out


def has_sharded_base(state: Any) -> bool:
    """True when the state holds megatron ShardedTensor/ShardedObject (megatron checks those)."""
    import sys

    mapping = sys.modules.get("megatron.core.dist_checkpointing.mapping")
    if mapping is None:
        return False

    def any_sharded(x: Any) -> bool:
        if is_stateful(x):
            x = x.state_dict()
        if isinstance(x, Mapping):
            return any(any_sharded(v) for v in x.values())
        if isinstance(x, list):
            return any(any_sharded(v) for v in x)
        return isinstance(x, mapping.ShardedBase)

    return any_sharded(state)

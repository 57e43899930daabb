"""The flattening of a state, recorded once per layout and replayed at every save.

``staging.flatten_state`` walks the whole state in Python: for an MoE-like state of 20,000
tensors that is ~45 ms of the save's stall, more than copying the tensors (~25 ms with one
``torch._foreach_copy_``). The walk's result depends only on the state's structure, which a
training loop keeps from save to save. So the first save records where every leaf sits
(which container, which key) and later saves fetch the leaves straight from there, checking
that the structure still holds:

- every container (dict, list, or a Stateful's fresh ``state_dict()``) has the type and the
  length it had, and every recorded key is still in it (so a dict has exactly the same keys;
  a list replaced by a dict of the same int keys is a new structure: the paths differ);
- every leaf has the type it had (a tensor is still a tensor, a DTensor a DTensor, an object
  leaf not a tensor), a leaf list still holds no tensor, a leaf dict is still empty;
- every tensor has the dtype and shape it had (the staging arenas are laid out for them).

Anything else makes ``replay`` return None and the caller flattens afresh (and records a new
plan). The leaves come out in the recorded order, which is also the staging arenas' order.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from asyncckpt.core.tree import FlatState, flatten_state, is_stateful, is_terminal

#: Containers whose ``values()`` (iteration, for a list) are what indexing them by their keys
#: in order gives: a replay takes a whole one's tensors in one pass.
_PLAIN = (dict, OrderedDict, list)
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")

#: One step from a container to a child: (parent index, key, call state_dict() on it?).
_Step = tuple[int, Any, bool]


@dataclass
class FlattenPlan:
    root_stateful: bool
    containers: list[_Step]  # container i + 1 is reached by containers[i] from its parent
    lengths: list[int]  # len() of every container, the root first
    container_types: list[type]  # type() of every container, the root first
    tensor_refs: list[tuple[int, Any]]  # (container index, key) of each tensor leaf
    object_refs: list[tuple[int, Any]]
    tensor_types: list[type]
    object_types: list[type]
    dtypes: list[torch.dtype]
    shapes: list[torch.Size]
    # The recorded flattening's names and paths, reused as they are (never its leaves: the
    # plan must not keep the first save's tensors alive).
    tensor_fqns: list[str]
    object_fqns: list[str]
    paths: dict[str, list]
    _key: tuple | None = None
    _groups: list[tuple[int, bool, list]] | None = None

    @classmethod
    def record(cls, state: Any) -> tuple[FlatState, FlattenPlan | None]:
        """Flatten ``state`` (as ``flatten_state``) and record where its leaves sit."""
        flat = flatten_state(state)
        root_stateful = is_stateful(state)
        root = state.state_dict() if root_stateful else state
        index: dict[tuple, int] = {(): 0}  # a container's path of keys -> its index
        conts: list[Any] = [root]
        steps: list[_Step] = []

        def container(keys: tuple) -> int:
            if keys in index:
                return index[keys]
            parent = container(keys[:-1])
            child = conts[parent][keys[-1]]
            call = is_stateful(child)
            conts.append(child.state_dict() if call else child)
            steps.append((parent, keys[-1], call))
            index[keys] = len(conts) - 1
            return index[keys]

        def refs(fqns: Any) -> list[tuple[int, Any]] | None:
            out = []
            for fqn in fqns:
                keys = tuple(k for _, k in flat.paths[fqn])
                if not keys:
                    return None
                out.append((container(keys[:-1]), keys[-1]))
            return out

        tensor_refs, object_refs = refs(flat.tensors), refs(flat.objects)
        if tensor_refs is None or object_refs is None:
            return flat, None
        tensors = list(flat.tensors.values())
        plan = cls(
            root_stateful=root_stateful,
            containers=steps,
            lengths=[len(c) for c in conts],
            container_types=[type(c) for c in conts],
            tensor_refs=tensor_refs,
            object_refs=object_refs,
            tensor_types=[type(t) for t in tensors],
            object_types=[type(o) for o in flat.objects.values()],
            dtypes=[t.dtype for t in tensors],
            shapes=[t.shape for t in tensors],
            tensor_fqns=list(flat.tensors),
            object_fqns=list(flat.objects),
            paths=flat.paths,
        )
        # Computed now (in prepare, say), not in the first save's stall, and handed out with
        # this flattening too: the slot laid out for it keeps this very key object, so every
        # replay's key is found by identity (``same_key``), not by walking 20,000 entries.
        flat.key = plan.key
        plan.groups  # noqa: B018 - made now too, not in the first replay
        return flat, plan

    def replay(self, state: Any) -> FlatState | None:
        """``state`` flattened by this plan, or None if its structure is not the recorded one."""
        if is_stateful(state) != self.root_stateful:
            return None
        types = self.container_types
        try:
            conts = [state.state_dict() if self.root_stateful else state]
            # Each container's type is checked before it is indexed: a dict that became a
            # tensor (or a list an int-keyed dict) answers the same keys with other things.
            if type(conts[0]) is not types[0]:
                return None
            for i, (parent, key, call) in enumerate(self.containers, 1):
                child = conts[parent][key]
                child = child.state_dict() if call and is_stateful(child) else child
                if type(child) is not types[i]:
                    return None
                conts.append(child)
            if [len(c) for c in conts] != self.lengths:
                return None
            tensors: list[Any] = []
            for c, whole, keys in self.groups:
                cont = conts[c]
                # A plain dict (list) holding only these tensors, in this order: its values
                # in one C-level pass, not a lookup per key. Keys reordered: one by one.
                if whole and (types[c] is list or list(cont) == keys):
                    tensors.extend(cont if types[c] is list else cont.values())
                else:
                    tensors.extend([cont[k] for k in keys])
            objects = [conts[c][k] for c, k in self.object_refs]
        except (KeyError, IndexError, TypeError):
            return None
        if list(map(type, tensors)) != self.tensor_types:
            return None
        if list(map(type, objects)) != self.object_types:
            return None
        for o in objects:  # a leaf list that now holds a tensor, a leaf dict no longer empty
            if (isinstance(o, list) and not is_terminal(o)) or (isinstance(o, Mapping) and o):
                return None
        # dtypes compared as a C-level list; shapes one at a time, each torch.Size freed right
        # after its comparison: a list of 20,000 fresh Sizes would run the garbage collector's
        # young generations over them and push them into the old one, which then triggers a
        # full collection (0.15 s at 20,000 tensors) inside a save every few saves.
        if list(map(_DTYPE, tensors)) != self.dtypes:
            return None
        if not all(map(operator.eq, map(_SHAPE, tensors), self.shapes)):
            return None
        return FlatState(
            dict(zip(self.tensor_fqns, tensors, strict=True)),
            dict(zip(self.object_fqns, objects, strict=True)),
            self.paths,
            key=self.key,
        )

    @property
    def groups(self) -> list[tuple[int, bool, list]]:
        """``tensor_refs`` as runs of one container: (container index, whether the run is the
        whole of a plain dict or list, the keys in order)."""
        if self._groups is None:
            groups: list[tuple[int, bool, list]] = []
            for c, k in self.tensor_refs:
                if groups and groups[-1][0] == c:
                    groups[-1][2].append(k)
                else:
                    groups.append((c, False, [k]))
            self._groups = [
                (c, self.container_types[c] in _PLAIN and len(keys) == self.lengths[c], keys)
                for c, _, keys in groups
            ]
        return self._groups

    @property
    def key(self) -> tuple:
        """``staging.layout_key`` of the recorded tensors (the same for every replay)."""
        if self._key is None:
            self._key = tuple(
                (fqn, dtype, shape)
                for fqn, dtype, shape in zip(
                    self.tensor_fqns, self.dtypes, map(tuple, self.shapes), strict=True
                )
            )
        return self._key


class FlattenCache:
    """The plan of the last state flattened; ``flatten`` replays it or records a new one."""

    def __init__(self) -> None:
        self.plan: FlattenPlan | None = None
        self.hits = 0  # saves that replayed the plan (tests and benchmarks read it)

    def flatten(self, state: Any) -> FlatState:
        if self.plan is not None:
            flat = self.plan.replay(state)
            if flat is not None:
                self.hits += 1
                return flat
        flat, self.plan = FlattenPlan.record(state)
        return flat

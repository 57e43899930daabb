"""One ``torch.save`` file: the ``pt`` format of a checkpoint component.

What the RL frameworks keep beside their model shards is plain ``torch.save`` files read back
with ``torch.load``: SkyRL's ``global_step_N/data.pt`` (the dataloader's state) and
``trainer_state.pt``, RLinf's ``global_step_N/data/data.pt``. A component of format ``pt``
writes one such file at its path inside the step directory (``formats.components``).

The trainer pickles the state with its tensors left out (``staged.pickle_with_refs``: the
tensors are staged like any other, so the loop may mutate them right after ``save`` returns);
the worker puts the staged views back in and writes the file. A file holds state dicts, not
the objects: a module or an optimizer in the state is saved as its ``state_dict()`` and
restored in place with ``load_state_dict`` (as Megatron-LM's ``model_optim_rng.pt``).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from asyncckpt.core.entries import Entries, walk
from asyncckpt.core.shards import is_dtensor
from asyncckpt.core.tree import is_stateful, merge_into
from asyncckpt.formats.base import (
    Crcs,
    Format,
    LoadOptions,
    Paths,
    Prepared,
    SaveOptions,
    WriteOptions,
)
from asyncckpt.formats.staged import pickle_with_refs, state_dicts, unpickle_with_refs
from asyncckpt.storage.commit import write_synced
from asyncckpt.storage.manifest import checksum


def save_synced(obj: Any, path: Path) -> tuple[int, int]:
    """``torch.save`` ``obj`` to ``path`` and fsync it; returns (checksum, size) of the bytes.

    Serialised in memory first: a pickling error must not leave half a file behind.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    write_synced(path, data)
    return checksum(data), len(data)


def read(path: str | os.PathLike, *, weights_only: bool = True, mmap: bool = False) -> Any:
    """The object in a ``pt`` file, on the CPU.

    ``weights_only=True`` (torch.load's safe default) reads tensors, containers and plain
    values; a component whose files hold other objects (numpy arrays, a config object) says
    ``weights_only=False``, which unpickles arbitrary code: only for files you trust.
    """
    return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)


class PtFormat(Format):
    """One ``torch.save`` file, a component's format (the component's path is the file):
    state dicts, tensors staged; written by rank 0, or by every rank when the path names it
    (``SaveOptions.writes``)."""

    name = "pt"
    owns_directory = False

    def prepare(self, state: Any, options: SaveOptions) -> Prepared:
        what = options.what or "a .pt file"
        state = state_dicts(state)
        if not options.writes:  # nothing at all on a rank that does not write the file
            return Prepared({}, {}, {}, {"skeleton": None})
        skeleton, tensors = pickle_with_refs(state, what)
        for k, t in tensors.items():
            if is_dtensor(t):
                raise TypeError(f"{what} is one torch.save file; {k} is a DTensor (save it as dcp)")
        return Prepared(tensors, {}, {}, {"skeleton": skeleton})

    def write(self, part: Prepared, location: Path, options: WriteOptions) -> Crcs:
        if part.extra.get("skeleton") is None:
            return {}
        location.parent.mkdir(parents=True, exist_ok=True)
        state = unpickle_with_refs(part.extra["skeleton"], part.tensors)
        return {location.name: save_synced(state, location)}

    def load_into(self, state: Any, location: Path, paths: Paths, options: LoadOptions) -> None:
        loaded = read(location, weights_only=options.weights_only)
        if is_stateful(state):
            state.load_state_dict(loaded)
        else:
            merge_into(state, loaded)

    def entries(self, state: Any, location: Path, options: LoadOptions) -> Entries:
        return walk(read(location, weights_only=options.weights_only, mmap=True))

    def read_by_check(self, path: Path, location: Path) -> bool:
        return path == location  # the check reads the whole file

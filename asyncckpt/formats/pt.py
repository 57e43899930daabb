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

import os
from pathlib import Path
from typing import Any

import torch

from ..commit import write_synced
from ..manifest import checksum


def save_synced(obj: Any, path: Path) -> tuple[int, int]:
    """``torch.save`` ``obj`` to ``path`` and fsync it; returns (checksum, size) of the bytes.

    Serialised in memory first: a pickling error must not leave half a file behind.
    """
    import io

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

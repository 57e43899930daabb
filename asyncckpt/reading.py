"""Read a whole checkpoint back as a new nested dict, without a target to load into.

``engine.load`` restores *into* the caller's state (and checks it against the checkpoint
first). Integrations that receive the state rather than own it (Lightning's ``CheckpointIO``
returns the checkpoint dict it was given at save time) need the saved dict itself: every tensor
freshly allocated on the CPU, every object unpickled, containers rebuilt as saved.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import layout as _layout
from .errors import CheckpointError, CorruptCheckpoint


def read_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """The state saved in one committed checkpoint directory (``root/global_step_N``), as a dict.

    Tensors come back on the CPU; dicts and lists are rebuilt with their original key types;
    Stateful objects come back as the ``state_dict()`` they were saved as. With ``verify`` the
    files are checked against the manifest's checksums first (``CorruptCheckpoint`` on a mismatch).
    Only the ``dcp`` format (the ``global_step`` layout's default) is supported.
    """
    import torch.distributed.checkpoint as dcp_api

    from .formats import dcp
    from .manifest import check_files, read_manifest

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    if _layout.is_leftover(directory.name):
        raise CorruptCheckpoint(f"{directory} is an uncommitted temporary, not a checkpoint")
    paths = None
    if (directory / _layout.MANIFEST).exists():
        manifest = read_manifest(directory)
        fmt = manifest.get("format") or "dcp"
        if fmt != "dcp":
            raise CheckpointError(
                f"{directory} is in the {fmt!r} format; read_checkpoint reads 'dcp' only "
                "(load it in place with engine.load(state, path=...))"
            )
        paths = manifest.get("paths")
        if verify:
            problems = check_files(directory, manifest)
            if problems:
                raise CorruptCheckpoint(f"{directory}: " + "; ".join(problems))
    elif not (directory / ".metadata").exists():
        raise CheckpointError(f"{directory} holds no checkpoint (no manifest, no .metadata)")
    try:
        flat = dcp.read_flat(directory)
        if paths is None:
            paths = dcp._paths_from_dcp(dcp.read_dcp_metadata(directory))
    except (Exception, dcp_api.CheckpointException) as e:  # noqa: BLE001 - re-raised as ours
        raise CorruptCheckpoint(f"{directory}: could not be read ({e})") from e
    return dcp.unflatten(flat, paths)

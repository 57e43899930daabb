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

from asyncckpt.core import layout as _layout
from asyncckpt.errors import CheckpointError, CheckpointNotFound, CorruptCheckpoint
from asyncckpt.formats import Format, format_names, get_format
from asyncckpt.formats.precheck import check_files
from asyncckpt.storage.manifest import read_manifest


def read_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> dict[str, Any]:
    """The state saved in one committed checkpoint directory (``root/global_step_N``), as a dict.

    Tensors come back on the CPU; dicts and lists are rebuilt with their original key types;
    Stateful objects come back as the ``state_dict()`` they were saved as. With ``verify`` the
    files are checked against the manifest's checksums first (``precheck.check_files``;
    ``ChecksumMismatch``, a ``CorruptCheckpoint``, on a mismatch).
    Only formats that read back without a target (``Format.read``) are supported: ``dcp`` (the
    ``global_step`` layout's default) of the built-in ones.
    """
    import torch.distributed.checkpoint as dcp_api

    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointNotFound(f"no checkpoint directory at {directory}")
    if _layout.is_leftover(directory.name):
        raise CorruptCheckpoint(f"{directory} is an uncommitted temporary, not a checkpoint")
    paths = None
    fmt = _readable("dcp")  # a checkpoint without a manifest: DCP's files, if any
    assert fmt is not None  # dcp is always readable
    if (directory / _layout.MANIFEST).exists():
        manifest = read_manifest(directory)
        name = manifest.get("format") or "dcp"
        fmt = _readable(name)
        if fmt is None:
            readable = " and ".join(repr(n) for n in format_names() if _readable(n))
            raise CheckpointError(
                f"{directory} is in the {name!r} format; read_checkpoint reads {readable} only "
                "(load it in place with engine.load(state, path=...))"
            )
        paths = manifest.get("paths")
        if verify:  # every file at once, checksummed in place: the read is the one copy
            check_files(directory, manifest.get("files", {})).raise_any(directory)
    elif not (directory / _layout.DCP_METADATA).exists():
        raise CheckpointError(f"{directory} holds no checkpoint (no manifest, no .metadata)")
    try:
        return fmt.read(directory, paths)
    except (Exception, dcp_api.CheckpointException) as e:  # noqa: BLE001 - re-raised as ours
        raise CorruptCheckpoint(f"{directory}: could not be read ({e})") from e


def _readable(name: str) -> Format | None:
    """The registered format ``name`` if it reads back without a target, else None."""
    try:
        fmt = get_format(name)
    except ValueError:
        return None
    return fmt if fmt.reads_without_target() else None

"""Checks on the checkpoint root given by the user, shared by the engine and the CLI."""

from __future__ import annotations

import os
import re
from pathlib import Path

from asyncckpt.errors import UnsupportedStorage

__all__ = ["URL_RE", "is_url", "check_local_root"]

#: A URL scheme (RFC 3986: a letter, then letters, digits, ``+``, ``-``, ``.``) followed by ``://``.
URL_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


_MANGLED_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+:$")


def is_url(root: str | os.PathLike) -> bool:
    """Whether ``root`` names a URL (``s3://bucket/run``, ``gs://...``) rather than a path.

    A ``Path`` built from a URL has lost a slash (``Path("s3://b/run")`` is ``s3:/b/run``): a
    relative ``Path`` whose first part is a scheme of two or more characters and a colon counts
    too (a one-letter one looks like a Windows drive and is left alone)."""
    if isinstance(root, str):
        return bool(URL_RE.match(root))
    if isinstance(root, os.PathLike):
        path = Path(root)
        if URL_RE.match(os.fspath(root)):
            return True
        return (
            not path.is_absolute() and bool(path.parts) and bool(_MANGLED_RE.match(path.parts[0]))
        )
    return False


def check_local_root(root: str | os.PathLike) -> Path:
    """``root`` as a ``Path``; raises ``UnsupportedStorage`` for a URL.

    Without this, ``Path("s3://bucket/run")`` is the relative directory ``s3:/bucket/run`` and the
    checkpoints would silently land on the local disk of whichever machine ran the job.
    """
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"the checkpoint root must be a path, got {type(root).__name__}")
    if is_url(root):
        raise UnsupportedStorage(
            f"{os.fspath(root)}: a URL is not a local path here; pass the engine's root as a "
            "string URL (CheckpointEngine('s3://bucket/run', object_store=ObjectStore(...))), or a "
            "local root with remote=RemoteTier(url) (a Path() of a URL has lost a '/')"
        )
    return Path(root)

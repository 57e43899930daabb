"""Where checkpoints live: one ``Store`` protocol (``base.py``) under every durable write and
read of a root.

``local.LocalStore`` is a local or mounted root: the only place the package renames, deletes,
fsyncs or locks on a disk (through ``localfs.py``). ``fsspec_store.FsspecStore`` is an object
store (S3, GCS, any fsspec URL), where a checkpoint is committed by a marker written last.
``remote.RemoteTier`` says which store a local root's commits are published to and what to
keep there. ``open_store(root)`` picks the store of a path or a URL. Nothing in this package
imports torch.

The modules:

- ``base``: the ``Store`` protocol every durable write and read goes through.
- ``local``: ``LocalStore``, a local or mounted root: atomic rename, tracker, trash, locks.
- ``localfs``: the local file system's write side: the package's only renames, deletes, fsyncs, locks.
- ``fsspec_store``: ``FsspecStore``, an object store: committed by a marker written last.
- ``remote``: the remote tier: what to upload where, and what to keep there.
- ``commit``: the commit order, written once over any store: seal, publish, tracker.
- ``prune``: the one pruner over any store: read what is committed, plan, delete.
- ``manifest``: a checksum of every file of a checkpoint, and ``verify``.
- ``pinfile``: a live engine's protected steps, where other processes (the CLI's prune) see them.
- ``fresh_start``: a root whose every checkpoint was quarantined never starts from scratch in silence.
- ``goodput``: the goodput ledger file: each run's seconds per category, and their sums.
"""

from __future__ import annotations

from typing import Any

from asyncckpt.core.paths import is_url
from asyncckpt.storage.base import CommittedStore, FaultPoints, Store, StoredCheckpoint
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.remote import RemoteTier, UploadFailed


def open_store(root: Any, storage_options: dict[str, Any] | None = None) -> Store:
    """The store of ``root``: a ``FsspecStore`` for a URL (``s3://bucket/run``), else a
    ``LocalStore`` of the path."""

    if is_url(root):
        from asyncckpt.storage.fsspec_store import FsspecStore

        return FsspecStore(str(root), storage_options)
    if storage_options:
        raise ValueError(f"{root}: storage options are for a URL root, not a local path")
    return LocalStore(root)


__all__ = [
    "CommittedStore",
    "FaultPoints",
    "LocalStore",
    "RemoteTier",
    "Store",
    "StoredCheckpoint",
    "UploadFailed",
    "open_store",
]

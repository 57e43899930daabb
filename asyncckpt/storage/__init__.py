"""Where committed checkpoints live beyond the local disk.

The engine always writes and commits a checkpoint on a local (or mounted) file system first:
that is where fsync and an atomic rename make a commit (``commit.py``). An object store has no
rename, so a second tier publishes the committed directory there with a commit marker written
last (``fsspec_store.FsspecStore``), and ``remote.RemoteTier`` says which store and what to keep
in it. ``base.CommittedStore`` is what both tiers offer for committed checkpoints (list,
check, fetch, delete, tracker), ``local.LocalStore`` the local tier in that shape. Nothing in
this package imports torch.
"""

from .base import CommittedStore, StoredCheckpoint
from .local import LocalStore
from .remote import RemoteTier, UploadFailed

__all__ = ["CommittedStore", "LocalStore", "RemoteTier", "StoredCheckpoint", "UploadFailed"]

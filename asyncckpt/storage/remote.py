"""The remote tier: what to upload where, and what to keep there.

``RemoteTier`` is the user's description (a picklable dataclass: it travels to the worker).
``publish_after_commit`` is what the worker runs after each local commit: upload the new
checkpoint (and any newer local one a crash left un-uploaded), marker last, then the store's
tracker, then the tier's own retention. ``plan_remote_prune`` is the pure decision.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import layout as _layout
from ..errors import SaveFailed
from ..retention import CheckpointInfo, RetentionPolicy, plan_prune

if TYPE_CHECKING:
    from .base import CommittedStore
    from .fsspec_store import FsspecStore


class UploadFailed(SaveFailed):
    """A checkpoint committed locally could not be published to the object store."""


@dataclass(frozen=True)
class RemoteTier:
    """Publish every committed checkpoint to an object store, with its own retention.

    ``url``: an fsspec URL (``s3://bucket/run``, ``gs://bucket/run``); ``keep``: the store's
    retention policy (``None`` keeps everything there); ``storage_options``: passed to fsspec
    (``endpoint_url``, credentials, ...). ``timeout`` bounds one file's upload attempt and
    ``retries`` the attempts per file. A save's handle resolves once the checkpoint is committed
    in the store (marker written); an upload that fails fails the save with ``UploadFailed``
    while the local commit stays, and is retried with the next save.
    """

    url: str
    keep: RetentionPolicy | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, hash=False)
    timeout: float = 600.0
    retries: int = 3
    threads: int = 8

    def __post_init__(self) -> None:
        from ..paths import is_url

        if not isinstance(self.url, str) or not is_url(self.url):
            raise ValueError(f"RemoteTier needs a URL such as s3://bucket/run, got {self.url!r}")
        scheme = self.url.split("://", 1)[0]
        if scheme == "file":
            raise ValueError(f"{self.url}: a file:// tier is a local root; pass its path instead")
        _check_backend(self.url, scheme)
        if self.keep is not None and not isinstance(self.keep, RetentionPolicy):
            raise TypeError(f"keep must be a retention policy or None, not {self.keep!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")
        if not isinstance(self.retries, int) or self.retries < 1:
            raise ValueError(f"retries must be an int >= 1, got {self.retries!r}")
        if not isinstance(self.storage_options, dict):
            raise TypeError("storage_options must be a dict")

    def open(self) -> FsspecStore:
        from .fsspec_store import FsspecStore

        return FsspecStore(
            self.url,
            self.storage_options,
            timeout=self.timeout,
            retries=self.retries,
            threads=self.threads,
        )


def _check_backend(url: str, scheme: str) -> None:
    """Refuse a URL no installed fsspec back-end serves, when the engine is made (not at the
    first upload, after a step of training)."""
    from ..errors import UnsupportedStorage

    try:
        import fsspec

        fsspec.get_filesystem_class(scheme)
    except ImportError as e:
        raise UnsupportedStorage(
            f"{url}: the fsspec back-end for {scheme}:// is not installed ({e}); for s3:// "
            'pip install -e ".[s3]" (s3fs), for gs:// pip install gcsfs'
        ) from e
    except ValueError as e:
        raise UnsupportedStorage(f"{url}: no fsspec back-end knows {scheme}:// ({e})") from e


def remote_infos(store: CommittedStore, layout: str) -> list[CheckpointInfo]:
    """What a retention policy sees of a store (any tier): each committed one's manifest."""
    out = []
    for c in store.committed(layout):
        try:
            out.append(CheckpointInfo.from_manifest(store.read_manifest(c.name)))
        except (OSError, ValueError, KeyError):
            # Committed but its manifest is unreadable: still a checkpoint (kept by step).
            out.append(CheckpointInfo(step=c.step, committed_at=0.0))
    return out


def plan_remote_prune(
    checkpoints: list[CheckpointInfo],
    policy: RetentionPolicy | None,
    *,
    tracker_step: int | None,
    pinned: Iterable[int] = (),
    resumed_from: int | None = None,
    committed_step: int | None = None,
) -> list[int]:
    """Steps to delete from the store: the policy over its checkpoints, with the same
    protections as on disk (newest, tracker, pinned, resumed-from, the step just published
    and any above it: ``plan_prune``'s ``committed_step``). ``None`` deletes nothing."""
    if policy is None:
        return []
    return plan_prune(
        checkpoints,
        policy,
        tracker_step=tracker_step,
        pinned=pinned,
        resumed_from=resumed_from,
        committed_step=committed_step,
    ).delete


def publish_after_commit(
    store: FsspecStore,
    tier: RemoteTier,
    local_root: Path,
    layout: str,
    step: int,
    *,
    pinned: Iterable[int] = (),
    resumed_from: int | None = None,
) -> dict[str, Any]:
    """Publish ``step`` (committed locally) and prune the store; returns the figures.

    Local checkpoints newer than the store's newest that are not there yet (an upload that
    failed or was cut by a crash) are published too, oldest first, so the store never skips a
    step the trainer was told was saved while it is still on disk.
    """
    t0 = time.perf_counter()
    remote = {c.step for c in store.committed(layout)}
    newest_remote = max(remote, default=-1)
    todo = [
        c
        for c in _layout.scan(local_root, layout)
        if c.step not in remote and (c.step > newest_remote or c.step == step)
    ]
    nbytes = 0
    published = []
    for c in todo:
        nbytes += store.publish(c.path, c.path.name)
        published.append(c.step)
    if step not in remote and step not in published:
        raise UploadFailed(f"step {step} is not committed in {local_root}: nothing to upload")
    store.write_tracker(layout, max([step, *published]))
    upload_seconds = time.perf_counter() - t0
    deleted = (
        plan_remote_prune(
            remote_infos(store, layout),
            tier.keep,
            tracker_step=max([step, *published]),  # what write_tracker just wrote (or newer)
            pinned=pinned,
            resumed_from=resumed_from,
            committed_step=step,
        )
        if tier.keep is not None
        else []
    )
    for s in deleted:
        store.delete(_layout.dir_name(layout, s))
    return {
        "upload_seconds": upload_seconds,
        "uploaded_bytes": nbytes,
        "uploaded_steps": published,
        "remote_pruned": deleted,
        "remote": tier.url,
    }

"""The remote tier: what to upload where, and what to keep there.

``RemoteTier`` is the user's description (a picklable dataclass: it travels to the worker).
``publish_after_commit`` is what the worker runs after each local commit: upload the new
checkpoint (and any newer local one a crash left un-uploaded), marker last, then the store's
tracker, then the tier's own retention. ``plan_remote_prune`` is the pure decision.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncckpt.core import layout as _layout
from asyncckpt.core.paths import is_url
from asyncckpt.errors import UnsupportedStorage, UploadFailed
from asyncckpt.retention import RetentionPolicy
from asyncckpt.storage.commit import publish, write_tracker
from asyncckpt.storage.fsspec_store import FsspecStore
from asyncckpt.storage.localfs import fsync_dir, new_token, rename, replace_synced
from asyncckpt.storage.manifest import read_manifest, recorded_bytes
from asyncckpt.storage.prune import PruneRefused, prune

log = logging.getLogger("asyncckpt")

#: In a URL root's spool (and a local root with ``remote=``): which store it belongs to, and
#: which of its steps were published (``ls`` shows the others as pending uploads).
SPOOL_RECORD = ".asyncckpt-spool.json"
#: Spooled steps the store does not have (and that are not waiting to be uploaded) are moved
#: aside under this prefix (never a checkpoint name, never removed by the engine).
ORPHAN_PREFIX = ".orphaned-"
_PROTOCOL_ALIASES = {"s3a": "s3", "gcs": "gs"}

if TYPE_CHECKING:
    from asyncckpt.storage.fsspec_store import FsspecStore


@dataclass(frozen=True)
class RemoteTier:
    """Publish every committed checkpoint to an object store, with its own retention.

    ``url``: an fsspec URL (``s3://bucket/run``, ``gs://bucket/run``); ``keep``: the store's
    retention policy (``None`` keeps everything there); ``storage_options``: passed to fsspec
    (``endpoint_url``, credentials, ...). ``timeout`` bounds one file's upload attempt and
    ``retries`` the attempts per file. A save's handle resolves once the checkpoint is committed
    in the store (marker written); an upload that fails fails the save with ``UploadFailed``
    while the local commit stays, and is retried with the next save.

    ``max_queued_uploads``: committed steps that may wait for their upload (the one uploading
    included) while the worker goes on writing the next saves. They wait as files on the local
    disk, never in memory: the local root holds up to this many checkpoints beyond its own
    retention (pruning keeps a step until it is uploaded). Only when that many are waiting
    does the worker wait for room before its next save (said in the log), and the trainer's
    next save waits for its staging slot behind it. With several ranks the upload stays part
    of rank 0's commit.
    """

    url: str
    keep: RetentionPolicy | None = None
    storage_options: dict[str, Any] = field(default_factory=dict, hash=False)
    timeout: float = 600.0
    retries: int = 3
    threads: int = 8
    max_queued_uploads: int = 2

    def __post_init__(self) -> None:

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
        check_queue_bound(self.max_queued_uploads)

    def identity(self) -> dict[str, Any]:
        """What tells this store from another one with the same bucket and prefix: the
        protocol, the endpoint (``storage_options``' ``endpoint_url``, else the environment's
        ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` for s3, ``STORAGE_EMULATOR_HOST`` for gs;
        None: the provider's default), and bucket/prefix. Credentials are not part of it."""
        scheme, rest = self.url.split("://", 1)
        scheme = _PROTOCOL_ALIASES.get(scheme, scheme)
        opts = self.storage_options
        endpoint = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
        if not endpoint and scheme == "s3":
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if not endpoint and scheme == "gs":
            endpoint = os.environ.get("STORAGE_EMULATOR_HOST")
        path = "/".join(p for p in rest.split("/") if p not in ("", "."))
        return {
            "protocol": scheme,
            "endpoint": str(endpoint).rstrip("/") if endpoint else None,
            "path": path,
        }

    def spool_key(self) -> str:
        """A short hash of ``identity()``: the name of the default spool directory."""
        text = json.dumps(self.identity(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def open(self) -> FsspecStore:

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
    step the trainer was told was saved while it is still on disk. Each goes through the commit
    order (``commit.publish``: files, marker last), then the tracker; then the one pruner
    (``prune.prune``) applies ``tier.keep`` with the same safety rules as on disk: the step
    just published is trusted (checksummed as it was written) and never deleted, and nothing
    is deleted while no kept checkpoint verifies.
    """

    t0 = time.perf_counter()
    remote = {c.step for c in store.committed(layout)}
    newest_remote = max(remote, default=-1)
    todo = [
        c
        for c in _layout.scan(local_root, layout)
        if c.step not in remote
        and (c.step > newest_remote or c.step == step)
        and c.step <= step  # (a newer one waits in the upload queue for its own turn)
    ]
    nbytes = 0
    published = []
    for c in todo:
        nbytes += publish(store, c.path, c.path.name)
        published.append(c.step)
    if step not in remote and step not in published:
        raise UploadFailed(f"step {step} is not committed in {local_root}: nothing to upload")
    if step in remote:
        _same_save_in_store(store, local_root, layout, step)
    write_tracker(store, layout, max([step, *published]))
    upload_seconds = time.perf_counter() - t0
    deleted: list[int] = []
    if tier.keep is not None:
        try:
            result = prune(
                store,
                layout,
                tier.keep,
                pinned=pinned,
                resumed_from=resumed_from,
                committed_step=step,
                trusted=(step, *published),
                warn=False,
            )
        except PruneRefused as e:  # the uploads stand; the next save prunes again
            log.warning("asyncckpt: not pruning %s: %s", tier.url, e)
        else:
            deleted = result.deleted
    return {
        "upload_seconds": upload_seconds,
        "uploaded_bytes": nbytes,
        "uploaded_steps": published,
        "remote_pruned": deleted,
        "remote": tier.url,
    }


def _same_save_in_store(store: FsspecStore, local_root: Path, layout: str, step: int) -> None:
    """``UploadFailed`` unless the store's ``step`` holds the local one's files (the same
    names, sizes and checksums): a step already there counts as published only when it is
    this save (an upload whose report a crash cut), never another save of the same number (a
    run restarted without its local root), which is never overwritten in place."""

    name = _layout.dir_name(layout, step)
    try:
        ours = _file_entries(read_manifest(local_root / name))
        theirs = _file_entries(store.read_manifest(name))
    except (OSError, ValueError, KeyError) as e:
        raise UploadFailed(f"step {step}: cannot compare with {store.url_of(name)}: {e}") from e
    if ours != theirs:
        raise UploadFailed(
            f"{store.url_of(name)} holds another save of step {step} (its files differ from "
            f"{local_root / name}'s); a committed step is never overwritten: this one stays "
            "local only (was the run restarted without its local root? resume from the store)"
        )


def _file_entries(manifest: dict[str, Any]) -> dict[str, tuple[int, tuple[str, int]]]:

    return {n: recorded_bytes(e) for n, e in manifest["files"].items()}


# ---------------------------------------------------------------------- a URL root's spool


def _read_record(spool: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((spool / SPOOL_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_record(
    spool: Path, identity: dict[str, Any], published: Iterable[int], url: str | None = None
) -> None:

    text = json.dumps({"store": identity, "url": url, "published": sorted(set(published))})
    replace_synced(spool / SPOOL_RECORD, text.encode())


def mark_published(spool: Path, tier: RemoteTier, layout: str, steps: Iterable[int]) -> None:
    """Record in the spool that ``steps`` are in the store (after their marker is written):
    ``reconcile_spool`` then knows that one of them missing from the store was deleted there,
    not waiting to be uploaded. Only steps still in the spool are kept in the record."""
    record = _read_record(spool) or {}
    identity = tier.identity()
    published = set(record.get("published") or []) if record.get("store") == identity else set()
    here = {c.step for c in _layout.scan(spool, layout)}
    _write_record(spool, identity, (published | set(steps)) & here, tier.url)


def pending_uploads(root: Path, layout: str) -> dict[str, Any] | None:
    """What ``ls`` shows of a root with a remote tier (a URL root's spool, or a local root
    with ``remote=``), from its record alone (no store is reached): the store's URL and the
    steps committed here and not yet published there (newer than the newest published one,
    as ``publish_after_commit`` picks them). None: no remote tier ever wrote here."""
    record = _read_record(root)
    if record is None:
        return None
    published = {s for s in record.get("published") or [] if isinstance(s, int)}
    newest = max(published, default=-1)
    steps = [c.step for c in _layout.scan(root, layout) if c.step > newest]
    return {"url": record.get("url"), "steps": steps}


def reconcile_spool(spool: Path, tier: RemoteTier, store: Any, layout: str) -> list[str]:
    """At start, before any save: make the spool of a URL root agree with its store (the store
    says what exists). Returns the names of the spooled steps moved aside.

    A step committed in the spool counts only if the store has it, or if it is waiting to be
    uploaded: committed here by this store's engine, never published, and newer than the
    store's newest (an upload that failed or was cut by a crash; the next save uploads it, as
    its ``UploadFailed`` said). Any other spooled step -- published once and since deleted from
    the store (a store wiped or replaced at the same address), or written for another store
    (a ``spool=`` shared by two stores, a spool without a record) -- would otherwise refuse a
    lower save ("steps must increase") and be resumed from as if the store held it: it is
    renamed to ``.orphaned-<name>-<token>`` in the spool (kept, never loaded, logged), not
    deleted. The record is then rewritten for this store.
    """

    identity = tier.identity()
    record = _read_record(spool)
    same = record is not None and record.get("store") == identity
    published = set(record.get("published") or []) if record is not None and same else set()
    remote = {c.step for c in store.committed(layout)}
    newest = max(remote, default=-1)
    moved = []
    kept = set()
    for c in _layout.scan(spool, layout):
        pending = same and c.step not in published and c.step > newest
        if c.step in remote or pending:
            kept.add(c.step)
            continue
        aside = spool / f"{ORPHAN_PREFIX}{_layout._unsearchable(c.path.name)}-{new_token()}"
        rename(c.path, aside)
        moved.append(aside.name)
    if moved:
        fsync_dir(spool)
        log.warning(
            "the spool %s held steps that %s does not have and that were not waiting to be "
            "uploaded (a store wiped or replaced at the same address, or a spool shared with "
            "another store); moved aside, not used: %s",
            spool,
            tier.url,
            moved,
        )
    _write_record(spool, identity, kept & remote, tier.url)  # what is pending stays unpublished
    return moved


# ---------------------------------------------------------------------- the upload queue
# Committed steps waiting for their upload to an object store, uploaded in order by one thread.
#
# The worker commits a step on the local disk, hands its upload here and goes on with the next
# save: an upload never holds a save while fewer than ``bound`` steps wait (the one uploading
# included). At the bound, ``put`` waits for room and says so in the log: the back-pressure that
# keeps the local disk from filling with steps the store has not taken. What waits is a step
# number and the work that uploads it (the files stay on the local disk), never the state's
# bytes. ``steps()`` are what a local prune must keep.


def check_queue_bound(bound: object) -> None:
    """``ValueError`` unless ``bound`` is an int >= 1 (``max_queued_uploads``)."""
    if type(bound) is not int or bound < 1:
        raise ValueError(f"max_queued_uploads must be an int >= 1, got {bound!r}")


class UploadQueue:
    """Up to ``bound`` committed steps waiting to upload to ``url``; ``work`` runs each in
    order on one thread (it reports its own outcome and must not raise)."""

    def __init__(self, bound: int, url: str) -> None:
        check_queue_bound(bound)
        self.bound = bound
        self.url = url
        self._cond = threading.Condition()
        self._todo: deque[tuple[int, Callable[[], None]]] = deque()
        self._pending: list[int] = []  # queued or uploading, oldest first
        self._thread: threading.Thread | None = None

    def put(self, step: int, work: Callable[[], None]) -> float:
        """Queue ``step``'s upload; returns the seconds waited for room (0.0 below the bound)."""
        t0 = time.perf_counter()
        with self._cond:
            if len(self._pending) >= self.bound:
                log.warning(
                    "asyncckpt: %d committed step(s) %s wait to upload to %s "
                    "(max_queued_uploads=%d): the worker waits for room before step %d, and "
                    "the next save waits for its staging slot behind it",
                    len(self._pending),
                    self._pending,
                    self.url,
                    self.bound,
                    step,
                )
            while len(self._pending) >= self.bound:
                self._cond.wait()
            self._pending.append(step)
            self._todo.append((step, work))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="asyncckpt-upload", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()
        waited = time.perf_counter() - t0
        if waited > 0.01:
            log.info("asyncckpt: step %d waited %.2f s for room to upload", step, waited)
        return waited

    def steps(self) -> set[int]:
        """The steps queued or uploading: committed locally, not yet in the store."""
        with self._cond:
            return set(self._pending)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._todo:
                    self._cond.wait()
                step, work = self._todo.popleft()
            try:
                work()
            except BaseException:  # noqa: BLE001 - work reports its own; never lose the thread
                log.exception("asyncckpt: the upload of step %d failed unreported", step)
            finally:
                with self._cond:
                    self._pending.remove(step)
                    self._cond.notify_all()

"""The one pruner, over any ``Store``: read what is committed, plan with ``retention``, delete.

The engine's worker, the remote tier, the CLI (a path or a URL) and ``prune_exports``'s
retention rules all come through ``prune``: the same tracker-lag check, the same verification
of a kept checkpoint before anything is deleted, the same protection of the step just committed.
Below, the local store's way of deleting; an object store deletes its marker first instead.

Deleting a checkpoint is two steps. First an atomic rename to a trash name in the same root
(``layout.trash_name``) followed by an fsync of the root: from that moment the checkpoint is out
of the namespace, so a half-deleted one is never listed, loaded or named by the tracker. Then
the trash tree is removed without following symlinks (a link inside a checkpoint is unlinked,
its target survives) and without leaving the root. A crash between the two leaves trash that
``clean_leftovers`` removes at the next start.

Pruning runs strictly after the commit of the newest checkpoint (invariant 3): ``prune`` refuses
when the tracker does not name the newest committed checkpoint, because then a commit is still
in progress or the root is in a state no policy should act on.

Pruning never leaves a root without a checkpoint that verifies against its manifest: before
deleting anything, ``prune`` checks the kept checkpoints newest first until one verifies; if
none does, it also keeps the newest deletion candidate that verifies (reason
``"newest that verifies"``), and if nothing in the root verifies it refuses to delete anything.
A checkpoint in ``trusted`` counts as verified without reading it: the engine's worker trusts
the checkpoint the tracker names, which it committed itself a moment earlier after checksumming
every byte as it wrote them -- reading it back at every prune would cost a full read of the
newest checkpoint per save. The CLI trusts nothing and reads (``--no-verify`` skips the check).

Peak disk use: with a policy keeping ``K`` checkpoints (protections included), the root holds at
most ``K + 1`` committed checkpoints between a commit and the prune that follows it, plus every
checkpoint still in flight (temporary directories) and trash not yet removed -- i.e. roughly
``(K + 1 + in_flight) * checkpoint_size``. ``disk_usage`` measures what is actually there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from asyncckpt.core import layout as L
from asyncckpt.core.layout import detect_layout  # re-exported: prune.detect_layout is public
from asyncckpt.errors import CheckpointError
from asyncckpt.retention import (
    CheckpointInfo,
    MissingMetricWarning,
    PrunePlan,
    RetentionPolicy,
    plan_prune,
)
from asyncckpt.storage.base import Store
from asyncckpt.storage.local import LocalStore, read_checkpoint_info, tree_size
from asyncckpt.storage.localfs import direct_child
from asyncckpt.storage.manifest import manifest_bytes

if TYPE_CHECKING:
    from asyncckpt.core.progress import Progress

__all__ = [
    "PruneRefused",
    "PruneResult",
    "read_checkpoint_info",
    "list_checkpoints",
    "detect_layout",
    "trash_and_delete",
    "clean_leftovers",
    "quarantine",
    "list_quarantined",
    "Quarantined",
    "prune",
    "report_warnings",
    "disk_usage",
]

#: The reason given to a checkpoint kept only because no kept one verifies.
NEWEST_THAT_VERIFIES = "newest that verifies"

log = logging.getLogger(__name__)

_READ_TRACKER = object()  # sentinel: "read the tracker from the store"


def as_store(root: Store | str | os.PathLike) -> Store:
    """``root`` itself if it is a store, else the ``LocalStore`` of the path."""
    return root if isinstance(root, Store) else LocalStore(root)


class PruneRefused(CheckpointError):
    """Pruning would not be safe now (e.g. the tracker lags the newest committed checkpoint)."""


@dataclass(frozen=True)
class PruneResult:
    """``deleted``: steps removed (or that would be, on a dry run); ``kept``: step -> reasons;
    ``errors``: step -> message for deletions that failed after the trash rename (the trash is
    removed at the next ``clean_leftovers``); ``warnings``: key -> message, things the user must
    hear (a policy's metric missing from checkpoints, a kept checkpoint that fails its manifest);
    ``corrupt``: step -> problems of the checkpoints found failing their manifest;
    ``gone``: steps to delete that another process (the engine's own prune) deleted first."""

    deleted: list[int]
    kept: dict[int, list[str]]
    dry_run: bool = False
    errors: dict[int, str] = field(default_factory=dict)
    warnings: dict[str, str] = field(default_factory=dict)
    corrupt: dict[int, list[str]] = field(default_factory=dict)
    gone: list[int] = field(default_factory=list)


def report_warnings(
    result: PruneResult | None, seen: set[str] | None = None, *, stacklevel: int = 2
) -> list[str]:
    """``warnings.warn`` (one channel, not the logger too) for each of ``result.warnings``
    whose key is not in ``seen``; adds the keys to ``seen``. Returns the messages emitted.

    The engine calls it with its own ``seen`` set when the worker's report arrives, so each
    policy/metric is warned about once per engine, in the trainer's process."""
    out = []
    for key, message in (getattr(result, "warnings", None) or {}).items():
        if seen is not None:
            if key in seen:
                continue
            seen.add(key)
        category = UserWarning if key.startswith("corrupt:") else MissingMetricWarning
        warnings.warn(message, category, stacklevel=stacklevel + 1)
        out.append(message)
    return out


def list_checkpoints(root: Store | str | os.PathLike, layout: str) -> list[CheckpointInfo]:
    """Every committed checkpoint of ``root`` (a store or a path), oldest first; one pruned
    between the listing and the read of its manifest (by the engine's worker) is left out."""
    store = as_store(root)
    out = []
    for c in store.committed(layout):
        try:
            out.append(store.describe(c))
        except FileNotFoundError:
            if store.exists(c.name):
                raise
    return out


def delete(store: Store, name: str) -> None:
    """Take ``name`` out of the namespace (trash rename, or the marker deleted first), then
    reclaim its space; the fault point between the two is ``store.points.retire``."""
    from asyncckpt import faults  # looked up at the call (tests swap or stub the module)

    retired = store.retire(name)
    point = getattr(faults, "point", None)
    if point is not None and store.points.retire is not None:
        point(store.points.retire)
    store.reclaim(retired)


def trash_and_delete(root: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename ``path`` (a direct child of ``root``) to a trash name, fsync ``root``, remove it.

    The rename is the deletion as far as readers go; the removal is only reclaiming space.
    """
    store = LocalStore(root)
    path = Path(path)

    direct_child(store.root, path)  # ValueError for anything but a direct child
    delete(store, path.name)


@dataclass(frozen=True)
class Quarantined:
    """A checkpoint moved into ``<root>/.quarantine/``: ``step`` and ``name`` it had,
    ``path`` where it is now, ``problems`` found, ``at`` when (None: its note is missing)."""

    step: int | None
    name: str
    path: Path
    problems: list[str]
    at: float | None


def quarantine(root: str | os.PathLike, path: str | os.PathLike, problems: list[str]) -> Path:
    """Move the committed checkpoint ``path`` (a direct child of ``root``) that fails its
    manifest into ``root/.quarantine/``, with a note of why; returns where it went.

    A rename within the root: nothing is deleted, the directory just stops being a checkpoint
    (no scan lists it), so retention and the forward check of steps no longer count it. To
    put one back, move it to its old name (``python -m asyncckpt ls`` lists them).
    """

    store = LocalStore(root)
    path = direct_child(store.root, Path(path))
    return Path(store.quarantine(path.name, problems))


def list_quarantined(root: str | os.PathLike, layout: str) -> list[Quarantined]:
    """The checkpoints quarantined under ``root`` (``quarantine``), oldest first."""
    qdir = Path(root) / L.QUARANTINE_DIR
    try:
        entries = [e for e in os.scandir(qdir) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for e in entries:
        try:
            note = json.loads((qdir / f"{e.name}{L.QUARANTINE_INFO_SUFFIX}").read_text())
            name, at = str(note["name"]), float(note["quarantined_at"])
            problems = [str(p) for p in note.get("problems", [])]
        except (OSError, ValueError, KeyError, TypeError):
            name, at, problems = e.name, None, []
        step = L.parse_dir_name(layout, name)
        out.append(Quarantined(step, name, Path(e.path), problems, at))
    out.sort(key=lambda q: (q.at or 0.0, q.path.name))
    return out


def clean_leftovers(root: Store | str | os.PathLike, layout: str | None = None) -> list[str]:
    """Remove temporaries and trash left by a crash (on an object store: prefixes without a
    marker); returns the names removed.

    Call it only at start, while holding the root's lock: a temporary of a save in flight looks
    exactly like a leftover. Failures are logged and skipped (they are retried next start).
    """
    store = as_store(root)
    if layout is None and not isinstance(store, LocalStore):  # (a local root's are layout-free)
        layout = store.detect_layout()
    return store.clean_leftovers(layout)  # type: ignore[arg-type]


def prune(
    root: Store | str | os.PathLike,
    layout: str,
    policy: RetentionPolicy | None,
    *,
    tracker_step: int | None | object = _READ_TRACKER,
    resumed_from: int | None = None,
    pinned: Iterable[int] = (),
    in_use: Iterable[int] = (),
    run_id: str | None = None,
    scope: str = "all",
    dry_run: bool = False,
    allow_tracker_lag: bool = False,
    verify: bool = True,
    trusted: Iterable[int] = (),
    progress: Progress | None = None,
    warn: bool = True,
    committed_step: int | None = None,
    deleting: Callable[[], contextlib.AbstractContextManager[Container[int]]] | None = None,
) -> PruneResult:
    """Apply ``policy`` to the committed checkpoints of ``root`` (a ``Store``, or a path).

    ``tracker_step`` defaults to the store's tracker. Refuses (``PruneRefused``) when the
    tracker does not name the newest committed checkpoint -- a commit may be in progress, and
    pruning runs strictly after it -- unless ``allow_tracker_lag=True``. Deletions take the
    checkpoint out of the namespace first (``delete``); one that fails is reported in
    ``errors`` and the rest go on.

    Before deleting anything, at least one kept checkpoint must verify against its manifest
    (see the module docstring): ``trusted`` steps count as verified unread, ``verify=False``
    skips the check, ``progress`` is told about the bytes read. ``warn=False`` leaves the
    result's ``warnings`` to the caller (the worker: the engine reports them in the trainer).
    ``committed_step``: the step whose commit this prune follows, never deleted (and nothing
    above it: ``retention.plan_prune``).
    ``deleting``: held around each deletion, yields the steps pinned by then (another
    process's ``engine.protect`` while this one read: ``pinfile.deleting``); one is kept.
    """
    store = as_store(root)
    L.check_layout(layout)
    if tracker_step is _READ_TRACKER:
        tracker_step = store.read_tracker()
    if tracker_step is not None and not isinstance(tracker_step, int):
        raise TypeError(f"tracker_step must be an int or None, got {tracker_step!r}")
    names = {c.step: c.name for c in store.committed(layout)}
    checkpoints = [c for c in list_checkpoints(store, layout) if c.step in names]
    if checkpoints and not allow_tracker_lag:
        newest = checkpoints[-1].step
        if tracker_step != newest:
            raise PruneRefused(
                f"tracker names step {tracker_step} but the newest committed checkpoint in "
                f"{store.url} is {newest}; refusing to prune until the tracker catches up"
            )
    plan = plan_prune(
        checkpoints,
        policy,
        tracker_step=tracker_step,
        resumed_from=resumed_from,
        pinned=pinned,
        in_use=in_use,
        run_id=run_id,
        scope=scope,
        committed_step=committed_step,
    )
    notes = dict(plan.warnings)
    corrupt: dict[int, list[str]] = {}
    if verify and plan.delete:
        plan = _keep_one_that_verifies(store, names, plan, set(trusted), corrupt, progress)
        notes.update(_corrupt_notes(plan, corrupt))
    if warn:
        report_warnings(PruneResult([], {}, warnings=notes))
    if dry_run:
        return PruneResult(
            list(plan.delete), plan.keep, dry_run=True, warnings=notes, corrupt=corrupt
        )
    deleted, errors, gone = [], {}, []
    kept = plan.keep
    for step in plan.delete:
        with deleting() if deleting is not None else contextlib.nullcontext(()) as pinned_now:
            if step in pinned_now:
                kept = dict(sorted({**kept, step: ["protected"]}.items()))
                continue
            try:
                delete(store, names[step])
            except OSError as e:
                if isinstance(e, FileNotFoundError) and not store.exists(names[step]):
                    # Deleted meanwhile by another pruner (the engine's worker after a
                    # commit, racing the CLI): what was asked for is done, not an error.
                    log.info("asyncckpt: step %s was already deleted by another process", step)
                    gone.append(step)
                    continue
                log.warning("asyncckpt: pruning step %s failed: %s", step, e)
                errors[step] = str(e)
                continue
        deleted.append(step)
    return PruneResult(deleted, kept, errors=errors, warnings=notes, corrupt=corrupt, gone=gone)


def _keep_one_that_verifies(
    store: Store,
    names: dict[int, str],
    plan: PrunePlan,
    trusted: set[int],
    corrupt: dict[int, list[str]],
    progress: Progress | None,
) -> PrunePlan:
    """``plan``, or ``plan`` keeping also the newest deletion candidate that verifies when no
    kept checkpoint does; ``PruneRefused`` when nothing verifies. Fills ``corrupt``."""

    def verifies(step: int) -> bool:
        if step in trusted:
            return True
        name = names[step]
        if progress is not None:
            try:
                total = manifest_bytes(store.read_manifest(name))
            except (CheckpointError, OSError, ValueError):
                total = 0
            progress.begin(f"verifying step {step}", total, 1)
        problems = store.check(name, progress.advance if progress is not None else None)
        if progress is not None:
            progress.checkpoint_done(step, not problems)
            progress.end()
        if problems:
            corrupt[step] = problems  # reported by the caller (warnings, CLI, JSON)
        return not problems

    # Trusted ones first: the one the worker just committed verifies without a read, even
    # when a higher (older run's) step is kept too (allow_older_steps).
    for step in sorted(plan.keep, key=lambda s: (s in trusted, s), reverse=True):
        if verifies(step):
            return plan
    for step in sorted(plan.delete, reverse=True):
        if verifies(step):
            keep = dict(plan.keep)
            keep[step] = [NEWEST_THAT_VERIFIES]
            delete = [s for s in plan.delete if s != step]
            return PrunePlan(dict(sorted(keep.items())), delete, plan.warnings)
    details = "; ".join(f"step {s}: {p[0]}" for s, p in sorted(corrupt.items())[-3:])
    raise PruneRefused(
        f"no checkpoint in {store.url} verifies against its manifest ({details}); refusing to "
        "delete any (verify=False, or --no-verify on the command line, prunes without this check)"
    )


def _corrupt_notes(plan: PrunePlan, corrupt: dict[int, list[str]]) -> dict[str, str]:
    """Warnings for kept checkpoints found failing their manifest."""
    rescued = [s for s, why in plan.keep.items() if NEWEST_THAT_VERIFIES in why]
    out = {}
    for step, problems in sorted(corrupt.items()):
        if step not in plan.keep:
            continue
        also = f"; also keeping step {rescued[0]}, the newest that verifies" if rescued else ""
        out[f"corrupt:{step}"] = (
            f"step {step} (kept: {', '.join(plan.keep[step])}) fails its manifest: "
            f"{'; '.join(problems)}{also}"
        )
    return out


def disk_usage(root: str | os.PathLike, layout: str | None = None) -> dict[str, int]:
    """Measured bytes: ``committed`` checkpoints, ``leftovers`` (temporaries in flight or left by a
    crash, and trash), ``quarantined`` checkpoints (found corrupt, moved aside, still on disk)
    and the filesystem's ``free`` and ``total`` (``shutil.disk_usage``)."""
    root = Path(root)
    layout = layout or detect_layout(root)
    dirs = L.scan(root, layout)
    seen: set[tuple[int, int]] = set()  # differential saves' hard links count once
    committed = sum(tree_size(c.path, seen) for c in dirs)
    leftovers = 0
    for entry in os.scandir(root):
        if L.is_leftover(entry.name):
            p = Path(entry.path)
            leftovers += tree_size(p) if entry.is_dir(follow_symlinks=False) else 0
    quarantined = sum(tree_size(q.path, seen) for q in list_quarantined(root, layout))
    du = shutil.disk_usage(root)
    return {
        "committed_bytes": committed,
        "leftover_bytes": leftovers,
        "quarantined_bytes": quarantined,
        "checkpoints": len(dirs),
        "free_bytes": du.free,
        "total_bytes": du.total,
    }

"""Commit: the only step that makes a checkpoint visible, written once over a ``Store``.

Order (invariant 1): files durable in a temporary -> ``seal`` (locally the fsync of the
temporary directory; on an object store the upload of every file) -> ``publish`` (an atomic
rename to the final name and the fsync of the root; on an object store the marker, last) ->
tracker rewritten, forward only (temp file, fsync, rename, fsync of the root). A crash anywhere
leaves either the old state or the new one, plus leftovers that ``clean_leftovers`` removes at
the next start.

The same order serves the worker (``commit_step``), the trainer finishing a commit its worker
left before the tracker (``finish_commit``), the remote tier (``publish_committed``) and the HF
export (``publish``, and ``publish_replacing`` for a step exported again, ``export.py``). The fault points (docs/faults.md)
are announced here, between the store's primitives, under the names ``store.points`` gives.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from asyncckpt import faults
from asyncckpt.core import layout as _layout
from asyncckpt.storage.base import Store
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.localfs import fsync_dir, new_token, remove_tree, write_synced
from asyncckpt.storage.manifest import write_manifest

log = logging.getLogger("asyncckpt.storage.commit")

__all__ = [
    "commit_step",
    "every_rank_wrote",
    "finish_commit",
    "new_token",
    "publish",
    "publish_committed",
    "publish_replacing",
    "remove_tree",
    "rename_into_place",
    "write_synced",
    "write_tracker",
    "advance_tracker",
    "remove_tracker",
]


def _store(root: Store | Path | str) -> Store:
    return root if isinstance(root, Store) else LocalStore(root)


def _seal(
    store: Store, staged: Path, name: str, on_file: Callable[[int], None] | None = None
) -> int:
    """Seal ``staged`` (its ``file`` fault point after each file), then announce ``publish``."""
    point = store.points.file
    hook = on_file
    if point is not None:

        def hook(size: int) -> None:
            if on_file is not None:
                on_file(size)
            faults.point(point)

    nbytes = store.seal(staged, name, hook)
    if store.points.publish is not None:
        faults.point(store.points.publish)
    return nbytes


def publish(
    store: Store, staged: Path, name: str, on_file: Callable[[int], None] | None = None
) -> int:
    """Seal ``staged`` and publish it as ``name``: the commit proper without its tracker."""
    nbytes = _seal(store, staged, name, on_file)
    store.publish(staged, name)
    return nbytes


def publish_replacing(store: LocalStore, staged: Path, name: str) -> None:
    """``publish``, replacing a committed ``name`` (the HF export of a step exported again):
    sealed, the old one retired (renamed to trash), the new one published, the old one
    reclaimed. A publish that fails puts the old one back; a crash between the two renames
    leaves neither (never a mix) and the trash as a leftover."""
    if not store.exists(name):
        publish(store, staged, name)
        return
    _seal(store, staged, name)
    retired = store.retire(name)
    try:
        store.publish(staged, name)
    except BaseException:
        store.unretire(retired, name)
        raise
    try:
        store.reclaim(retired)
    except OSError as e:  # published already; the next prune removes the trash
        log.warning("asyncckpt: could not remove the replaced %s: %s", retired, e)


def commit_step(
    root: Store | Path,
    layout: str,
    step: int,
    tmp_dir: Path,
    final_dir: Path,
    manifest: dict,
    tracker: bool = True,
) -> None:
    """The commit, one path for one rank and many (rank 0 runs it once every rank's shards
    are durable in ``tmp_dir``): manifest, seal, publish, tracker. ``tracker=False``: a node's
    part of a step across node-local roots, whose tracker waits for every node
    (node_commit.py)."""

    store = _store(root)
    write_manifest(tmp_dir, manifest)
    publish(store, tmp_dir, final_dir.name)
    if tracker:
        write_tracker(store, layout, step)


def every_rank_wrote(
    tmp_dir: Path, written: Mapping[int, dict] | Sequence[dict], leader: int = 0
) -> None:
    """The rank that commits ``tmp_dir`` (``leader``: rank 0 on one root, a node's local rank
    0 on node-local roots, node_commit.py), before it commits: the files the other ranks say
    they wrote (``written``: rank -> names relative to the temporary) reached ``tmp_dir``. A
    rank whose files are absent wrote to another disk (or its files were lost): a commit would
    name a checkpoint nobody can load, so it fails the save on every rank. (None of a rank's
    files, not any: a name can be a temporary the format renamed since.)"""
    items = written.items() if isinstance(written, Mapping) else enumerate(written)
    absent = [
        (r, sorted(names))
        for r, names in items
        if r != leader and names and not any((tmp_dir / n).is_file() for n in names)
    ]
    if not absent:
        return
    few = "; ".join(
        f"rank {r}: {', '.join(n[:3])}{' ...' if len(n) > 3 else ''}" for r, n in absent
    )
    raise FileNotFoundError(
        f"rank {leader}'s root {tmp_dir.parent} has none of the files other ranks wrote "
        f"({few}): their root is another disk (node-local storage), or the files were lost. "
        "Save to one root every rank writes, or say that each node has its own "
        '(Distributed(storage="local") with torchrun\'s GROUP_RANK/LOCAL_WORLD_SIZE, or '
        "node_rank=/ranks_per_node=): each node then commits its own directory"
    )


def rename_into_place(tmp_dir: Path, final_dir: Path) -> None:
    """Atomically publish ``tmp_dir`` as ``final_dir`` (which must not exist)."""
    publish(LocalStore(final_dir.parent), tmp_dir, final_dir.name)


def write_tracker(root: Store | Path, layout: str, step: int) -> bool:
    """Point the tracker file(s) at ``step``, forward only; False if it names a newer step."""
    store = _store(root)
    if store.points.tracker is not None:
        faults.point(store.points.tracker)
    return store.write_tracker(layout, step)


def finish_commit(root: LocalStore | Path, layout: str, step: int) -> bool:
    """The last step of a commit its worker left (renamed into place, no tracker yet), done by
    the trainer: the root's names made durable, then the tracker, forward only. No fault point
    fires (the worker's ``before_tracker`` is what left it)."""
    store = root if isinstance(root, LocalStore) else LocalStore(root)
    fsync_dir(store.root)  # the rename is durable before the tracker names it
    return store.write_tracker(layout, step)


def advance_tracker(root: Store | Path, layout: str, step: int) -> bool:
    """``write_tracker`` without its fault point."""
    return _store(root).write_tracker(layout, step)


def remove_tracker(root: LocalStore | Path, layout: str) -> None:
    """Delete the tracker file(s) of a local root (it names no checkpoint left there)."""
    store = root if isinstance(root, LocalStore) else LocalStore(root)
    for name in _layout.tracker_names(layout):
        with contextlib.suppress(FileNotFoundError):
            store.delete(name)


def publish_committed(
    store: Store, local_dir: Path, name: str, layout: str, step: int | None
) -> int:
    """Publish a checkpoint committed in a local root to another store (the remote tier):
    seal (upload), publish (marker last), and, with ``step``, its tracker. Returns the bytes."""
    nbytes = publish(store, local_dir, name)
    if step is not None:
        write_tracker(store, layout, step)
    return nbytes

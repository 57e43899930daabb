"""Recovery on node-local storage (``Distributed(storage="local")`` with
``MemoryTier(replicas=1)``): which step every rank loads, and how the ranks of a replacement
node fetch their files from the peer that holds their replica. The design is in
docs/how-to/node-loss.md; this module holds its pieces that stand alone (local_load.py runs
them at ``load_latest``).

What a checkpoint is on node-local storage: every node's root is its own disk and holds, for
step ``s``, a committed step directory with the files *its* ranks wrote and a manifest over
them. Step ``s`` is a checkpoint of the run when every rank can get its files of ``s``: from
its own node's root, or from the replica of them a peer holds. (Each node's local rank 0
commits its node's directory of a step, node_commit.py; the engine does not use this module's
recovery pieces yet.)

Where a replica lives after the trainers died: the holder's stand-ins for the dead node's
ranks commit that node's directory into *the holder's own* root, under
``.asyncckpt-replicas/node<n>/<step dir>/`` (``replica_root``: files and a manifest, renamed
into place whole by the usual node commit; never a checkpoint of the holder's node: no scan of
its root lists it, its pruning never touches it).
Not served from the holder's memory: a worker lives as long as its trainer (and
``hold_seconds`` after it at most); the replacement node may take minutes to come, the
holder's own trainer restarts meanwhile, and its new worker starts with empty memory. The
node's disk survives that restart, the bytes are written once at the trainers' death (never
in steady state), and a node holds them only while its peer may need them.

Which step every rank loads (``which_step_to_load``): the newest step every rank can get, each
rank from its own disk if it has it there, else from its replica; never a mix of steps. If no
such step is newer than what every rank has on its own disk, that disk step, and the choice
says so (``LoadChoice.reason``). If no step can be had by every rank, none (the engine must
refuse to start some ranks fresh while others resume).

The fetch (``ReplicaServer``, ``fetch_replica``, ``commit_fetched``): the holder node's local
rank 0 serves its root's replica directories over TCP during the load's agreement (framing.py:
JSON headers, the files' bytes raw, nothing unpickled; its address in the side store); the
replacement node's local rank 0 asks for (node, step), receives the manifest and then every
file it lists into a temporary of its own root, and checks every checksum before anything is
kept; then commits them with the usual commit (manifest, rename, tracker): a cut connection
or a wrong byte leaves nothing committed.
Both sides prove the run's secret first (framing.py). The server serves only the replica
directories its root holds committed, and only files inside them; the fetching side checks
every name the manifest gives before it opens anything (relative, no ``..``, resolving inside
its temporary), creates each file new, and removes what it wrote when anything fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncckpt.cluster.framing import (
    AuthError,
    Message,
    expect,
    handshake_client,
    handshake_server,
    listen,
    recv_into,
    recv_msg,
    send_msg,
)
from asyncckpt.core import layout as _layout
from asyncckpt.storage.commit import commit_step, remove_tracker
from asyncckpt.storage.local import LocalStore
from asyncckpt.storage.localfs import fsync_dir, fsync_file, mkdir, remove_tree, rmdir_if_empty
from asyncckpt.storage.manifest import check_files, read_manifest

log = logging.getLogger("asyncckpt")

#: Under a node's root: the replicas its workers hold for peers of other nodes.
REPLICAS_DIR = ".asyncckpt-replicas"
#: Bytes read and sent per piece.
CHUNK = 8 << 20
#: What the fetch's handshake proves (framing.py): the run's secret, for this use.
FETCH_SERVICE = "replica-fetch"


def replica_root(root: str | os.PathLike, node: int) -> Path:
    """Where a node's root keeps what it holds of node ``node``'s ranks: a root of its own
    (step directories, tracker), written by the stand-ins of those ranks at the trainers'
    death with the usual node commit (replication.stand_in_config). Per node, not per rank:
    a node's ranks all send to the same next node, and the node commit checks every rank of
    a node wrote into one directory."""
    return Path(root) / REPLICAS_DIR / f"node{node}"


def replica_dir(root: str | os.PathLike, layout: str, node: int, step: int) -> Path:
    """Where a node's root keeps its replica of node ``node``'s directory of ``step``."""
    return replica_root(root, node) / _layout.dir_name(layout, step)


def replica_roots(root: str | os.PathLike) -> list[Path]:
    """Every ``replica_root`` under a node's root (committed replicas or not)."""
    base = Path(root) / REPLICAS_DIR
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [
        Path(e.path)
        for e in entries
        if e.name.startswith("node") and e.name[4:].isdigit() and e.is_dir(follow_symlinks=False)
    ]


def held_replicas(root: str | os.PathLike, layout: str) -> dict[int, list[int]]:
    """The replicas a node's root holds whole (committed: renamed into place with their
    manifest): node -> steps."""
    out: dict[int, list[int]] = {}
    for held in replica_roots(root):
        steps = [c.step for c in _layout.scan(held, layout)]
        if steps:
            out[int(held.name[4:])] = steps
    return out


# ------------------------------------------------------------------ which step to load


@dataclass(frozen=True)
class LoadChoice:
    """The step every rank loads (None: no step every rank can get), which ranks fetch it
    from a replica (rank -> the rank whose node holds it), and why, in one line for the log
    and the load report. ``fell_back``: a newer step exists somewhere but not for every rank."""

    step: int | None
    fetch: dict[int, int] = field(default_factory=dict)
    fell_back: bool = False
    reason: str = ""


def which_step_to_load(
    on_disk: Mapping[int, Iterable[int]],
    replicas: Mapping[int, tuple[int, Iterable[int]]],
    world_size: int,
) -> LoadChoice:
    """``on_disk``: each rank's committed steps on its own node's root; ``replicas``: rank ->
    (the rank holding its replica, the steps held). A rank's own disk wins over its replica."""
    own = {r: set(on_disk.get(r, ())) for r in range(world_size)}
    rep = {r: set(replicas[r][1]) if r in replicas else set() for r in range(world_size)}
    gettable = [own[r] | rep[r] for r in range(world_size)]
    common = set.intersection(*gettable) if gettable else set()
    seen = set().union(*gettable) if gettable else set()
    newest = max(seen, default=None)
    if not common:
        lacking = [r for r in range(world_size) if not gettable[r]]
        why = (
            f"rank(s) {lacking} have no step on their node's disk and no replica on a peer"
            if lacking
            else "no step is on every rank's disk or replica"
        )
        return LoadChoice(None, {}, newest is not None, f"no step every rank can load: {why}")
    step = max(common)
    fetch = {r: replicas[r][0] for r in range(world_size) if step not in own[r]}
    where = (
        f"ranks {sorted(fetch)} from their replicas on a peer, the others from their own disk"
        if fetch
        else "every rank from its own disk"
    )
    if newest is not None and newest > step:
        missing = [r for r in range(world_size) if newest not in gettable[r]]
        why = f"step {newest} is neither on the disks of rank(s) {missing} nor replicated"
        return LoadChoice(step, fetch, True, f"{why}: every rank loads step {step} ({where})")
    return LoadChoice(step, fetch, False, f"every rank loads step {step} ({where})")


def replicas_not_needed(
    step: int,
    on_disk: Mapping[int, Iterable[int]],
    held: Mapping[int, Mapping[int, Iterable[int]]],
    per: int,
    world_size: int,
) -> dict[int, dict[int, list[int]]]:
    """Which replicas no node can need any more once every rank loaded ``step`` (the
    agreement's choice; every node then holds it on its own disk): holder rank -> node ->
    steps. ``held``: holder rank -> node -> the steps it holds of that node's directories.

    A replica of node ``n``'s step ``t`` is kept while ``t`` could still be a step every rank
    loads: ``t`` is ``step``, or older and every rank outside node ``n`` can still get it (its
    own disk or a replica). Dropped: a step newer than ``step`` (the run goes on from
    ``step`` and saves those steps again: a replica of the old one beside the new ones would
    be a mix of two runs), and an older step some other rank no longer has (its node pruned
    it; it never comes back). So a node holds a peer's directories only while the retention
    of the other nodes keeps those steps, and at most until the next load after that."""
    gettable = {r: set(on_disk.get(r, ())) for r in range(world_size)}
    for by_node in held.values():
        for node, steps in by_node.items():
            for r in range(int(node) * per, (int(node) + 1) * per):
                gettable.setdefault(r, set()).update(steps)
    out: dict[int, dict[int, list[int]]] = {}
    for holder, by_node in held.items():
        for node, steps in by_node.items():
            others = [r for r in range(world_size) if r // per != int(node)]
            gone = sorted(
                t
                for t in set(steps)
                if t > step or (t < step and any(t not in gettable[r] for r in others))
            )
            if gone:
                out.setdefault(holder, {})[int(node)] = gone
    return out


def drop_replicas(
    root: str | os.PathLike, layout: str, drop: Mapping[int, Iterable[int]]
) -> threading.Thread | None:
    """Take the replicas ``drop`` names (node -> steps) out of a node's root, and a node's
    whole ``replica_root`` once nothing of it is left; returns the thread reclaiming their
    space, if any. Each is renamed to a trash name here (from then on no scan lists it); the
    removal runs behind, off the load's critical path: deleting gigabytes of shards file by
    file took as long as the training waited for it. A failure is logged, never raised: the
    load it follows has succeeded, and the next start removes what is left
    (``clean_replica_leftovers``)."""

    retired: list[tuple[Any, Path]] = []
    for node, steps in drop.items():
        held = replica_root(root, node)
        steps = sorted(steps)
        gone: list[tuple[Any, Path]] = []  # (what a failure part-way retired is reclaimed too)
        try:
            store = LocalStore(held)
            for step in steps:
                gone.append((store, store.retire(_layout.dir_name(layout, step))))
            if not _layout.scan(held, layout):  # nothing of it left: tracker, leftovers too
                parent = LocalStore(held.parent)
                gone = [(parent, parent.retire(held.name))]  # (the trash inside goes with it)
            elif _layout.read_tracker(held) in steps:  # (read by no load: never dangling)
                remove_tracker(store, layout)
            log.warning(
                "dropped this node's replica(s) of node %d's step(s) %s: no node can load them "
                "any more",
                node,
                steps,
            )
        except Exception as e:  # noqa: BLE001 - the load succeeded: never failed by this
            log.warning("could not drop the replicas of node %d's steps %s: %s", node, steps, e)
        retired += gone
    if not retired:
        return None
    reclaimer = threading.Thread(
        target=_reclaim, args=(retired,), name="asyncckpt-replica-reclaim", daemon=True
    )
    reclaimer.start()
    return reclaimer


def _reclaim(retired: list[tuple[Any, Path]]) -> None:
    for store, trash in retired:
        try:
            store.reclaim(trash)
        except Exception as e:  # noqa: BLE001 - a leftover the next start removes
            log.warning("could not remove %s (the next start does): %s", trash, e)


def clean_local_root(root: str | os.PathLike, keep: Callable[[str], bool] | None = None) -> None:
    """Remove what a crash left in a local root (temporaries, trash) and in its replicas, said
    in one warning (``keep``: names to leave alone). Only while holding the root's lock."""
    removed = LocalStore(root).clean_leftovers(keep=keep)
    # A stand-in's write cut short, a dropped replica not yet removed.
    removed += clean_replica_leftovers(root)
    if removed:
        log.warning("removed leftovers of an interrupted run in %s: %s", root, removed)


def clean_replica_leftovers(root: str | os.PathLike) -> list[str]:
    """Remove what a crash left of the replicas under a node's root: a stand-in's write cut
    short, a dropped replica (or a whole node's) not yet removed. Only at start, holding the
    root's lock (a temporary in flight looks like a leftover); names relative to ``root``."""

    base = Path(root) / REPLICAS_DIR
    if not base.is_dir():
        return []
    removed = [f"{REPLICAS_DIR}/{n}" for n in LocalStore(base).clean_leftovers()]
    for held in replica_roots(root):
        removed += [f"{held.relative_to(root)}/{n}" for n in LocalStore(held).clean_leftovers()]
    return removed


# ------------------------------------------------------------------ the fetch


class ReplicaServer:
    """A worker's listener serving its node's replica directories (``replica_dir``) to the
    ranks of a replacement node: the manifest, then every file it lists, in its order. A
    client proves the run's ``secret`` first (framing.py); one that does not is refused
    (logged: who, why) before its request is read."""

    def __init__(self, root: str | os.PathLike, layout: str, *, host: str, secret: str) -> None:
        """``host``: the address the node publishes for it (bound there, no other)."""
        if not secret:
            raise ValueError("a replica server needs the run's secret (DistConfig.secret)")
        self.secret = secret
        self.root = Path(root)
        self.layout = layout
        self.listener = listen(host)
        self.served = 0  # replicas sent whole (tests, the log)
        threading.Thread(target=self._serve, name="asyncckpt-replica-serve", daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def _serve(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._one, args=(sock, peer), daemon=True).start()

    def _one(self, sock: socket.socket, peer: Any) -> None:
        with sock:
            try:
                handshake_server(sock, self.secret, FETCH_SERVICE)
            except (EOFError, OSError) as e:
                log.warning("refused a replica fetch from %s: %s", peer, e)
                return
            try:
                ask = expect(recv_msg(sock), "get").header
                node, step = ask.get("node"), ask.get("step")
                # Only what this root holds committed: never a path from the wire.
                if (
                    type(node) is not int
                    or type(step) is not int
                    or step not in held_replicas(self.root, self.layout).get(node, ())
                ):
                    send_msg(sock, {"kind": "missing", "why": f"{node!r}, {step!r}: not held"})
                    return
                where = replica_dir(self.root, self.layout, node, step)
                try:
                    manifest, files = _files_of(read_manifest(where), str(where))
                except Exception as e:  # noqa: BLE001 - told to the asking rank
                    send_msg(sock, {"kind": "damaged", "why": f"{where}: {e}"})
                    return
                short = check_files(where, manifest, quick=True)  # sizes only
                if short:  # said at once: the asking rank would wait for bytes never sent
                    send_msg(sock, {"kind": "damaged", "why": f"{where}: {'; '.join(short)}"})
                    return
                send_msg(sock, {"kind": "manifest", "manifest": manifest})
                for rel, _ in files:
                    fd = os.open(inside(where, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    with open(fd, "rb") as f:
                        sock.sendfile(f)
                self.served += 1
            except (EOFError, OSError, ValueError) as e:
                log.warning("serving a replica failed: %s", e)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()


def fetch_replica(
    address: tuple[str, int], node: int, step: int, into: Path, *, secret: str
) -> dict[str, Any]:
    """Node ``node``'s files of ``step`` from the peer serving them at ``address``, written
    into the temporary ``into`` and made durable; returns their manifest, every file checked
    against its checksum. The peer proves the run's ``secret`` before anything is asked of it
    (AuthError). Every name its manifest gives is checked before any file is opened
    (``checked_name``, ``inside``), and each file is created new (never an existing one
    truncated). Raises if the peer lacks them, a name is not one inside ``into``, the
    connection is cut, or a byte differs; what the fetch wrote into ``into`` is removed then
    (``into`` itself is its owner's to discard)."""
    with socket.create_connection(address, timeout=60.0) as sock:
        try:
            handshake_client(sock, secret, FETCH_SERVICE)
        except AuthError as e:
            raise AuthError(f"the replica server at {address[0]}:{address[1]}: {e}") from None
        send_msg(sock, {"kind": "get", "node": node, "step": step})
        answer = expect(recv_msg(sock), "manifest", "missing", "damaged")
        if answer.kind == "damaged":
            raise OSError(
                f"the peer's replica of node {node}'s step {step} is damaged: {_why(answer)}"
            )
        if answer.kind != "manifest":
            raise FileNotFoundError(f"no replica of node {node}'s step {step}: {_why(answer)}")
        manifest, files = _files_of(answer.header.get("manifest"), f"node {node}'s step {step}")
        made: list[Path] = []  # what this fetch created in ``into``, in order
        try:
            for rel, left in files:
                path = inside(into, rel)
                _make_parents(into, path, made)  # (the temporary's seal makes them durable)
                with open(path, "xb") as f:  # (new: an existing file is never truncated)
                    made.append(path)
                    buf = memoryview(bytearray(min(CHUNK, max(left, 1))))
                    while left:
                        n = min(left, len(buf))
                        recv_into(sock, buf[:n])
                        f.write(buf[:n])
                        left -= n
                fsync_file(path)
            problems = check_files(into, manifest)
            if problems:
                raise OSError(
                    f"node {node}'s step {step} fetched with errors: {'; '.join(problems)}"
                )
        except BaseException:
            _remove(made)
            raise
    fsync_dir(into)
    return manifest


def checked_name(rel: Any) -> str:
    """A file's name as a peer's manifest gives it, checked before anything is opened with
    it: a relative, "/"-separated path with no empty, "." or ".." part, no NUL and no
    backslash. OSError otherwise."""
    if (
        not isinstance(rel, str)
        or not rel
        or rel.startswith("/")
        or "\0" in rel
        or "\\" in rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        raise OSError(f"{rel!r} is not a file name inside its directory: refused")
    return rel


def inside(base: Path, rel: str) -> Path:
    """``base / rel`` for a ``checked_name``, refused (OSError) unless it resolves inside
    ``base`` (a link on the way could lead out)."""
    path = base / checked_name(rel)
    real, root = os.path.realpath(path), os.path.realpath(base)
    if os.path.commonpath([real, root]) != root:
        raise OSError(f"{rel!r} resolves outside {base}: refused as a file name")
    return path


def _make_parents(base: Path, path: Path, made: list[Path]) -> None:
    """Every directory between ``base`` and ``path``, noted in ``made`` if made here."""
    for parent in reversed(path.relative_to(base).parents[:-1]):
        d = base / parent
        if not os.path.lexists(d):
            mkdir(d)
            made.append(d)


def _remove(made: list[Path]) -> None:
    """Undo a fetch's writes: what it made, newest first (its files, then its directories
    once empty)."""
    for path in reversed(made):
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                rmdir_if_empty(path)
            else:
                remove_tree(path)


def _files_of(manifest: Any, what: str) -> tuple[dict[str, Any], list[tuple[str, int]]]:
    """A peer's manifest and its files, in its order: (name, size), each checked before any
    byte of them is read; OSError naming what is wrong."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or not isinstance(files, dict):
        raise OSError(f"the peer sent no manifest of {what}")
    out = []
    for rel, entry in files.items():
        try:
            checked_name(rel)
        except OSError as e:
            raise OSError(
                f"the manifest of {what} names a file outside its directory: {e}"
            ) from None
        size = entry.get("size") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0:
            raise OSError(f"the peer's manifest of {what} gives {rel!r} no size")
        out.append((rel, size))
    return manifest, out


def _why(answer: Message) -> str:
    return str(answer.header.get("why", answer.kind))


def commit_fetched(
    root: Path, layout: str, step: int, tmp: Path, manifests: Iterable[dict[str, Any]]
) -> Path:
    """Commit a node's fetched files of ``step`` in ``tmp`` (each of its ranks' replicas,
    ``manifests``, already checked): one manifest over all of them (the first one's other
    fields), rename, tracker (forward only): the usual commit."""
    import time

    manifests = list(manifests)
    if not manifests or any(m.get("step") != step for m in manifests):
        raise ValueError(f"replicas of other steps than {step} cannot be committed as it")
    files: dict[str, Any] = {}
    for m in manifests:
        files.update(m.get("files", {}))
    manifest = {
        **manifests[0],
        "committed_at": time.time(),
        "bytes": sum(int(f["size"]) for f in files.values()),
        "files": files,
        "fetched_from_replica": True,
    }
    final = root / _layout.dir_name(layout, step)
    commit_step(root, layout, step, tmp, final, manifest)
    return final

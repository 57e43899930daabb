"""The commit of one step across node-local roots (``Distributed(storage="local")`` on more
than one node): each node's root is its own disk, so no one rank can commit the step; each
node's local rank 0 (its *leader*) commits its node's directory, and the step is committed
only when every node did.

The protocol, after every rank wrote its files into its node's temporary and rank 0 gathered
that none failed (worker/loop.py; all over the job's group on the workers' side store, never the
trainers' collectives):

1. Rank 0 broadcasts every rank's result (its files and checksums) and the files it wrote
   once for everyone: DCP's ``.metadata``, a format's global files, and its own shards, which
   hold the tensors every rank holds alike (DCP writes those on rank 0 under node-local
   storage, ``formats.dcp._PassThroughPlanner.replicated_on_rank0``; DCP's default spreads
   them over the ranks, and another node's directory would lack some).
2. Every leader writes those into its temporary (node 0's has them), checks that every rank
   of its node wrote (``commit.every_rank_wrote``: a root that lost files fails the save),
   writes a manifest over its node's files and renames the directory into place: no tracker
   yet, so a node whose commit fails elsewhere takes its directory out again (worker._undo).
3. Rank 0 gathers the leaders' outcomes: any failure fails the save on every rank. Otherwise
   every leader writes its tracker (forward only), and rank 0 gathers those too.

Each node's directory then loads on its own: DCP's metadata names every rank's files, and a
rank reads only its own tensors' (its node's files and rank 0's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from asyncckpt.cluster import dist as _dist
from asyncckpt.storage.localfs import fsync_dir, makedirs, write_synced

__all__ = ["commit_across_nodes", "leads_node", "node_of", "once_files"]

#: One rank's result of writing its part: (error info or None, its files' checksums, paths).
Result = tuple[Any, ...]  # (error, checksums, paths, offered)


def node_of(cfg: _dist.DistConfig, rank: int) -> int:
    return rank // cfg.ranks_per_node


def leads_node(cfg: _dist.DistConfig | None) -> bool:
    """This worker commits its node's directory (node-local roots, local rank 0)."""
    return cfg is not None and cfg.ranks_per_node > 0 and cfg.rank % cfg.ranks_per_node == 0


def once_files(tmp: Path, results: list[Result]) -> dict[str, bytes]:
    """Rank 0's files that the other nodes lack: every file in its temporary that no other
    rank wrote (its own shards, DCP's metadata, a format's global files), nor is another
    rank's by DCP's naming (``__<rank>_...``: a sidecar such as differential fingerprints)."""
    others = {name for _, crcs, *_ in results[1:] for name in crcs}
    theirs = tuple(f"__{r}_" for r in range(1, len(results)))
    out = {}
    for p in sorted(tmp.rglob("*")):
        rel = p.relative_to(tmp).as_posix()
        if p.is_file() and not p.is_symlink() and rel not in others:
            if not p.name.startswith(theirs):
                out[rel] = p.read_bytes()
    return out


def _write_once(tmp: Path, files: Mapping[str, bytes]) -> None:
    for rel, data in files.items():
        path = tmp / rel
        makedirs(path.parent)  # inside the temporary: its seal makes the names durable
        write_synced(path, data)
    fsync_dir(tmp)


def commit_across_nodes(
    pg: Any,
    cfg: _dist.DistConfig,
    tmp: Path,
    results: list[Result] | None,
    publish: Callable[[dict[int, Result]], tuple[str, Any]],
    advance: Callable[[], dict | None],
) -> tuple[str, Any]:
    """Every rank's worker calls this once every rank wrote (``results``: rank 0's gather,
    None elsewhere). ``publish(node_results)``: the leader's manifest over its node's files
    (rank -> result, rank 0's among them for the files it wrote once) and rename, returning
    the outcome; ``advance()``: its tracker, returning None or the error's info. Returns the
    outcome every rank reports."""
    rank = cfg.rank
    plan = _dist.broadcast(pg, None if rank else (results, once_files(tmp, results or [])))
    every, once = plan
    mine: tuple[str, Any] | None = None
    if leads_node(cfg):
        node = node_of(cfg, rank)
        if node:
            try:
                _write_once(tmp, once)
            except BaseException as e:  # noqa: BLE001 - reported on every rank
                mine = ("failed", {"type": type(e).__name__, "message": str(e)})
        if mine is None:
            ranks = range(node * cfg.ranks_per_node, (node + 1) * cfg.ranks_per_node)
            mine = publish({r: every[r] for r in (*ranks, 0)})
    outcome = _agree(pg, cfg, mine, "commit")
    if outcome[0] != "committed":
        return outcome
    advanced = advance() if leads_node(cfg) else None
    told = _agree(pg, cfg, None if advanced is None else ("failed", advanced), "tracker")
    return outcome if told[0] == "committed" else told


def _agree(pg: Any, cfg: _dist.DistConfig, mine: tuple[str, Any] | None, what: str) -> Any:
    """Rank 0 gathers the leaders' outcomes (None: nothing to say) and broadcasts one: its
    own when every node's is "committed", else every failure."""
    said = _dist.gather(pg, mine, cfg.world_size, cfg.rank)
    decided = None
    if said is not None:
        failed = [(r, o[1]) for r, o in enumerate(said) if o is not None and o[0] != "committed"]
        if failed:
            info = _dist.ranks_error(failed)
            info["message"] = f"node-local {what}: " + info["message"]
            decided = ("failed", info)
        else:
            decided = said[0] or ("committed", {})
    return _dist.broadcast(pg, decided)

"""The load on node-local roots of several nodes (``Distributed(storage="local")``): every rank
loads the same step, and a node that lacks it (a replacement node with an empty disk) first
fetches its directory of that step from the node holding its replica. Over the workers' side
store and a TCP connection between the nodes' trainers, never the training's collectives.

The protocol (``StepAgreement.choose``, every rank once per load, in the same order):

1. Each rank publishes the steps its node's root holds committed; each node's local rank 0
   also the replicas its root holds of other nodes' directories
   (``local_recovery.held_replicas``: written there at the trainers' death by the stand-ins,
   replication.py) and, if it holds any, the address of a ``ReplicaServer`` it starts.
2. Rank 0 alone reads every rank's word (N requests, not N^2), decides
   (``which_step_to_load``: the newest step every rank can get from its own disk or its
   node's replica; never a mix of steps) and publishes the choice with the replica servers'
   addresses, which every rank reads.
3. The local rank 0 of each node that lacks that step fetches its node's directory from the
   holder (``fetch_replica``: every checksum checked before anything is kept) and commits it
   into its own root (``commit_fetched``: manifest, rename, tracker), then says so in the
   store; every rank waits for every fetching node's word (the holder keeps serving until
   then). A failed fetch fails the load on every rank, saying which node and why.
4. Every rank counts itself as having read all it needed; rank 0 waits for the count
   before it goes on (its worker serves the store, and its engine may close right after its
   load), then deletes the load's keys: the store does not grow with loads.
5. Each holder deletes the replicas no node can need any more now that every node holds the
   step on its own disk (``local_recovery.replicas_not_needed``, decided by rank 0 with the
   plan): replicas do not pile up on a node's disk with every node lost.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import pickle
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import layout as _layout
from .errors import NoValidCheckpoint
from .hot_agree import wait_count
from .local_recovery import (
    LoadChoice,
    ReplicaServer,
    commit_fetched,
    drop_replicas,
    fetch_replica,
    held_replicas,
    replicas_not_needed,
    which_step_to_load,
)

log = logging.getLogger("asyncckpt")

__all__ = ["Agreed", "StepAgreement"]


@dataclass(frozen=True)
class Agreed:
    """The agreement's outcome for this rank: the choice, and where this rank's bytes come
    from (``source``: "disk" or "replica") and why, for the load report."""

    choice: LoadChoice
    source: str = "disk"
    reason: str = ""


class StepAgreement:
    """The ranks' agreement on the step every rank loads on node-local roots of several
    nodes, with the fetch of a node's replica where its disk lacks that step."""

    def __init__(self, cfg: Any, root: str | Path, layout: str) -> None:
        self.cfg = cfg  # dist.DistConfig (ranks_per_node > 0)
        self.root = Path(root)
        self.layout = layout
        self.loads = 0  # every rank loads as often as the others: one key prefix per load
        self.reclaiming: threading.Thread | None = None  # dropped replicas' space (tests join)

    def choose(self, steps: Iterable[int]) -> Agreed:
        from .dist import side_store

        cfg = self.cfg
        per = cfg.ranks_per_node
        leader = cfg.rank % per == 0
        self.loads += 1
        prefix = f"asyncckpt/{cfg.token}/load-steps/{self.loads}/"
        store = side_store(cfg)
        held = held_replicas(self.root, self.layout) if leader else {}
        server = ReplicaServer(self.root, self.layout) if held else None
        try:
            mine: dict[str, Any] = {"disk": sorted(steps), "held": held, "addr": None}
            if server is not None:
                from .replication import _my_address

                mine["addr"] = [_my_address(cfg), server.port]
            store.set(prefix + str(cfg.rank), json.dumps(mine))
            timeout = datetime.timedelta(seconds=cfg.timeout)
            if cfg.rank == 0:  # rank 0 alone reads every rank's word (N requests, not N^2)
                keys = [prefix + str(r) for r in range(cfg.world_size)]
                store.wait(keys, timeout)
                said = {r: json.loads(store.get(k)) for r, k in enumerate(keys)}
                store.set(prefix + "plan", pickle.dumps(_plan(said, per, cfg.world_size)))
                for k in keys:
                    store.delete_key(k)
            store.wait([prefix + "plan"], timeout)
            choice, addrs, drop = pickle.loads(store.get(prefix + "plan"))
            nodes = sorted({r // per for r in choice.fetch})
            failed: list[str] = []
            done = [f"{prefix}fetched/{n}" for n in nodes]
            if choice.step is not None and nodes:
                self._fetch(store, prefix, choice, addrs, nodes, leader)
                store.wait(done, timeout)
                failed = [store.get(k).decode() for k in done]
                failed = [f for f in failed if f != "ok"]
            # Rank 0's worker serves the store: rank 0 goes on (and may close its engine)
            # only once every rank read all it needs from it; then it removes the load's keys.
            store.add(prefix + "read", 1)
            if cfg.rank == 0 and wait_count(store, prefix + "read", cfg.world_size, cfg.timeout):
                with contextlib.suppress(Exception):  # (kept, if not: a few keys per load)
                    for k in [prefix + "plan", prefix + "read", *done]:
                        store.delete_key(k)
            if failed:
                raise NoValidCheckpoint(
                    f"not loading step {choice.step}: fetching it from a replica failed: "
                    + "; ".join(failed)
                )
            if cfg.rank in drop:  # every node now holds the step: what no node can need
                self.reclaiming = drop_replicas(self.root, self.layout, drop[cfg.rank])
        finally:
            if server is not None:
                server.close()
        if cfg.rank in choice.fetch:
            holder = choice.fetch[cfg.rank]
            why = (
                f"step {choice.step} fetched from node {holder // per}'s replica (rank "
                f"{holder}'s root): this node's disk lacks it; {choice.reason}"
            )
            return Agreed(choice, "replica", why)
        return Agreed(choice, "disk", choice.reason)

    def _fetch(
        self,
        store: Any,
        prefix: str,
        choice: LoadChoice,
        addrs: dict[int, list],
        nodes: list[int],
        leader: bool,
    ) -> None:
        """This node's local rank 0 fetches and commits its node's directory of the step
        chosen, if its node is among ``nodes``; says "ok" or why not in the store."""
        cfg = self.cfg
        node = cfg.rank // cfg.ranks_per_node
        if not leader or node not in nodes:
            return
        from .storage.local import LocalStore

        assert choice.step is not None
        holder = choice.fetch[cfg.rank]
        outcome = "ok"
        local = LocalStore(self.root)
        tmp = local.stage(_layout.dir_name(self.layout, choice.step), "fetch")
        try:
            if holder not in addrs:
                raise FileNotFoundError(f"rank {holder} serves no replica")
            host, port = addrs[holder]
            manifest = fetch_replica((host, int(port)), node, choice.step, tmp)
            commit_fetched(self.root, self.layout, choice.step, tmp, [manifest])
            log.warning(
                "node %d fetched its step %d from rank %d's replica and committed it",
                node,
                choice.step,
                holder,
            )
        except Exception as e:  # noqa: BLE001 - told to every rank, which all refuse
            local.discard(tmp)
            outcome = f"node {node} from rank {holder}: {type(e).__name__}: {e}"
        store.set(f"{prefix}fetched/{node}", outcome)


def _plan(said: dict[int, dict], per: int, world_size: int) -> tuple[LoadChoice, dict, dict]:
    """Rank 0's decision from every rank's word: the step every rank loads, the replica
    servers' addresses (``addrs``: holder rank -> [host, port]), and the replicas each
    holder drops once the load's fetches are done (``replicas_not_needed``)."""
    on_disk = {r: s["disk"] for r, s in said.items()}
    replicas: dict[int, tuple[int, list[int]]] = {}
    addrs = {r: s["addr"] for r, s in said.items() if s["addr"]}
    for holder, s in said.items():
        for node, held_steps in s["held"].items():
            for r in range(int(node) * per, (int(node) + 1) * per):
                replicas[r] = (holder, held_steps)
    choice = which_step_to_load(on_disk, replicas, world_size)
    drop: dict = {}
    if choice.step is not None:
        held = {r: {int(n): t for n, t in s["held"].items()} for r, s in said.items()}
        drop = replicas_not_needed(choice.step, on_disk, held, per, world_size)
    return choice, addrs, drop

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

Every value in the store is JSON, decoded by type (``decode_word``, ``decode_plan``,
``decode_outcome``), never a pickle: the side store takes writes from anyone who reaches it.
A value that is not what this module writes is refused and fails the load (the rank that read
it raises ``NoValidCheckpoint``, saying which key and why; rank 0 refusing a rank's word
publishes its refusal as the plan, so every rank fails at once instead of waiting for a plan).
No rank then picks a step on its own (that could load a mix of steps), nothing is fetched or
dropped, and nothing on any disk changes: loading again is safe.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncckpt.cluster import dist as _dist
from asyncckpt.cluster.local_recovery import (
    LoadChoice,
    ReplicaServer,
    commit_fetched,
    drop_replicas,
    fetch_replica,
    held_replicas,
    replicas_not_needed,
    which_step_to_load,
)
from asyncckpt.cluster.peerdata import Malformed, Reader, SignedStore, dumps, loads
from asyncckpt.core import layout as _layout
from asyncckpt.errors import NoValidCheckpoint
from asyncckpt.memory.hot_agree import wait_count
from asyncckpt.memory.replication import _my_address
from asyncckpt.storage.local import LocalStore

log = logging.getLogger("asyncckpt")

__all__ = ["Agreed", "StepAgreement"]

#: What rank 0 publishes: the choice, the replica servers' addresses (holder rank -> (host,
#: port)) and the replicas each holder drops (holder rank -> node -> steps).
Plan = tuple[LoadChoice, dict[int, tuple[str, int]], dict[int, dict[int, list[int]]]]


@dataclass(frozen=True)
class Word:
    """What one rank says: the steps its node's root holds committed, the replicas it holds
    (node -> steps; a node's local rank 0 only) and its replica server's address, if any."""

    disk: list[int]
    held: dict[int, list[int]]
    addr: tuple[str, int] | None


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
        cfg = self.cfg
        per = cfg.ranks_per_node
        leader = cfg.rank % per == 0
        self.loads += 1
        prefix = f"asyncckpt/{cfg.token}/load-steps/{self.loads}/"
        store = SignedStore(_dist.side_store(cfg), cfg.secret)  # a stranger's value: refused
        held = held_replicas(self.root, self.layout) if leader else {}
        server = None
        if held:  # bound to the address it publishes, and serving the run only
            host = _my_address(cfg)
            server = ReplicaServer(self.root, self.layout, host=host, secret=cfg.secret)
        try:
            addr = None
            if server is not None:
                addr = (host, server.port)
            store.set(prefix + str(cfg.rank), encode_word(Word(sorted(steps), held, addr)))
            timeout = datetime.timedelta(seconds=cfg.timeout)
            if cfg.rank == 0:  # rank 0 alone reads every rank's word (N requests, not N^2)
                keys = [prefix + str(r) for r in range(cfg.world_size)]
                store.wait(keys, timeout)
                store.set(prefix + "plan", _decide(store, keys, per, cfg.world_size))
                for k in keys:
                    store.delete_key(k)
            store.wait([prefix + "plan"], timeout)
            refused = ""
            try:
                what = f"the side store's {prefix + 'plan'!r}"
                choice, addrs, drop = decode_plan(store.get(prefix + "plan"), what, cfg.world_size)
            except Malformed as e:  # no step: this rank fails its load (below), nothing else
                log.error("rank %d: %s", cfg.rank, e)
                choice, addrs, drop, refused = LoadChoice(None), {}, {}, str(e)
            nodes = sorted({r // per for r in choice.fetch})
            failed: list[str] = []
            done = [f"{prefix}fetched/{n}" for n in nodes]
            if choice.step is not None and nodes:
                self._fetch(store, prefix, choice, addrs, nodes, leader)
                store.wait(done, timeout)
                failed = [f for f in (_outcome(store, k) for k in done) if f != "ok"]
            # Rank 0's worker serves the store: rank 0 goes on (and may close its engine)
            # only once every rank read all it needs from it; then it removes the load's keys.
            store.add(prefix + "read", 1)
            if cfg.rank == 0 and wait_count(store, prefix + "read", cfg.world_size, cfg.timeout):
                with contextlib.suppress(Exception):  # (kept, if not: a few keys per load)
                    for k in [prefix + "plan", prefix + "read", *done]:
                        store.delete_key(k)
            if refused:
                raise NoValidCheckpoint(
                    f"not loading: the ranks could not agree on the step to load: {refused}. "
                    "Nothing was loaded, fetched or dropped; load again. A value there that "
                    "asyncckpt did not write means another program writes to the run's side "
                    "store (its port is open to the job's network)"
                )
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
        addrs: dict[int, tuple[str, int]],
        nodes: list[int],
        leader: bool,
    ) -> None:
        """This node's local rank 0 fetches and commits its node's directory of the step
        chosen, if its node is among ``nodes``; says "ok" or why not in the store."""
        cfg = self.cfg
        node = cfg.rank // cfg.ranks_per_node
        if not leader or node not in nodes:
            return
        assert choice.step is not None
        holder = choice.fetch[cfg.rank]
        outcome = "ok"
        local = LocalStore(self.root)
        tmp = local.stage(_layout.dir_name(self.layout, choice.step), "fetch")
        try:
            if holder not in addrs:
                raise FileNotFoundError(f"rank {holder} serves no replica")
            host, port = addrs[holder]
            manifest = fetch_replica((host, int(port)), node, choice.step, tmp, secret=cfg.secret)
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
        store.set(f"{prefix}fetched/{node}", dumps(outcome))


def _decide(store: SignedStore, keys: list[str], per: int, world_size: int) -> bytes:
    """Rank 0's plan from every rank's word under ``keys``, encoded; a word it refuses makes
    the plan that refusal (every rank then fails its load, saying so)."""
    try:
        said = {r: decode_word(store.get(k), f"the side store's {k!r}") for r, k in enumerate(keys)}
    except Malformed as e:
        log.error("rank 0: %s", e)
        return encode_refusal(str(e))
    return encode_plan(*_plan(said, per, world_size))


def _plan(said: dict[int, Word], per: int, world_size: int) -> Plan:
    """Rank 0's decision from every rank's word: the step every rank loads, the replica
    servers' addresses (``addrs``: holder rank -> (host, port)), and the replicas each
    holder drops once the load's fetches are done (``replicas_not_needed``)."""
    on_disk = {r: s.disk for r, s in said.items()}
    replicas: dict[int, tuple[int, list[int]]] = {}
    addrs = {r: s.addr for r, s in said.items() if s.addr}
    for holder, s in said.items():
        for node, held_steps in s.held.items():
            for r in range(node * per, (node + 1) * per):
                replicas[r] = (holder, held_steps)
    choice = which_step_to_load(on_disk, replicas, world_size)
    drop: dict[int, dict[int, list[int]]] = {}
    if choice.step is not None:
        held = {r: s.held for r, s in said.items()}
        drop = replicas_not_needed(choice.step, on_disk, held, per, world_size)
    return choice, addrs, drop


# ------------------------------------------------------------------ the store's values (JSON)
#: The most characters of a refusal passed on in the plan.
MAX_REFUSAL = 2000


def encode_word(word: Word) -> bytes:
    held = {str(n): steps for n, steps in word.held.items()}
    return dumps({"disk": word.disk, "held": held, "addr": list(word.addr) if word.addr else None})


def decode_word(raw: bytes, what: str) -> Word:
    """A rank's word as ``encode_word`` wrote it, or ``Malformed``."""
    r = Reader(what)
    v = r.record(loads(raw, what), "", ("disk", "held", "addr"))
    return Word(
        r.items(v["disk"], "disk", r.integer),
        r.by_number(v["held"], "held", lambda x, at: r.items(x, at, r.integer)),
        None if v["addr"] is None else _address(r, v["addr"], "addr"),
    )


def encode_plan(
    choice: LoadChoice, addrs: dict[int, tuple[str, int]], drop: dict[int, dict[int, list[int]]]
) -> bytes:
    return dumps(
        {
            "step": choice.step,
            "fetch": {str(r): holder for r, holder in choice.fetch.items()},
            "fell_back": choice.fell_back,
            "reason": choice.reason,
            "addrs": {str(r): list(a) for r, a in addrs.items()},
            "drop": {str(h): {str(n): t for n, t in d.items()} for h, d in drop.items()},
        }
    )


def encode_refusal(why: str) -> bytes:
    return dumps({"refused": why[:MAX_REFUSAL]})


def decode_plan(raw: bytes, what: str, world_size: int) -> Plan:
    """Rank 0's plan as ``encode_plan`` wrote it; ``Malformed`` if it is not one, or if it
    is rank 0's refusal of a rank's word (``encode_refusal``)."""
    r = Reader(what)
    value = loads(raw, what)
    if isinstance(value, dict) and value.keys() == {"refused"}:
        raise Malformed(f"rank 0 {r.text(value['refused'], 'refused')[:MAX_REFUSAL]}")
    keys = ("step", "fetch", "fell_back", "reason", "addrs", "drop")
    v = r.record(value, "", keys)
    last = world_size - 1
    rank = lambda x, at: r.integer(x, at, 0, last)  # noqa: E731
    steps = lambda x, at: r.items(x, at, r.integer)  # noqa: E731
    choice = LoadChoice(
        None if v["step"] is None else r.integer(v["step"], "step"),
        r.by_number(v["fetch"], "fetch", rank, last),
        r.flag(v["fell_back"], "fell_back"),
        r.text(v["reason"], "reason"),
    )
    addrs = r.by_number(v["addrs"], "addrs", lambda x, at: _address(r, x, at), last)
    drop = r.by_number(v["drop"], "drop", lambda x, at: r.by_number(x, at, steps, last), last)
    return choice, addrs, drop


def decode_outcome(raw: bytes, what: str) -> str:
    """A fetching node's word ("ok", or why its fetch failed), or ``Malformed``."""
    return Reader(what).text(loads(raw, what), "")


def _outcome(store: SignedStore, key: str) -> str:
    """A fetching node's word; one refused counts as that fetch's failure."""
    try:
        return decode_outcome(store.get(key), f"the side store's {key!r}")
    except Malformed as e:
        log.error("%s", e)
        return str(e)


def _address(r: Reader, v: Any, at: str) -> tuple[str, int]:
    """A replica server's (host, port)."""
    pair = r.items(v, at, lambda x, _: x)
    if len(pair) != 2:
        r.fail(at, f"expected [host, port], got {len(pair)} item(s)")
    host = r.text(pair[0], f"{at}[0]")
    if not host or len(host) > 255:
        r.fail(f"{at}[0]", "not a host name")
    return host, r.integer(pair[1], f"{at}[1]", 1, 65535)
